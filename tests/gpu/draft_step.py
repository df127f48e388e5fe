# SPDX-License-Identifier: Apache-2.0
"""A Gemma 4 MTP token-tree draft step as the patched drafter runs it
(`Gemma4TreeSpeculator` in vllm/v1/worker/gpu/spec_decode/gemma4/tree.py),
around verify_step.py's stand-in assistant at the E4B assistant's shapes.

The drafter's code imports the engine, which the device machine lacks, so
this module mirrors it over the same persistent buffers: the roots kernel
(`_prepare_tree_draft_roots_kernel`, cut out of the patched module) writes
each request's root; each depth fills its rows' context lengths, positions
and block tables from the roots with `index_select` into row buffers; and
the whole tree's drafting (one assistant forward per depth, its top-k, the
next depth's inputs) is one CUDA graph per padded request count, whose
attention metadata, built at capture, bounds every context by
max_model_len. The trees' draft steps are the patched `SpecTokenTree`'s
(vllm/v1/attention/spec_tree.py, loaded from the patched tree).

Checked, in float32 (TF32 off): three requests (varied contexts across the
sliding window's edge, rejected drafts, one chunked prefill drafting from its
next prompt token, request states out of order) replayed on the graph of 4,
two steps on one graph, against the same drafter run eagerly with metadata
built for the step, and against the drafter before capture (below); a
negative control (the roots kernel skipped, so the graph reads the previous
step's roots) must change drafts.

Timed in the device's dtype, per draft step, at context 1024 for batch 1, 4,
16 and 64 and three trees: the host's time to issue a step and the step's
wall time (issued, then synchronized), for
  before   the drafter before capture: roots gathered by torch ops, and each
           depth's rows built on the host (block tables and positions
           repeated per row, a PAD slot map, context lengths from the host);
  eager    the persistent buffers, run eagerly;
  graph    the roots kernel and one graph replay.
Only the stand-in's own host work is in "before" and "eager"; vLLM's
attention metadata builders add theirs, so the figures understate what the
graph saves.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from tests.gpu.tree_batches import BLOCK_SIZE, Replay, leaf_sibling_tree, planned_tree
from tests.gpu.tree_kernels import cut_kernels_source
from tests.gpu.verify_step import (
    E4B,
    E4B_ASSISTANT,
    TINY,
    TINY_ASSISTANT,
    Assistant,
    Weights,
)

ROOTS_KERNEL = {
    "vllm/v1/worker/gpu/spec_decode/gemma4/tree.py": (
        "_prepare_tree_draft_roots_kernel",
    ),
}
SPEC_TREE_MODULE = "vllm/v1/attention/spec_tree.py"
PAD_SLOT_ID = -1
CONTEXT = 1024
BATCH_SIZES = (1, 4, 16, 64)
# --smoke: a continuation tree of 3 draft depths (rows 1, 2, 1).
SMOKE_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
TREES = {
    "tree K=3 W=4": lambda: leaf_sibling_tree(12),
    "planned 12": lambda: planned_tree(12),
    "planned 32": lambda: planned_tree(32),
}


def load(package: Path, vllm_src: Path) -> tuple[object, type]:
    """(the roots kernel, `SpecTokenTree`) from the patched tree; the kernel's
    module is written into `package`, run_device_checks.py's scratch package
    of stand-ins (on sys.path)."""
    cut = package / "draft_kernels_cut.py"
    cut.write_text(cut_kernels_source(vllm_src, ROOTS_KERNEL))
    kernels = _module("draft_kernels_cut", cut)
    spec_tree = _module("spec_tree", vllm_src / SPEC_TREE_MODULE)
    return kernels._prepare_tree_draft_roots_kernel, spec_tree.SpecTokenTree


def _module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_kv(shapes, num_blocks: int, device, dtype) -> SimpleNamespace:
    """What the assistant reads of the target: its embedding, and random KV
    caches of the last layer of each kind that writes KV."""
    weight = Weights(device, dtype, seed=0)
    first_shared = len(shapes.layer_kinds) - shapes.num_kv_shared_layers
    kv_caches = {}
    for kind in sorted(set(shapes.layer_kinds)):
        index = max(i for i in range(first_shared) if shapes.layer_kinds[i] == kind)
        cache_shape = (num_blocks, BLOCK_SIZE, shapes.kv_heads, shapes.head_dim[kind])
        kv_caches[index] = (weight.noise(*cache_shape), weight.noise(*cache_shape))
    return SimpleNamespace(
        shapes=shapes,
        kv_caches=kv_caches,
        embedding=weight(shapes.vocab, shapes.hidden),
    )


class VerifyOutputs:
    """The target runner's buffers that the roots kernel reads after a verify
    step, rewritten in place per step as the runner's input preparation
    does. Request r's KV lives in blocks 1 + r * blocks_per_request on."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        blocks_per_request: int,
        hidden: int,
        vocab: int,
        device,
        dtype,
    ):
        self.vocab = vocab

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.query_start_loc = zeros(max_num_reqs + 1)
        self.seq_lens = zeros(max_num_reqs)
        self.positions = zeros(max_num_tokens, dtype=torch.int64)
        self.idx_mapping = zeros(max_num_reqs)
        self.num_sampled = zeros(max_num_reqs)
        self.num_rejected = zeros(max_num_reqs)
        self.last_sampled = zeros(max_num_reqs, 1, dtype=torch.int64)
        self.next_prefill_tokens = zeros(max_num_reqs)
        self.hidden_states = zeros(max_num_tokens, hidden, dtype=dtype)
        self.block_table = (
            torch.arange(
                max_num_reqs * blocks_per_request, dtype=torch.int32, device=device
            ).view(max_num_reqs, blocks_per_request)
            + 1
        )
        # The host's upper bound of each request's context (before its
        # rejected drafts), as vLLM's `seq_lens_cpu_upper_bound`.
        self.seq_lens_upper_bound: list[int] = []

    def write(self, requests: list[dict], seed: int) -> None:
        """A step's values. A request: `context` (its KV before the step),
        `query_len` (its rows this step), `num_rejected` (its rows after the
        accepted path), `prefill` (a chunk: it samples nothing and drafts
        from its next prompt token); request states out of order."""
        generator = torch.Generator().manual_seed(seed)
        num_reqs = len(requests)
        starts = [0]
        for request in requests:
            starts.append(starts[-1] + request["query_len"])
        seq_lens = [r["context"] + r["query_len"] for r in requests]
        positions = [r["context"] + i for r in requests for i in range(r["query_len"])]
        self.query_start_loc[: num_reqs + 1] = torch.tensor(starts)
        self.seq_lens[:num_reqs] = torch.tensor(seq_lens)
        self.positions[: len(positions)] = torch.tensor(positions)
        self.idx_mapping[:num_reqs] = torch.randperm(
            len(self.idx_mapping), generator=generator
        )[:num_reqs]
        self.num_sampled[:num_reqs] = torch.tensor(
            [
                0 if r["prefill"] else r["query_len"] - r["num_rejected"]
                for r in requests
            ]
        )
        self.num_rejected[:num_reqs] = torch.tensor(
            [r["num_rejected"] for r in requests]
        )
        for tokens in (self.last_sampled, self.next_prefill_tokens):
            tokens.copy_(torch.randint(self.vocab, tokens.shape, generator=generator))
        self.hidden_states.copy_(
            torch.randn(self.hidden_states.shape, generator=generator)
        )
        self.seq_lens_upper_bound = seq_lens


class TreeDrafter:
    """The patched `Gemma4TreeSpeculator`'s draft of one tree (its
    `_prepare_tree_draft_roots`, `_expand_rows`, `_rows_attention` and
    `_draft_tree`) over the stand-in assistant, and, in `draft_before`, the
    drafter that capture replaced."""

    def __init__(
        self,
        assistant: Assistant,
        unified_attention,
        roots_kernel,
        tree,
        max_num_reqs: int,
        blocks_per_request: int,
    ):
        self.assistant, self.unified_attention = assistant, unified_attention
        self.roots_kernel, self.tree = roots_kernel, tree
        device = assistant.centroids.device
        hidden = assistant.target.shapes.hidden
        self.widths = sorted({step.token_columns.numel() for step in tree.draft_steps})
        max_num_rows = max_num_reqs * self.widths[-1]

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Per row of a draft step (the roots: its first num_reqs rows).
        self.input_ids = zeros(max_num_rows)
        self.hidden_states = zeros(
            max_num_rows, hidden, dtype=assistant.centroids.dtype
        )
        self.positions = zeros(max_num_rows, dtype=torch.int64)
        self.row_seq_lens = zeros(max_num_rows)
        self.row_block_table = zeros(max_num_rows, blocks_per_request)
        self.row_starts = torch.arange(
            max_num_rows + 1, dtype=torch.int32, device=device
        )
        # Per request.
        self.root_positions = zeros(max_num_reqs, dtype=torch.int64)
        self.seq_lens = zeros(max_num_reqs)
        self.draft_tokens = zeros(max_num_reqs, tree.num_nodes, dtype=torch.int64)
        self.row_requests = {
            width: torch.arange(max_num_reqs * width, device=device) // width
            for width in self.widths
        }

    def prepare_roots(
        self, outputs: VerifyOutputs, num_reqs: int, num_reqs_padded: int
    ) -> None:
        self.roots_kernel[(num_reqs_padded,)](
            outputs.query_start_loc,
            outputs.seq_lens,
            outputs.positions,
            outputs.idx_mapping,
            outputs.num_sampled,
            outputs.num_rejected,
            outputs.last_sampled,
            outputs.last_sampled.stride(0),
            outputs.next_prefill_tokens,
            outputs.hidden_states,
            outputs.hidden_states.stride(0),
            self.input_ids,
            self.hidden_states,
            self.hidden_states.stride(0),
            self.root_positions,
            self.seq_lens,
            num_reqs,
            outputs.hidden_states.shape[-1],
            BLOCK_SIZE=1024,
        )

    def expand_rows(self, num_reqs: int, width: int, block_table) -> None:
        num_rows = num_reqs * width
        row_requests = self.row_requests[width][:num_rows]
        torch.index_select(
            self.seq_lens, 0, row_requests, out=self.row_seq_lens[:num_rows]
        )
        torch.index_select(
            self.root_positions, 0, row_requests, out=self.positions[:num_rows]
        )
        torch.index_select(
            block_table, 0, row_requests, out=self.row_block_table[:num_rows]
        )

    def rows_attention(self, num_reqs: int, width: int, max_seqlen_k: int) -> dict:
        num_rows = num_reqs * width
        return {
            "block_table": self.row_block_table[:num_rows],
            "cu_seqlens_q": self.row_starts[: num_rows + 1],
            "seq_lens": self.row_seq_lens[:num_rows],
            "max_seqlen_q": 1,
            "max_seqlen_k": max_seqlen_k,
        }

    def draft(
        self,
        num_reqs: int,
        block_table: torch.Tensor,
        attention_by_width: dict | None = None,
        max_seqlen_k: int | None = None,
    ) -> None:
        """From the roots, into `draft_tokens`: with `attention_by_width` (a
        graph's) from persistent buffers only; else each width's metadata
        built once its rows are filled, bounded by `max_seqlen_k`."""
        depth_tokens: list[torch.Tensor] = []
        row_states = self.hidden_states.new_empty(0)
        width = 0
        attention = None
        for step in self.tree.draft_steps:
            if step.token_columns.numel() != width:
                width = step.token_columns.numel()
                self.expand_rows(num_reqs, width, block_table)
                attention = (
                    attention_by_width[width]
                    if attention_by_width is not None
                    else self.rows_attention(num_reqs, width, max_seqlen_k)
                )
            num_rows = num_reqs * width
            if depth_tokens:
                tokens = depth_tokens[-1][:, step.token_columns]
                self.input_ids[:num_rows] = tokens.flatten()
                self.hidden_states[:num_rows] = row_states[:, step.state_rows].flatten(
                    0, 1
                )
            states, candidates = self.assistant.forward(
                self.unified_attention,
                {
                    "tokens": self.input_ids[:num_rows],
                    "hidden": self.hidden_states[:num_rows],
                    "positions": self.positions[:num_rows],
                    "attention": attention,
                },
                step.num_top_tokens,
            )
            depth_tokens.append(candidates.reshape(num_reqs, -1)[:, step.child_columns])
            row_states = states.view(num_reqs, width, -1)
        self.draft_tokens[:num_reqs] = torch.cat(depth_tokens, dim=1)

    def capture(
        self, outputs: VerifyOutputs, num_reqs_padded: int, max_model_len: int
    ) -> Replay:
        """The graph of a draft of `num_reqs_padded` requests, captured as the
        patched drafter captures it: no request's roots, every context
        bounded by max_model_len."""
        self.input_ids[:num_reqs_padded].zero_()
        self.hidden_states[:num_reqs_padded].zero_()
        self.root_positions[:num_reqs_padded].zero_()
        self.seq_lens[:num_reqs_padded].fill_(1)
        attention_by_width = {
            width: self.rows_attention(num_reqs_padded, width, max_model_len)
            for width in self.widths
        }
        return Replay(
            lambda: self.draft(
                num_reqs_padded, outputs.block_table, attention_by_width
            ),
            self.assistant.centroids.device.type,
        )

    def draft_eager(self, outputs: VerifyOutputs, num_reqs: int) -> None:
        self.prepare_roots(outputs, num_reqs, num_reqs)
        self.draft(
            num_reqs,
            outputs.block_table,
            max_seqlen_k=max(outputs.seq_lens_upper_bound[:num_reqs]),
        )

    def draft_replayed(
        self, outputs: VerifyOutputs, num_reqs: int, graph: Replay, num_reqs_padded: int
    ) -> None:
        self.prepare_roots(outputs, num_reqs, num_reqs_padded)
        graph()

    def draft_before(self, outputs: VerifyOutputs, num_reqs: int) -> torch.Tensor:
        """The drafter before capture (the patched module's parent commit):
        roots gathered by torch ops, and each width's rows built anew (block
        tables, context lengths and positions repeated per row, a PAD slot
        map, the bound from the host)."""
        device = self.input_ids.device
        num_rejected = outputs.num_rejected[:num_reqs]
        rows = (outputs.query_start_loc[1 : num_reqs + 1] - num_rejected - 1).long()
        idx_mapping = outputs.idx_mapping[:num_reqs].long()
        tokens = torch.where(
            outputs.num_sampled[:num_reqs] > 0,
            outputs.last_sampled[idx_mapping, 0],
            outputs.next_prefill_tokens[idx_mapping].long(),
        )
        root_positions = outputs.positions[rows]
        seq_lens = outputs.seq_lens[:num_reqs] - num_rejected
        hidden = outputs.hidden_states[rows]
        max_seqlen_k = max(outputs.seq_lens_upper_bound[:num_reqs])
        depth_tokens: list[torch.Tensor] = []
        row_states = hidden.new_empty(0)
        width = 0
        for step in self.tree.draft_steps:
            if step.token_columns.numel() != width:
                width = step.token_columns.numel()
                num_rows = num_reqs * width
                positions = root_positions.repeat_interleave(width)
                slot_mapping = torch.full(
                    (num_rows,), PAD_SLOT_ID, dtype=torch.int64, device=device
                )
                attention = {
                    "block_table": outputs.block_table[:num_reqs].repeat_interleave(
                        width, dim=0
                    ),
                    "cu_seqlens_q": torch.arange(
                        num_rows + 1, dtype=torch.int32, device=device
                    ),
                    "seq_lens": seq_lens.repeat_interleave(width),
                    "max_seqlen_q": 1,
                    "max_seqlen_k": max_seqlen_k,
                    "slot_mapping": slot_mapping,
                }
            if depth_tokens:
                tokens = depth_tokens[-1][:, step.token_columns].flatten()
                hidden = row_states[:, step.state_rows].flatten(0, 1)
            states, candidates = self.assistant.forward(
                self.unified_attention,
                {
                    "tokens": tokens,
                    "hidden": hidden,
                    "positions": positions,
                    "attention": attention,
                },
                step.num_top_tokens,
            )
            depth_tokens.append(candidates.reshape(num_reqs, -1)[:, step.child_columns])
            row_states = states.view(num_reqs, width, -1)
        return torch.cat(depth_tokens, dim=1)


def stand_in(
    shapes, assistant_shapes, max_num_reqs: int, max_model_len: int, device, dtype
):
    """(assistant, blocks per request) with KV room for max_num_reqs requests
    of max_model_len tokens."""
    blocks_per_request = -(-max_model_len // BLOCK_SIZE)
    kv = target_kv(shapes, max_num_reqs * blocks_per_request + 1, device, dtype)
    return Assistant(assistant_shapes, kv, device, dtype), blocks_per_request


def check(
    unified_attention, roots_kernel, spec_token_tree, device, smoke: bool
) -> dict:
    """Replayed drafts against eager ones and the drafter before capture, in
    float32, for 3 requests on the graph of 4, two steps; and the control."""
    shapes, assistant_shapes = (TINY, TINY_ASSISTANT) if smoke else (E4B, E4B_ASSISTANT)
    window = shapes.window
    max_model_len = 4 * window
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        assistant, blocks_per_request = stand_in(
            shapes, assistant_shapes, 4, max_model_len, device, torch.float32
        )
        tree = spec_token_tree(SMOKE_TREE if smoke else planned_tree(12), device)
        query_len = 1 + tree.num_nodes
        outputs = VerifyOutputs(
            4,
            4 * query_len,
            blocks_per_request,
            shapes.hidden,
            shapes.vocab,
            device,
            torch.float32,
        )
        drafter = TreeDrafter(
            assistant, unified_attention, roots_kernel, tree, 4, blocks_per_request
        )
        graph = drafter.capture(outputs, 4, max_model_len)
        steps = [
            [
                {
                    "context": window - 5,
                    "query_len": query_len,
                    "num_rejected": tree.num_nodes - 2,
                    "prefill": False,
                },
                {
                    "context": 2 * window + 3,
                    "query_len": query_len,
                    "num_rejected": 0,
                    "prefill": False,
                },
                {"context": 7, "query_len": 5, "num_rejected": 0, "prefill": True},
            ],
            [
                {
                    "context": 3 * window,
                    "query_len": query_len,
                    "num_rejected": tree.num_nodes,
                    "prefill": False,
                },
                {
                    "context": window + 1,
                    "query_len": 5,
                    "num_rejected": 0,
                    "prefill": True,
                },
                {
                    "context": window // 2,
                    "query_len": query_len,
                    "num_rejected": tree.num_nodes // 3,
                    "prefill": False,
                },
            ],
        ]
        eager, before, replayed = [], [], []
        for seed, requests in enumerate(steps):
            outputs.write(requests, seed)
            drafter.draft_eager(outputs, len(requests))
            eager.append(drafter.draft_tokens[: len(requests)].clone())
            before.append(drafter.draft_before(outputs, len(requests)))
            drafter.draft_replayed(outputs, len(requests), graph, 4)
            replayed.append(drafter.draft_tokens[: len(requests)].clone())
        # The control: the first step's inputs, its roots not rewritten.
        outputs.write(steps[0], 0)
        graph()
        stale = drafter.draft_tokens[:3].cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    replay_equal = all(torch.equal(r, e) for r, e in zip(replayed, eager))
    before_equal = all(torch.equal(b, e) for b, e in zip(before, eager))
    changed = int((stale != eager[0].cpu()).any(dim=1).sum())
    return {
        "tree_nodes": tree.num_nodes,
        "draft_depths": len(tree.draft_steps),
        "requests": 3,
        "graph_requests": 4,
        "steps": len(steps),
        "nodes_compared": sum(e.numel() for e in eager),
        "replayed_equal_eager": replay_equal,
        "before_equal_eager": before_equal,
        "negative_control_requests_changed": changed,
        "passed": replay_equal and before_equal and changed > 0,
    }


def timings(
    unified_attention,
    roots_kernel,
    spec_token_tree,
    device,
    dtype,
    smoke: bool,
    deadline: float,
) -> dict:
    """Host µs to issue and wall ms per draft step, before / eager / graph,
    interleaved and repeated, by tree and batch size."""
    shapes, assistant_shapes = (TINY, TINY_ASSISTANT) if smoke else (E4B, E4B_ASSISTANT)
    context = 40 if smoke else CONTEXT
    batches = (1, 2) if smoke else BATCH_SIZES
    trees = (
        {"smoke": SMOKE_TREE}
        if smoke
        else {name: paths() for name, paths in TREES.items()}
    )
    repeats = 1 if smoke else 20
    max_num_reqs = max(batches)
    max_model_len = context + 64
    assistant, blocks_per_request = stand_in(
        shapes, assistant_shapes, max_num_reqs, max_model_len, device, dtype
    )
    outputs = VerifyOutputs(
        max_num_reqs,
        max_num_reqs * 33,
        blocks_per_request,
        shapes.hidden,
        shapes.vocab,
        device,
        dtype,
    )
    results: dict = {"context": context, "by_tree": {}, "skipped_past_time_limit": []}
    for name, paths in trees.items():
        tree = spec_token_tree(paths, device)
        drafter = TreeDrafter(
            assistant,
            unified_attention,
            roots_kernel,
            tree,
            max_num_reqs,
            blocks_per_request,
        )
        by_batch = results["by_tree"].setdefault(name, {})
        for batch in batches:
            if time.perf_counter() > deadline:
                results["skipped_past_time_limit"].append(
                    f"draft step {name} batch {batch}"
                )
                continue
            # After a verify of the whole tree that accepted 2 nodes.
            query_len = 1 + tree.num_nodes
            outputs.write(
                [
                    {
                        "context": context - query_len,
                        "query_len": query_len,
                        "num_rejected": tree.num_nodes - 2,
                        "prefill": False,
                    }
                ]
                * batch,
                seed=batch,
            )
            point = time_point(drafter, outputs, batch, max_model_len, repeats)
            if device == "cuda":
                torch.cuda.empty_cache()  # the graph's pool
            by_batch[str(batch)] = point
            print(
                f"  {name}, batch {batch}: "
                + ", ".join(
                    f"{mode} {t['host_us']:.0f} µs host / {t['step_ms']:.2f} ms"
                    for mode, t in point.items()
                ),
                flush=True,
            )
    return results


def time_point(
    drafter: TreeDrafter,
    outputs: VerifyOutputs,
    batch: int,
    max_model_len: int,
    repeats: int,
) -> dict:
    """The three modes at one batch size, on a graph captured for it."""
    device = drafter.input_ids.device.type
    graph = drafter.capture(outputs, batch, max_model_len)
    times = interleaved_times(
        {
            "before": lambda: drafter.draft_before(outputs, batch),
            "eager": lambda: drafter.draft_eager(outputs, batch),
            "graph": lambda: drafter.draft_replayed(outputs, batch, graph, batch),
        },
        device,
        repeats,
    )
    return times


def interleaved_times(modes: dict, device, repeats: int) -> dict:
    """Per mode, the medians of the host's time to issue a step and of the
    step's wall time (issued, then synchronized), the modes interleaved."""

    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()

    for issue in modes.values():  # compile and warm up
        issue()
    synchronize()
    host: dict = {mode: [] for mode in modes}
    wall: dict = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, issue in modes.items():
            started = time.perf_counter()
            issue()
            issued = time.perf_counter()
            synchronize()
            wall[mode].append(time.perf_counter() - started)
            host[mode].append(issued - started)

    def median(values: list) -> float:
        return sorted(values)[len(values) // 2]

    return {
        mode: {"host_us": 1e6 * median(host[mode]), "step_ms": 1e3 * median(wall[mode])}
        for mode in modes
    }
