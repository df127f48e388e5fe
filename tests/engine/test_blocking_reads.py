# SPDX-License-Identifier: Apache-2.0
"""A token tree on Model Runner V2 adds no blocking device-to-host read to a
step, so async scheduling keeps the next step's scheduling off the critical
path: counted on the GPU configuration, TRITON_ATTN (its kernels under
Triton's interpreter), against upstream's chain step.

Counted while the model runner executes a step (`execute_model` and
`sample_tokens`): `.item()`, `.tolist()`, `.cpu()`, blocking `.to("cpu")`,
`torch.tensor(data, device=...)`, `nonzero`, and a tensor taken as a Python
bool, int, float or index. On CPU every tensor lives on the host, so a call
counts whatever the tensor: the tree's own code makes none at all, and a tree
step makes no more than a chain step. The tree's tokens also equal plain
greedy decoding through the same backend (tie-aware)."""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from .conftest import greedy_generate, make_llm, plain_greedy_reference, shutdown
from .identity import assert_greedy_identical
from .model_runner_v2 import select_triton_attention
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_PROMPTS = 2
MAX_TOKENS = 10
# The tree's own modules in Model Runner V2.
TREE_MODULES = ("v1/worker/gpu/spec_decode/tree/", "v1/worker/gpu/spec_decode/gemma4/tree.py")
VLLM_ROOT = Path(__import__("vllm").__file__).parent


def caller_site() -> str:
    """The innermost vLLM frame outside torch that made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if path.is_relative_to(VLLM_ROOT):
            return f"{path.relative_to(VLLM_ROOT)}:{frame.lineno}"
    return "outside vllm"


class ReadCounter:
    """Counts, per call site, the calls that block on a device read."""

    METHODS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__",
               "__index__")

    def __init__(self) -> None:
        self.counting = False
        self.sites: Counter[str] = Counter()

    def record(self) -> None:
        if self.counting:
            self.sites[caller_site()] += 1

    @contextlib.contextmanager
    def installed(self, monkeypatch):
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.counted(original))
        to, tensor = torch.Tensor.to, torch.tensor

        def counted_to(self_, *args, **kwargs):
            target = args[0] if args else kwargs.get("device")
            if str(target) == "cpu" and not kwargs.get("non_blocking", False):
                self.record()
            return to(self_, *args, **kwargs)

        def counted_tensor(*args, **kwargs):
            if kwargs.get("device") is not None:
                self.record()
            return tensor(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", counted_to)
        monkeypatch.setattr(torch, "tensor", counted_tensor)
        yield self

    def counted(self, original):
        def method(self_, *args, **kwargs):
            self.record()
            return original(self_, *args, **kwargs)

        return method


def count_steps(llm, counter: ReadCounter):
    """Runs the prompts, counting each step's reads: their tokens, and per
    step whether it verified drafts of every request (no prefill) and its
    reads by call site."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    steps: list[tuple[bool, Counter[str]]] = []
    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

    def counted_execute(scheduler_output, *args, **kwargs):
        counter.sites = Counter()
        counter.counting = True
        verifies = bool(scheduler_output.scheduled_spec_decode_tokens) and all(
            scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            for req_id in scheduler_output.num_scheduled_tokens)
        steps.append((verifies, counter.sites))
        try:
            return execute_model(scheduler_output, *args, **kwargs)
        finally:
            counter.counting = False

    def counted_sample(*args, **kwargs):
        counter.counting = True
        try:
            return sample_tokens(*args, **kwargs)
        finally:
            counter.counting = False

    runner.execute_model, runner.sample_tokens = counted_execute, counted_sample
    try:
        tokens = greedy_generate(llm, text_prompts(NUM_PROMPTS, length=60), MAX_TOKENS)
    finally:
        runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    return tokens, steps


@pytest.fixture
def triton_attention(monkeypatch):
    """TRITON_ATTN for this test's engines; vLLM caches the backend chosen
    for a layer configuration, so the cache is emptied around them."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    select_triton_attention(monkeypatch.setattr)
    yield
    selector._cached_get_attn_backend.cache_clear()


@pytest.mark.usefixtures("triton_attention")
def test_a_tree_step_reads_back_nothing_a_chain_step_does_not(monkeypatch):
    target, assistant = trained_pair()
    options = dict(max_num_seqs=NUM_PROMPTS, kv_cache_memory_bytes=16 << 20)
    llm = make_llm(target, **options)
    reference = plain_greedy_reference(llm, text_prompts(NUM_PROMPTS, length=60), MAX_TOKENS)
    shutdown(llm)

    counter = ReadCounter()
    results = {}
    with counter.installed(monkeypatch):
        for name, speculative in (
            ("chain", {"num_speculative_tokens": 3}),
            ("tree", {"num_speculative_tokens": 3, "tree_width": 4}),
        ):
            llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                                    **speculative}, **options)
            try:
                backends = {g.backend.get_name() for groups in
                            llm.llm_engine.model_executor.driver_worker.worker
                            .model_runner.attn_groups for g in groups}
                assert backends == {"TRITON_ATTN"}, backends
                results[name] = count_steps(llm, counter)
            finally:
                shutdown(llm)

    assert_greedy_identical(results["tree"][0], reference,
                            "Model Runner V2, TRITON_ATTN, MTP tree K=3 W=4")
    verify_steps = {name: [sites for verifies, sites in steps if verifies]
                    for name, (_, steps) in results.items()}
    for name, steps in verify_steps.items():
        assert steps, f"no {name} step verified drafts of every request"
    chain_reads = [sum(sites.values()) for sites in verify_steps["chain"]]
    tree_reads = [sum(sites.values()) for sites in verify_steps["tree"]]
    tree_sites = Counter()
    for sites in verify_steps["tree"]:
        tree_sites.update(sites)
    print(f"blocking reads per verify step: chain {sorted(set(chain_reads))} over "
          f"{len(chain_reads)} steps, tree {sorted(set(tree_reads))} over "
          f"{len(tree_reads)} steps; tree sites {dict(tree_sites)}")
    in_tree_code = [site for site in tree_sites if site.startswith(TREE_MODULES)]
    assert not in_tree_code, in_tree_code
    assert max(tree_reads) <= min(chain_reads)
