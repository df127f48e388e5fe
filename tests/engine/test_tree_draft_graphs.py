# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 MTP tree drafting from persistent buffers, as a FULL CUDA graph
replays it, on the GPU configuration (TRITON_ATTN, its kernels under Triton's
interpreter).

This CPU cannot capture a CUDA graph, so the speculator's own graph manager
(`TreeDraftCudaGraphManager`, FULL mode) keeps what its capture would
record instead: the forward function built at capture, with the attention
metadata built then for a dummy batch, run again at every "replay" with no
new argument. A draft that read anything but persistent buffers (a snapshot
in the metadata, a root not rewritten, a host value of another step) drafts
other tokens than the same step run eagerly, with metadata built for it.

Per served draft step: the replayed drafts equal the eager drafts; outside
the replay the host allocates no tensor and builds none from host data
(`draft_host_work.py`); the engine stays token-identical to plain greedy
decoding (tie-aware), and drafts are accepted. A control whose captured
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
)
from .draft_host_work import HostWork
from .identity import assert_greedy_identical
from .test_blocking_reads import triton_attention  # noqa: F401
from .test_mtp_tree import CONTINUATION_12
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

# Batch 4 drafts the whole tree, batch 1 five nodes: two graphs, padded
# request counts (3 requests replay the graph of 4) and three row widths.
SCHEDULE = [[1, 1, 5], [2, 4, 12]]
MAX_TOKENS = [24, 12, 12, 2]


def replaying_graphs(speculator, monkeypatch) -> dict:
    """Gives `speculator` its FULL graph manager, whose capture keeps each
    descriptor's forward function and whose replay runs it again."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform

    # Engines here run eagerly: no graph pool, no capture sizes.
    monkeypatch.setattr(type(current_platform), "get_global_graph_pool",
                        lambda self: None)
    compilation_config = speculator.vllm_config.compilation_config
    monkeypatch.setattr(compilation_config, "decode_cudagraph_capture_request_sizes",
                        [1, 2, 4])
    monkeypatch.setattr(compilation_config, "max_cudagraph_capture_size", 4)
    monkeypatch.setattr(type(speculator.vllm_config),
                        "get_draft_decode_cudagraph_request_sizes", lambda self: [1, 2, 4])
    speculator.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    manager = speculator.tree_cudagraph_manager
    assert manager.needs_capture(), "TRITON_ATTN tree drafting captures no graph"
    recorded = {"captured": [], "replays": 0}

    @torch.inference_mode()
    def capture(create_forward_fn, progress_bar_desc=""):
        for desc in manager._capture_descs[CUDAGraphMode.FULL]:
            create_forward_fn(desc, warmup=True)(CUDAGraphMode.NONE)
            forward_fn = create_forward_fn(desc, warmup=False)
            forward_fn(CUDAGraphMode.NONE)  # the captured run
            manager.graphs[desc] = forward_fn
            recorded["captured"].append((desc.num_reqs, desc.num_speculative_tokens))
        manager._graphs_captured = True

    def run_fullgraph(desc):
        recorded["replays"] += 1
        manager.graphs[desc](CUDAGraphMode.NONE)

    monkeypatch.setattr(manager, "capture", capture)
    monkeypatch.setattr(manager, "run_fullgraph", run_fullgraph)
    speculator.capture()
    return recorded


def compare_with_eager(speculator, monkeypatch) -> list[dict]:
    """Runs every replayed draft step again eagerly (metadata built for the
    step) and records both drafts."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    manager = speculator.tree_cudagraph_manager
    propose, eager_propose = speculator.propose, type(speculator).propose
    dispatch_tree = manager.dispatch_tree
    steps = []

    def eager_dispatch(num_reqs, num_nodes):
        return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_reqs,
                                        num_reqs=num_reqs)

    def compared_propose(*args, **kwargs):
        desc = dispatch_tree(args[0].num_reqs, kwargs.get("num_speculative_tokens")
                             or speculator.num_speculative_steps)
        drafts = propose(*args, **kwargs).clone()
        if kwargs.get("dummy_run") or desc.cg_mode != CUDAGraphMode.FULL:
            return drafts
        manager.dispatch_tree = eager_dispatch
        try:
            eager = eager_propose(speculator, *args, **kwargs).clone()
        finally:
            manager.dispatch_tree = dispatch_tree
        steps.append({"num_reqs": args[0].num_reqs, "desc_reqs": desc.num_reqs,
                      "num_nodes": desc.num_speculative_tokens,
                      "replayed": drafts, "eager": eager})
        # The eager run rewrote the drafts: the replay's are returned.
        speculator.draft_tokens[: args[0].num_reqs] = drafts
        return speculator.draft_tokens[: args[0].num_reqs]

    monkeypatch.setattr(speculator, "propose", compared_propose)
    return steps


def serve(target, assistant, monkeypatch, max_tokens: list[int],
          snapshot_seq_lens: bool = False):
    llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                            "speculative_token_tree": str(CONTINUATION_12),
                            "num_speculative_tokens_per_batch_size": SCHEDULE},
                   max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        speculator = runner.speculator
        if snapshot_seq_lens:
            rows_attention = speculator._rows_attention

            def snapshot(tree, num_reqs, for_capture=False, **kwargs):
                if not for_capture:
                    return rows_attention(tree, num_reqs, for_capture, **kwargs)
                row_seq_lens = speculator.row_seq_lens
                speculator.row_seq_lens = row_seq_lens.clone()
                try:
                    return rows_attention(tree, num_reqs, for_capture, **kwargs)
                finally:
                    speculator.row_seq_lens = row_seq_lens

            monkeypatch.setattr(speculator, "_rows_attention", snapshot)
        recorded = replaying_graphs(speculator, monkeypatch)
        work = HostWork()
        work.install(speculator, monkeypatch)
        steps = compare_with_eager(speculator, monkeypatch)
        prompts = text_prompts(len(max_tokens), length=60)
        outputs = _greedy_outputs(llm, prompts, max_tokens)
        return ([list(o.token_ids) for o in outputs], recorded, work, steps,
                accepted_tokens_per_node(llm))
    finally:
        shutdown(llm)


@pytest.mark.usefixtures("triton_attention")
def test_replayed_tree_drafts_equal_eager_drafts_with_no_host_work(monkeypatch):
    target, assistant = trained_pair()
    llm = make_llm(target, max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
    reference = plain_greedy_reference(llm, text_prompts(len(MAX_TOKENS), length=60),
                                       MAX_TOKENS)
    shutdown(llm)

    tokens, recorded, work, steps, accepted = serve(target, assistant, monkeypatch,
                                                    MAX_TOKENS)
    summary = work.summary()
    print("captured (requests, nodes):", recorded["captured"])
    print("draft steps:", json.dumps(summary))
    print("replayed steps (requests -> graph, nodes):",
          [(s["num_reqs"], s["desc_reqs"], s["num_nodes"]) for s in steps])
    print("accepted per node:", accepted)

    assert_greedy_identical(tokens, reference, "MTP tree drafted from replayed graphs")
    assert sum(accepted.values()) > 0
    assert {s["num_nodes"] for s in steps} == {5, 12}
    assert any(s["desc_reqs"] > s["num_reqs"] for s in steps), "no padded replay"
    assert summary["replayed_steps"] == summary["steps"] == len(steps) > 0
    for step in steps:
        assert torch.equal(step["replayed"], step["eager"]), step
    assert summary["allocated_per_step"] == [0, 0], summary["allocated_ops"]
    assert summary["host_built_per_step"] == [0, 0], summary["host_built_calls"]


@pytest.mark.usefixtures("triton_attention")
def test_control_captured_metadata_with_a_snapshot_drafts_differently(monkeypatch):
    target, assistant = trained_pair()
    _, recorded, _, steps, _ = serve(target, assistant, monkeypatch, [6, 6],
                                     snapshot_seq_lens=True)
    assert recorded["replays"] > 0
    differing = [s for s in steps if not torch.equal(s["replayed"], s["eager"])]
    print(f"control: {len(differing)} of {len(steps)} replayed steps drafted differently")
    assert differing
