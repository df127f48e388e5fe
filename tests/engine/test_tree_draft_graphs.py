# SPDX-License-Identifier: Apache-2.0
"""Tree drafting in FULL CUDA graphs, replayed from persistent buffers, on the
GPU configuration (TRITON_ATTN, its kernels under Triton's interpreter): the
Gemma 4 MTP assistant (one graph per draft, every depth of it) and a draft
model (the chain's draft prefill and fused decode graphs, the decode's keyed
by the tree's depth).

The speculators capture with their own code; what the capture records is
replayed as `replayed_graphs.py` says. Per served draft step: the replayed
drafts equal the same step's drafts run eagerly (metadata built for it); the
engine stays token-identical to plain greedy decoding (tie-aware) and drafts
are accepted. Outside the replay, a Gemma 4 draft step allocates no tensor
and builds none from host data (`draft_host_work.py`); a draft model's tree
step does no more host work than its chain step. A control whose captured
metadata holds a snapshot of the rows' context lengths drafts differently.
"""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import (
    _greedy_outputs,
    accepted_tokens_per_node,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from .draft_host_work import HostWork
from .identity import assert_greedy_identical
from .replayed_graphs import ReplayedGraphs
from .test_blocking_reads import triton_attention  # noqa: F401
from .test_mtp_tree import CONTINUATION_12
from .trained_pair import perturbed_draft_model, text_prompts, trained_pair

pytestmark = pytest.mark.engine

# Batch 2 to 4 drafts the whole tree, batch 1 five nodes: graphs of two node
# counts, padded request counts (3 requests replay the graph of 4) and, with
# CONTINUATION_12, three row widths.
SCHEDULE = [[1, 1, 5], [2, 4, 12]]
MAX_TOKENS = [16, 8, 8, 2]
REQUEST_SIZES = [1, 2, 4]
OPTIONS = {"max_num_seqs": 4, "kv_cache_memory_bytes": 16 << 20}


def graph_managers(speculator) -> list:
    if hasattr(speculator, "tree_cudagraph_manager"):
        return [speculator.tree_cudagraph_manager]
    return [speculator.prefill_cudagraph_manager, speculator.decode_cudagraph_manager]


def compare_with_eager(speculator, graphs: ReplayedGraphs, monkeypatch) -> list[dict]:
    """Runs every draft step that replayed a graph again eagerly and keeps
    both drafts; the replay's are returned."""
    propose, eager_propose = speculator.propose, type(speculator).propose
    steps = []

    def compared_propose(*args, **kwargs):
        replays = graphs.replays
        drafts = propose(*args, **kwargs).clone()
        if kwargs.get("dummy_run") or graphs.replays == replays:
            return drafts
        with ReplayedGraphs.eager(*graph_managers(speculator)):
            eager = eager_propose(speculator, *args, **kwargs).clone()
        num_reqs = args[0].num_reqs
        steps.append({"num_reqs": num_reqs,
                      "num_nodes": kwargs.get("num_speculative_tokens"),
                      "replays": graphs.replays - replays,
                      "replayed": drafts, "eager": eager})
        speculator.draft_tokens[:num_reqs] = drafts
        return speculator.draft_tokens[:num_reqs]

    monkeypatch.setattr(speculator, "propose", compared_propose)
    return steps


def serve(target, speculative_config, monkeypatch, max_tokens: list[int],
          capture_hook=None, **options):
    """Serves greedy requests with the speculator's graphs replayed; returns
    tokens, graphs, host work, compared steps and accepted tokens per node."""
    from vllm.config.compilation import CUDAGraphMode

    llm = make_llm(target, speculative_config, **OPTIONS, **options)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        speculator = runner.speculator
        graphs = ReplayedGraphs(monkeypatch)
        ReplayedGraphs.capture_sizes(speculator.vllm_config, monkeypatch, REQUEST_SIZES)
        speculator.init_cudagraph_manager(CUDAGraphMode.FULL_DECODE_ONLY)
        if capture_hook is not None:
            capture_hook(speculator, monkeypatch)
        speculator.capture()
        assert graphs.captured, "the speculator captured no graph"
        work = HostWork()
        work.install(speculator, monkeypatch)
        steps = compare_with_eager(speculator, graphs, monkeypatch)
        outputs = _greedy_outputs(llm, text_prompts(len(max_tokens), length=60), max_tokens)
        return ([list(o.token_ids) for o in outputs], graphs, work, steps,
                accepted_tokens_per_node(llm), spec_decode_counters(llm))
    finally:
        shutdown(llm)


def assert_replays_equal_eager(steps: list[dict]) -> None:
    assert steps, "no draft step replayed a graph"
    for step in steps:
        assert torch.equal(step["replayed"], step["eager"]), step


@pytest.fixture(scope="module")
def reference():
    target, _ = trained_pair()
    llm = make_llm(target, **OPTIONS)
    try:
        return plain_greedy_reference(llm, text_prompts(len(MAX_TOKENS), length=60),
                                      MAX_TOKENS)
    finally:
        shutdown(llm)


@pytest.mark.usefixtures("triton_attention")
def test_gemma4_tree_drafts_replay_with_no_host_work(monkeypatch, reference):
    target, assistant = trained_pair()
    tokens, graphs, work, steps, accepted, _ = serve(
        target, {"method": "mtp", "model": str(assistant),
                 "speculative_token_tree": str(CONTINUATION_12),
                 "num_speculative_tokens_per_batch_size": SCHEDULE},
        monkeypatch, MAX_TOKENS)
    summary = work.summary()
    print("captured (requests, nodes):",
          [(d.num_reqs, d.num_speculative_tokens) for d in graphs.captured])
    print("draft steps:", json.dumps(summary))
    print("replayed steps (requests, nodes):",
          [(s["num_reqs"], s["num_nodes"]) for s in steps])
    print("accepted per node:", accepted)

    assert_greedy_identical(tokens, reference, "Gemma 4 MTP tree, replayed graphs")
    assert accepted.get((1, 0), 0) + accepted.get((0, 1), 0) > 0, accepted
    assert {s["num_nodes"] for s in steps} == {5, 12}
    assert any(s["num_reqs"] == 3 for s in steps), "no padded replay"
    assert summary["replayed_steps"] == summary["steps"] == len(steps)
    assert all(s["replays"] == 1 for s in steps), "a draft is one replay"
    assert_replays_equal_eager(steps)
    assert summary["allocated_per_step"] == [0, 0], summary["allocated_ops"]
    assert summary["host_built_per_step"] == [0, 0], summary["host_built_calls"]


@pytest.mark.usefixtures("triton_attention")
def test_draft_model_tree_drafts_replay_with_the_chains_host_work(monkeypatch, reference):
    target, _ = trained_pair()
    draft = {"method": "draft_model", "model": str(perturbed_draft_model())}
    results = {}
    for name, speculative in (
        ("chain", {"num_speculative_tokens": 3}),
        ("tree", {"num_speculative_tokens": 3, "tree_width": 4,
                  "num_speculative_tokens_per_batch_size": SCHEDULE}),
    ):
        with monkeypatch.context() as patch:
            results[name] = serve(target, {**draft, **speculative}, patch, MAX_TOKENS,
                                  disable_hybrid_kv_cache_manager=True)
    tokens, graphs, work, steps, accepted, _ = results["tree"]
    chain_work = results["chain"][2].summary()
    summary = work.summary()
    print("captured (mode, requests, tokens, steps):",
          [(d.cg_mode.name, d.num_reqs, d.num_tokens,
            getattr(d, "num_speculative_tokens", None)) for d in graphs.captured])
    print("tree draft steps:", json.dumps(summary))
    print("chain draft steps:", json.dumps(chain_work))
    print("replayed steps (requests, nodes, replays):",
          [(s["num_reqs"], s["num_nodes"], s["replays"]) for s in steps])
    print("accepted per node:", accepted)
    for name, result in results.items():
        print(f"{name}: accepted per depth {result[5]['num_accepted_tokens_per_pos']}, "
              f"{result[5]['num_drafts']} drafts")

    assert_greedy_identical(tokens, reference, "draft_model tree, replayed graphs")
    assert accepted.get((1,), 0) + accepted.get((0, 1), 0) > 0, accepted
    # A step drafting no nodes still runs the draft prefill (the draft KV).
    assert {s["num_nodes"] for s in steps} >= {5, 12}
    assert_replays_equal_eager(steps)
    assert summary["allocated_per_step"][1] <= chain_work["allocated_per_step"][1]
    assert summary["host_built_per_step"][1] <= chain_work["host_built_per_step"][1]


@pytest.mark.usefixtures("triton_attention")
def test_control_captured_metadata_with_a_snapshot_drafts_differently(monkeypatch):
    def snapshot_row_seq_lens(speculator, patch):
        rows_attention = speculator._rows_attention

        def snapshot(num_reqs, width, for_capture=False, **kwargs):
            if not for_capture:
                return rows_attention(num_reqs, width, for_capture, **kwargs)
            row_seq_lens = speculator.row_seq_lens
            speculator.row_seq_lens = row_seq_lens.clone()
            try:
                return rows_attention(num_reqs, width, for_capture, **kwargs)
            finally:
                speculator.row_seq_lens = row_seq_lens

        patch.setattr(speculator, "_rows_attention", snapshot)

    target, assistant = trained_pair()
    _, graphs, _, steps, _, _ = serve(
        target, {"method": "mtp", "model": str(assistant),
                 "speculative_token_tree": str(CONTINUATION_12)},
        monkeypatch, [6, 6], capture_hook=snapshot_row_seq_lens)
    differing = [s for s in steps if not torch.equal(s["replayed"], s["eager"])]
    print(f"control: {len(differing)} of {len(steps)} replayed steps drafted differently")
    assert graphs.replays > 0 and differing
