# SPDX-License-Identifier: Apache-2.0
"""Batches of tree verify for the device checks: trees, the per-request query
rows with their ancestor masks and position shifts, the kernel's inputs, and
calls timed or replayed from a CUDA graph."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


def planned_tree(budget: int) -> list[tuple[int, ...]]:
    """The planner's tree of `budget` nodes for HumanEval traffic (continuation
    branches included), from the E[L] harness's committed run."""
    results = json.loads((ROOT / "docs/benchmarks/el_results.json").read_text())
    paths = results["planner"]["budgets"][str(budget)]["planned"]["tree"]
    return sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))


def leaf_sibling_tree(num_nodes: int, width: int = 4) -> list[tuple[int, ...]]:
    """A spine of num_nodes / width with width - 1 siblings per depth (vLLM's
    `leaf_sibling_token_tree`, here because the device machine has no vLLM)."""
    paths, spine = [], ()
    for _ in range(num_nodes // width):
        paths += [spine + (rank,) for rank in range(width)]
        spine += (0,)
    return sorted(paths, key=lambda p: (len(p), p))


def random_tree(rng: random.Random, num_nodes: int) -> list[tuple[int, ...]]:
    """A random tree, breadth-first: each node a new child of the root or of
    an earlier node (the in-tree tests' `random_token_tree`, here because the
    device machine has no vLLM)."""
    paths: list[tuple[int, ...]] = []
    children: dict[tuple[int, ...], int] = {}
    for _ in range(num_nodes):
        parent = rng.choice([(), *paths])
        rank = children.get(parent, 0)
        children[parent] = rank + 1
        paths.append(parent + (rank,))
    return sorted(paths, key=lambda p: (len(p), p))


def tree_rows(paths: list[tuple[int, ...]], num_nodes: int):
    """Per query row (root, then the first num_nodes nodes): the ancestor
    bitmask over the rows and the depth."""
    paths = paths[:num_nodes]
    index = {path: i + 1 for i, path in enumerate(paths)}
    masks, depths = [1], [0]
    for path in paths:
        mask = 1 | (1 << index[path])
        for end in range(1, len(path)):
            mask |= 1 << index[path[:end]]
        masks.append(mask)
        depths.append(len(path))
    return masks, depths


class Request:
    """A prefill chunk (query_len > 1, no tree), a plain decode, or a tree of
    which the first num_nodes nodes are verified."""

    def __init__(self, context_len, query_len=1, paths=None, num_nodes=None):
        self.context_len = context_len
        self.masks, self.depths = [-1] * query_len, [None] * query_len
        if paths is not None:
            num_nodes = len(paths) if num_nodes is None else num_nodes
            self.masks, self.depths = tree_rows(paths, num_nodes)
            query_len = 1 + num_nodes
        self.query_len = query_len
        self.seq_len = context_len + query_len

    def shifts(self) -> list[int]:
        return [0 if d is None else i - d for i, d in enumerate(self.depths)]


def batch_metadata(requests, device, blocks_per_request=None, mask_dtype=None) -> dict:
    """The kernel's per-batch inputs for `requests`: request r's KV lives in
    blocks 1 + r * blocks_per_request onwards (block 0 unused). Ancestor masks
    are int32 when every tree has at most 32 rows, as TRITON_ATTN keeps them,
    else int64 (or `mask_dtype`)."""
    if blocks_per_request is None:
        blocks_per_request = max(-(-r.seq_len // BLOCK_SIZE) for r in requests)
    block_table = (
        torch.arange(
            len(requests) * blocks_per_request, dtype=torch.int32, device=device
        ).view(len(requests), blocks_per_request)
        + 1
    )
    query_lens = torch.tensor([r.query_len for r in requests], device=device)
    cu_seqlens_q = torch.zeros(len(requests) + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = query_lens.cumsum(0)
    seq_lens = torch.tensor(
        [r.seq_len for r in requests], dtype=torch.int32, device=device
    )
    if mask_dtype is None:
        fits = all(r.query_len <= 32 for r in requests if r.depths[-1] is not None)
        mask_dtype = torch.int32 if fits else torch.int64
    # int32: the same bits, bit 31 the sign.
    tree_ancestor_bits = torch.tensor(
        [m for r in requests for m in r.masks], dtype=torch.int64, device=device
    ).to(mask_dtype)
    tree_shift = torch.tensor(
        [s for r in requests for s in r.shifts()], dtype=torch.int32, device=device
    )
    return dict(
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        max_seqlen_q=int(query_lens.max()),
        max_seqlen_k=int(seq_lens.max()),
        tree_ancestor_bits=tree_ancestor_bits,
        tree_shift=tree_shift,
    )


def make_inputs(
    requests,
    num_heads,
    num_kv_heads,
    head_size,
    dtype,
    device,
    randomize=True,
    mask_dtype=None,
):
    """`batch_metadata` plus random queries and a KV cache holding every
    request's context."""
    metadata = batch_metadata(requests, device, mask_dtype=mask_dtype)
    num_tokens = sum(r.query_len for r in requests)
    num_blocks = metadata["block_table"].numel() + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    make = torch.randn if randomize else torch.empty
    return dict(
        query=make(num_tokens, num_heads, head_size, dtype=dtype, device=device),
        key_cache=make(*shape, dtype=dtype, device=device),
        value_cache=make(*shape, dtype=dtype, device=device),
        **metadata,
    )


def run(unified_attention, inputs, window, use_tree=True):
    """The patched kernel on `inputs` (window: the sliding window, None for
    full attention); without use_tree, the kernel without the tree inputs."""
    output = torch.empty_like(inputs["query"])
    num_seqs, num_kv_heads = len(inputs["seq_lens"]), inputs["key_cache"].shape[2]
    ones = torch.ones(num_seqs, num_kv_heads, device=output.device)
    unified_attention(
        q=inputs["query"],
        k=inputs["key_cache"],
        v=inputs["value_cache"],
        out=output,
        cu_seqlens_q=inputs["cu_seqlens_q"],
        max_seqlen_q=inputs["max_seqlen_q"],
        seqused_k=inputs["seq_lens"],
        max_seqlen_k=inputs["max_seqlen_k"],
        softmax_scale=inputs["query"].shape[-1] ** -0.5,
        causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
        block_table=inputs["block_table"],
        softcap=0,
        q_descale=None,
        k_descale=ones,
        v_descale=ones,
        tree_ancestor_bits=inputs["tree_ancestor_bits"] if use_tree else None,
        tree_pos_shift=inputs["tree_shift"] if use_tree else None,
    )
    return output


def time_ms(function, device, repeats: int) -> float:
    function()  # compile and warm up
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        times = []
        for _ in range(repeats):
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]
    started = time.perf_counter()
    function()
    return 1000 * (time.perf_counter() - started)


class Replay:
    """`function()` on fixed buffers: on CUDA captured once in a CUDA graph and
    then replayed, so that a caller rewrites the buffers' contents between
    replays as vLLM's runner does; elsewhere (the Triton interpreter cannot be
    captured) called again eagerly on the same buffers."""

    def __init__(self, function, device: str):
        self.function = function
        self.graph = None
        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                function()  # compiles the kernels outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.output = function()

    def __call__(self):
        if self.graph is None:
            return self.function()
        self.graph.replay()
        return self.output
