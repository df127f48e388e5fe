# SPDX-License-Identifier: Apache-2.0
"""Device checks of tree verify on CUDA: the patched Triton unified attention
kernel, compiled on the GPU, against a dense reference and replayed from a
CUDA graph; a whole verify step at Gemma 4 E4B shapes timed, and the tokens/s
of each configuration projected from it; the kernel timed for chain and tree
verify at Gemma 4 E4B and 31B attention shapes.

Needs only torch and Triton: the kernel's two source files are loaded from the
patched tree under stand-ins for the few vllm modules they import, so vLLM
need not be installed on the GPU machine. From the repository root, after
`bash ci/test.sh` laid out the patched tree in build/vllm-patched:

    python tests/gpu/run_device_checks.py --out docs/benchmarks-gpu.json
    python tests/gpu/run_device_checks.py --render docs/benchmarks-gpu.json

(with the device tool, carry build/vllm-patched/vllm/v1/attention/ops,
build/vllm-patched/vllm/v1/attention/spec_tree.py,
build/vllm-patched/vllm/v1/worker/gpu/spec_decode/tree and
build/vllm-patched/vllm/v1/worker/gpu/spec_decode/gemma4). On one
H200, in at most about 8 minutes (no timing starts past --time-limit-s):
(a) correctness cases in bfloat16, every row against a float32 dense
reference, and a negative control (the mask dropped) that must fail; (b) the
tree kernel captured in a CUDA graph and replayed after rewriting its buffers
for other batches, against eager calls, with a negative control; (c) the
whole step (tests/gpu/verify_step.py) at n = 0, 3, 12, 16 and 32 nodes, batch
1 / 4 / 16 / 64, contexts 1k / 8k, the projected tokens/s and the node count
a tree schedule would draft at each batch size; (d) verify attention per layer
for chain K=3 (4 query rows per request) and trees of 12, 16 and 32 nodes
(leaf-sibling, W=4), contexts 1k / 8k / 32k, batch 1 / 8 / 32, and the whole
model's attention time per extra node; (e) the tree walk, tree rows and KV
commit kernels against the interpreter's results, and timed
(tests/gpu/tree_kernels.py); (f) a Gemma 4 MTP tree draft step captured in
one CUDA graph, its replays against eager drafts, and timed with the host's
work against the drafter before capture (tests/gpu/draft_step.py). The
second command puts the figures into docs/benchmarks-gpu.md.

Attention shapes, from the published configs: E4B has 42 layers (35 sliding: 8
query heads, 2 KV heads, head_dim 256, window 512; 7 full: head_dim 512, 2 KV
heads); 31B has 60 layers (50 sliding: 32 query heads, 16 KV heads, head_dim
256, window 1024; 10 full: head_dim 512, 4 KV heads).

Without a GPU, `TRITON_INTERPRET=1 python tests/gpu/run_device_checks.py
--smoke` runs the same code on CPU tensors in float32 at tiny sizes, the
graph replays as repeated eager calls on the same rewritten buffers.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gpu import draft_step, tree_kernels, verify_step  # noqa: E402
from tests.gpu.tree_batches import (  # noqa: E402
    BLOCK_SIZE,
    Replay,
    Request,
    batch_metadata,
    leaf_sibling_tree,
    make_inputs,
    planned_tree,
    random_tree,
    run,
    time_ms,
)

KERNEL_FILES = ("triton_unified_attention.py", "triton_attention_helpers.py")

# name -> {layer kind: (layers, query heads, KV heads, head_dim, window)}
MODELS = {
    "E4B": {"sliding": (35, 8, 2, 256, 512), "full": (7, 8, 2, 512, None)},
    "31B": {"sliding": (50, 32, 16, 256, 1024), "full": (10, 32, 4, 512, None)},
}
# Verify rows per request: chain K=3, leaf-sibling trees K x W=4.
CONFIGS = {"chain_k3": 3, "tree_12": 12, "tree_16": 16, "tree_32": 32}

STAND_INS = {
    "vllm/__init__.py": "",
    "vllm/envs.py": "VLLM_BATCH_INVARIANT = False\n",
    "vllm/logger.py": "import logging\n\ninit_logger = logging.getLogger\n",
    "vllm/platforms/__init__.py": """\
import torch


class _Platform:
    def fp8_dtype(self):
        return torch.float8_e4m3fn

    def is_cuda(self):
        return torch.cuda.is_available()

    def is_rocm(self):
        return False

    def is_device_capability_family(self, family):
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return (major * 10 + minor) // 10 == family // 10


current_platform = _Platform()
""",
    "vllm/triton_utils/__init__.py": """\
import triton
import triton.language as tl

HAS_TRITON = True
""",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/ops/__init__.py": "",
    "vllm/v1/kv_cache_interface.py": """\
from enum import IntEnum


class KVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
""",
}


def kernel_package(vllm_src: Path) -> Path:
    """A scratch package, put on sys.path, of the patched attention kernel's
    files plus stand-ins for their vllm imports (tree_kernels.py adds the
    other tree kernels)."""
    package = Path(tempfile.mkdtemp(prefix="tree-kernel-"))
    for name, text in STAND_INS.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    for name in KERNEL_FILES:
        source = vllm_src / "vllm/v1/attention/ops" / name
        if not source.exists():
            raise SystemExit(
                f"{source} is missing: lay out the patched tree first "
                "(bash ci/test.sh) or pass --vllm-src"
            )
        (package / "vllm/v1/attention/ops" / name).write_text(source.read_text())
    if "vllm" in sys.modules:
        raise SystemExit("vllm is already imported: run this script on its own")
    sys.path.insert(0, str(package))
    return package


def load_unified_attention(package: Path):
    """The patched kernel's `unified_attention`, from `kernel_package`."""
    module = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
    return module.unified_attention


def reference(requests, inputs, window):
    """Float32 dense attention: a tree node sees the context and root before
    the window edge of its RoPE position (root + depth) and its ancestors;
    other rows are causal with a window from their position."""
    query, key_cache, value_cache = (
        inputs[k].float() for k in ("query", "key_cache", "value_cache")
    )
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    output = torch.empty_like(query)
    row = 0
    for r, request in enumerate(requests):
        slots = torch.arange(request.seq_len, device=query.device)
        blocks = inputs["block_table"][r, slots // BLOCK_SIZE].long()
        keys = key_cache[blocks, slots % BLOCK_SIZE].repeat_interleave(
            num_heads // num_kv_heads, dim=1
        )
        values = value_cache[blocks, slots % BLOCK_SIZE].repeat_interleave(
            num_heads // num_kv_heads, dim=1
        )
        key_positions = slots.clone()
        in_tree = request.depths[0] is not None
        if in_tree:
            key_positions[request.context_len :] = request.context_len + torch.tensor(
                request.depths, device=query.device
            )
        for i in range(request.query_len):
            flat = request.context_len + i
            position = request.context_len + (request.depths[i] if in_tree else i)
            visible = slots <= flat
            if window:
                visible &= position - key_positions < window
            if in_tree:
                block = slots >= request.context_len
                bits = torch.tensor(
                    [(request.masks[i] >> j) & 1 for j in range(request.query_len)],
                    dtype=torch.bool,
                    device=query.device,
                )
                visible[block] &= bits
            scores = torch.einsum("hd,khd->hk", query[row + i], keys)
            scores = scores * query.shape[-1] ** -0.5
            scores[:, ~visible] = float("-inf")
            output[row + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
        row += request.query_len
    return output


def correctness(unified_attention, device, dtype, smoke: bool) -> dict:
    """Mixed batches of random and leaf-sibling trees, truncated trees, a
    prefill chunk and plain decodes, at each model's layer shapes."""
    rng = random.Random(0)
    shapes = (
        {"small": (4, 2, 32, 8), "small_full": (4, 1, 64, None)}
        if smoke
        else {
            f"{m} {k}": (h, kv, d, w)
            for m, kinds in MODELS.items()
            for k, (_, h, kv, d, w) in kinds.items()
        }
    )
    context = 40 if smoke else 1500
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    results = {}
    for name, (heads, kv_heads, head_size, window) in shapes.items():
        requests = [
            Request(context, query_len=17),
            Request(
                context + 3, paths=random_tree(rng, 32), num_nodes=rng.randrange(1, 33)
            ),
            Request(context + 9),
            Request(context + 5, paths=leaf_sibling_tree(12)),
            Request(context + 1, paths=random_tree(rng, 16), num_nodes=16),
        ]
        inputs = make_inputs(requests, heads, kv_heads, head_size, dtype, device)
        expected = reference(requests, inputs, window)
        error = (run(unified_attention, inputs, window).float() - expected).abs().max()
        dropped = dict(
            inputs, tree_ancestor_bits=torch.full_like(inputs["tree_ancestor_bits"], -1)
        )
        control = (run(unified_attention, dropped, window).float() - expected).abs()
        bad_rows = int((control.flatten(1).max(dim=1).values > tolerance).sum())
        results[name] = {
            "max_abs_error": float(error),
            "passed": float(error) <= tolerance,
            "negative_control_bad_rows": bad_rows,
        }
        print(
            f"  {name}: max |error| {float(error):.2e} (tolerance {tolerance:g}); "
            f"mask dropped: {bad_rows} rows off",
            flush=True,
        )
    return results


def graph_replay(unified_attention, device, dtype, smoke: bool) -> dict:
    """The tree variant of the kernel captured once in a CUDA graph on fixed
    per-token buffers, as vLLM's runner captures it, then replayed after
    rewriting the buffers' contents for batches of other shapes: every replay
    must equal the eager call on that batch alone, and a replay whose tree
    buffers were not rewritten must not. The batches fill the captured token
    and sequence counts with padding sequences of no query rows, as vLLM pads
    a batch to a captured size."""
    heads, kv_heads, head_size, window = (
        (4, 2, 32, 8) if smoke else MODELS["E4B"]["sliding"][1:]
    )
    context = 40 if smoke else 1500
    rng = random.Random(1)
    cases = {
        "no tree rows (masks -1, shifts 0)": [
            Request(context + i, query_len=4) for i in range(3)
        ],
        "tree K=3 W=4": [
            Request(context + i, paths=leaf_sibling_tree(12)) for i in range(4)
        ],
        "32-node continuation tree": [
            Request(context + i, paths=planned_tree(32)) for i in range(4)
        ],
        "prefill chunk + tree + plain decode": [
            Request(context, query_len=17),
            Request(context + 3, paths=leaf_sibling_tree(12)),
            Request(context + 9),
            Request(context + 5, paths=random_tree(rng, 32), num_nodes=20),
        ],
    }
    num_seqs = max(len(requests) for requests in cases.values())
    num_tokens = max(sum(r.query_len for r in requests) for requests in cases.values())
    blocks_per_request = -(
        -max(r.seq_len for c in cases.values() for r in c) // BLOCK_SIZE
    )
    cache_shape = (num_seqs * blocks_per_request + 1, BLOCK_SIZE, kv_heads, head_size)
    static = dict(
        query=torch.randn(num_tokens, heads, head_size, dtype=dtype, device=device),
        key_cache=torch.randn(*cache_shape, dtype=dtype, device=device),
        value_cache=torch.randn(*cache_shape, dtype=dtype, device=device),
        **batch_metadata(
            [Request(0)] * num_seqs, device, blocks_per_request, torch.int64
        ),
    )
    static["tree_ancestor_bits"] = torch.full(
        (num_tokens,), -1, dtype=torch.int64, device=device
    )
    static["tree_shift"] = torch.zeros(num_tokens, dtype=torch.int32, device=device)
    # Host-side bounds of the captured launch (they only pick the kernel's
    # variant; the batch's own lengths are read from the buffers).
    static["max_seqlen_q"] = num_tokens
    static["max_seqlen_k"] = blocks_per_request * BLOCK_SIZE

    def padded(requests) -> tuple[dict, dict]:
        """The batch alone, and its contents padded to the captured sizes."""
        # The captured buffers' int64: the 32-node tree has 33 rows.
        alone = batch_metadata(requests, device, blocks_per_request, torch.int64)
        rows = sum(r.query_len for r in requests)
        alone["query"] = torch.randn(rows, heads, head_size, dtype=dtype, device=device)
        for name in ("key_cache", "value_cache"):
            alone[name] = static[name]
        pad_seqs, pad_rows = num_seqs - len(requests), num_tokens - rows
        contents = dict(
            query=torch.cat((alone["query"], static["query"][rows:])),
            block_table=torch.cat(
                (alone["block_table"], static["block_table"][len(requests) :])
            ),
            cu_seqlens_q=torch.cat(
                (alone["cu_seqlens_q"], alone["cu_seqlens_q"][-1:].repeat(pad_seqs))
            ),
            seq_lens=torch.cat(
                (alone["seq_lens"], alone["seq_lens"].new_zeros(pad_seqs))
            ),
            tree_ancestor_bits=torch.cat(
                (
                    alone["tree_ancestor_bits"],
                    alone["tree_ancestor_bits"].new_full((pad_rows,), -1),
                )
            ),
            tree_shift=torch.cat(
                (alone["tree_shift"], alone["tree_shift"].new_zeros(pad_rows))
            ),
        )
        return alone, contents

    replay = Replay(lambda: run(unified_attention, static, window), device)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    results = {}
    prepared = {name: padded(requests) for name, requests in cases.items()}
    for name, (alone, contents) in prepared.items():
        for buffer, value in contents.items():
            static[buffer].copy_(value)
        rows = len(alone["query"])
        difference = float(
            (replay()[:rows] - run(unified_attention, alone, window)).abs().max()
        )
        results[name] = {
            "max_abs_difference": difference,
            "passed": difference <= tolerance,
        }
        print(
            f"  replay after rewriting for {name}: max |replay - eager| "
            f"{difference:.2e}",
            flush=True,
        )
    # Negative control: the K=3 W=4 batch written over the 32-node one's, all
    # but the tree buffers.
    for buffer, value in prepared["32-node continuation tree"][1].items():
        static[buffer].copy_(value)
    alone, contents = prepared["tree K=3 W=4"]
    for buffer, value in contents.items():
        if buffer not in ("tree_ancestor_bits", "tree_shift"):
            static[buffer].copy_(value)
    rows = len(alone["query"])
    stale = (replay()[:rows] - run(unified_attention, alone, window)).abs()
    bad_rows = int((stale.flatten(1).max(dim=1).values > tolerance).sum())
    results["negative_control_bad_rows"] = bad_rows
    print(f"  tree buffers not rewritten: {bad_rows} rows off", flush=True)
    return results


def timings(unified_attention, device, dtype, smoke: bool, deadline: float) -> dict:
    contexts, batches = ((40,), (1, 2)) if smoke else ((1024, 8192, 32768), (1, 8, 32))
    models = (
        {"tiny": {"sliding": (2, 4, 2, 32, 8), "full": (1, 4, 1, 64, None)}}
        if smoke
        else MODELS
    )
    results = {}
    for model, kinds in models.items():
        for context in contexts:
            for batch in batches:
                if time.perf_counter() > deadline:
                    results.setdefault("skipped_past_time_limit", []).append(
                        f"{model} ctx {context} batch {batch}"
                    )
                    continue
                by_config = {}
                for config, num_nodes in CONFIGS.items():
                    paths = (
                        None
                        if config.startswith("chain")
                        else leaf_sibling_tree(num_nodes)
                    )
                    # Trees of at most 32 rows run with int32 masks, as
                    # TRITON_ATTN keeps them; timed with int64 masks too.
                    mask_dtypes = {"": None}
                    if paths is not None and num_nodes < 32:
                        mask_dtypes["_int64_masks"] = torch.int64
                    by_config[config] = {}
                    for suffix, mask_dtype in mask_dtypes.items():
                        per_kind = {}
                        for kind, (_, heads, kv_heads, head_size, window) in kinds.items():
                            requests = [
                                Request(context, query_len=1 + num_nodes)
                                if paths is None
                                else Request(context, paths=paths)
                                for _ in range(batch)
                            ]
                            inputs = make_inputs(
                                requests,
                                heads,
                                kv_heads,
                                head_size,
                                dtype,
                                device,
                                randomize=False,
                                mask_dtype=mask_dtype,
                            )
                            per_kind[kind] = time_ms(
                                functools.partial(
                                    run,
                                    unified_attention,
                                    inputs,
                                    window,
                                    use_tree=paths is not None,
                                ),
                                device,
                                repeats=3 if smoke else 25,
                            )
                        by_config[config][f"per_layer_ms{suffix}"] = per_kind
                        by_config[config][f"model_ms{suffix}"] = sum(
                            kinds[k][0] * ms for k, ms in per_kind.items()
                        )
                chain = by_config["chain_k3"]["model_ms"]
                for config, num_nodes in CONFIGS.items():
                    extra = num_nodes - CONFIGS["chain_k3"]
                    r = by_config[config]
                    r["ms_per_extra_node"] = (
                        (r["model_ms"] - chain) / extra if extra else 0.0
                    )
                results[f"{model} ctx {context} batch {batch}"] = by_config
                print(
                    f"  {model} ctx {context} batch {batch}: "
                    + ", ".join(
                        f"{c} {r['model_ms']:.3f} ms" for c, r in by_config.items()
                    )
                    + "; int64 masks / int32 masks "
                    + ", ".join(
                        f"{c} {r['model_ms_int64_masks'] / r['model_ms']:.3f}"
                        for c, r in by_config.items()
                        if "model_ms_int64_masks" in r
                    )
                    + "; per extra node "
                    + ", ".join(
                        f"{r['ms_per_extra_node']:.4f}"
                        for c, r in by_config.items()
                        if c != "chain_k3"
                    ),
                    flush=True,
                )
    return results


GRAPH_CASES = (
    "no tree rows (masks -1, shifts 0)",
    "tree K=3 W=4",
    "32-node continuation tree",
    "prefill chunk + tree + plain decode",
)
FIGURES_BEGIN, FIGURES_END = "<!-- figures: begin -->", "<!-- figures: end -->"


def render(summary: dict | None) -> str:
    """The figures of docs/benchmarks-gpu.md from the script's JSON; with
    none, the same tables with empty cells."""
    summary = summary or {}
    replays = summary.get("graph_replay", {})
    step = summary.get("verify_step", {})

    def cell(value, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    lines = [
        f"Device: {summary.get('device', '—')}, {summary.get('dtype', '—')}; "
        f"the script ran {cell(summary.get('wall_s'), '.0f')} s.",
        "",
        "**CUDA graph replay of the tree kernel** (E4B sliding-layer shape, one "
        "capture; max |replay − eager|):",
        "",
        "| batch written into the captured buffers | max difference | equal |",
        "|---|---|---|",
    ]
    for name in GRAPH_CASES:
        result = replays.get(name, {})
        passed = result.get("passed")
        lines.append(
            f"| {name} | {cell(result.get('max_abs_difference'), '.2e')} | "
            f"{'—' if passed is None else 'yes' if passed else 'NO'} |"
        )
    lines.append(
        "| negative control: K=3 W=4 over the 32-node tree, tree buffers not "
        f"rewritten | rows off: {cell(replays.get('negative_control_bad_rows'), 'd')} | |"
    )
    configs = verify_step.configurations()
    for context in verify_step.CONTEXTS:
        rows_needed = sorted(
            {
                r
                for paths, _ in configs.values()
                if paths
                for r in verify_step.draft_rows(paths)
            }
        )
        lines += [
            "",
            f"**Step parts at context {context}, ms** (verify forward by node "
            "count n; one draft depth by its rows per request):",
            "",
            "| batch | "
            + " | ".join(f"verify n={n}" for n in verify_step.NODE_COUNTS)
            + " | "
            + " | ".join(f"draft {r} row{'s' if r > 1 else ''}" for r in rows_needed)
            + " |",
            "|---" * (1 + len(verify_step.NODE_COUNTS) + len(rows_needed)) + "|",
        ]
        for batch in verify_step.BATCH_SIZES:
            point = step.get(f"ctx {context} batch {batch}", {})
            verify = point.get("verify_ms_by_num_nodes", {})
            draft = point.get("draft_depth_ms_by_rows", {})
            lines.append(
                f"| {batch} | "
                + " | ".join(
                    cell(verify.get(str(n), {}).get("ms"), ".2f")
                    for n in verify_step.NODE_COUNTS
                )
                + " | "
                + " | ".join(
                    cell(draft.get(str(r), {}).get("ms"), ".2f") for r in rows_needed
                )
                + " |"
            )
        lines += [
            "",
            f"**Projected output tokens/s at context {context}** (E[L] of the "
            "trained pair; the fastest per batch size in bold):",
            "",
            "| configuration | nodes | E[L] | "
            + " | ".join(f"batch {b}" for b in verify_step.BATCH_SIZES)
            + " |",
            "|---|---|---|" + "---|" * len(verify_step.BATCH_SIZES),
        ]
        for name, (paths, mean_acceptance_length) in configs.items():
            row = f"| {name} | {len(paths) if paths else 0} | {mean_acceptance_length:.2f} |"
            for batch in verify_step.BATCH_SIZES:
                projected = step.get(f"ctx {context} batch {batch}", {}).get(
                    "projected", {}
                )
                value = projected.get("by_config", {}).get(name, {}).get("tokens_per_s")
                text = cell(value, ".0f")
                row += (
                    f" **{text}** |" if projected.get("best") == name else f" {text} |"
                )
            lines.append(row)
        lines.append(
            "| a tree schedule would draft n = | | | "
            + " | ".join(
                cell(
                    step.get(f"ctx {context} batch {b}", {})
                    .get("projected", {})
                    .get("schedule_num_nodes"),
                    "d",
                )
                for b in verify_step.BATCH_SIZES
            )
            + " |"
        )
    kernels = summary.get("tree_kernels", {})
    kernel_times = kernels.get("timings", {})
    commit = kernel_times.get("kv_commit", {})
    lines += [
        "",
        "**The other tree kernels** (compiled on the device, every case bit for "
        f"bit against Triton's interpreter; timed for {cell(kernel_times.get('requests'), 'd')} "
        f"requests with the {cell(kernel_times.get('tree_nodes'), 'd')}-node tree):",
        "",
        "| kernel | cases | equal to the interpreter | µs per step |",
        "|---|---|---|---|",
    ]
    for name, label, key in (
        ("walk", "tree walk", "walk_us"),
        ("rows", "tree rows", "rows_us"),
        ("kv_commit", "KV commit, E4B's 42 KV caches, 3 accepted nodes", None),
    ):
        result = kernels.get(name, {})
        passed = result.get("passed")
        microseconds = kernel_times.get(key) if key else commit.get("kernel_us")
        lines.append(
            f"| {label} | {cell(result.get('cases'), 'd')} | "
            f"{'—' if passed is None else 'yes' if passed else 'NO'} | "
            f"{cell(microseconds, '.1f')} |"
        )
    lines.append(
        "| the per-cache torch copies the KV commit replaced | | | "
        f"{cell(commit.get('per_cache_copies_us'), '.1f')} "
        f"({cell(commit.get('per_cache_over_kernel'), '.1f')}x the kernel's) |"
    )
    drafts = summary.get("draft_step", {})
    draft_check = drafts.get("check", {})
    lines += [
        "",
        "**A Gemma 4 MTP tree draft step in one CUDA graph** (stand-in E4B "
        f"assistant, context {cell(drafts.get('context'), 'd')}; per step, the "
        "host's time to issue it and its wall time, issued then synchronized):",
        "",
        "| tree | batch | before capture: host µs | ms | eager, persistent "
        "buffers: host µs | ms | graph: host µs | ms | graph ms / before ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in draft_step.TREES:
        for batch in draft_step.BATCH_SIZES:
            point = drafts.get("by_tree", {}).get(name, {}).get(str(batch), {})
            row = f"| {name} | {batch} |"
            for mode in ("before", "eager", "graph"):
                times = point.get(mode, {})
                row += (
                    f" {cell(times.get('host_us'), '.0f')} |"
                    f" {cell(times.get('step_ms'), '.2f')} |"
                )
            ratio = (
                point["graph"]["step_ms"] / point["before"]["step_ms"]
                if point
                else None
            )
            lines.append(row + f" {cell(ratio, '.2f')} |")
    equal = draft_check.get("replayed_equal_eager")
    lines += [
        "",
        f"Replayed drafts (3 requests on the graph of 4, two steps, float32): "
        f"{cell(draft_check.get('nodes_compared'), 'd')} nodes, "
        f"{'—' if equal is None else 'equal' if equal else 'NOT equal'} to the "
        "eager drafts; with the roots not rewritten, "
        f"{cell(draft_check.get('negative_control_requests_changed'), 'd')} of 3 "
        "requests drafted differently.",
    ]
    skipped = step.get("skipped_past_time_limit", []) + drafts.get(
        "skipped_past_time_limit", []
    )
    if skipped:
        lines += ["", f"Skipped past the time limit: {', '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def render_into(doc: Path, summary: dict | None) -> None:
    """Rewrites the figures between the markers of `doc`."""
    text = doc.read_text()
    head, rest = text.split(FIGURES_BEGIN + "\n")
    _, tail = rest.split(FIGURES_END)
    doc.write_text(head + FIGURES_BEGIN + "\n" + render(summary) + FIGURES_END + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-src", type=Path, default=ROOT / "build" / "vllm-patched"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the results as JSON here (rewritten after every part)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (for TRITON_INTERPRET=1 on CPU)",
    )
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=420,
        help="start no timing past this many seconds (what is left is listed "
        "as skipped), so that the script fits a lease of the device",
    )
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only put the figures of this JSON (the script's --out) into "
        "docs/benchmarks-gpu.md; 'none' writes empty tables",
    )
    args = parser.parse_args()
    if args.render:
        summary = (
            None if str(args.render) == "none" else json.loads(args.render.read_text())
        )
        render_into(ROOT / "docs" / "benchmarks-gpu.md", summary)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started = time.perf_counter()
    deadline = started + args.time_limit_s
    package = kernel_package(args.vllm_src)
    unified_attention = load_unified_attention(package)
    tree_kernel_modules = tree_kernels.load(package, args.vllm_src)
    tree_kernels_reference = tree_kernels.InterpreterResults(args.vllm_src, args.smoke)
    roots_kernel, spec_token_tree = draft_step.load(package, args.vllm_src)
    name = (
        torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    )
    summary: dict = {"device": name, "dtype": str(dtype)}

    def save() -> None:
        summary["wall_s"] = time.perf_counter() - started
        if args.out:
            args.out.write_text(json.dumps(summary, indent=2) + "\n")

    print(f"* Device: {name}, {dtype}", flush=True)
    print("* Correctness against the dense reference", flush=True)
    summary["correctness"] = correctness(unified_attention, device, dtype, args.smoke)
    save()
    print(
        "* CUDA graph replay of the tree kernel"
        + (" (repeated eager calls: no CUDA here)" if device != "cuda" else ""),
        flush=True,
    )
    summary["graph_replay"] = graph_replay(unified_attention, device, dtype, args.smoke)
    save()
    print(
        "* The walk, tree rows and KV commit kernels against the interpreter, "
        "and timed",
        flush=True,
    )
    summary["tree_kernels"] = tree_kernels.checks(
        *tree_kernel_modules, tree_kernels_reference, device, args.smoke
    )
    save()
    print(
        "* A Gemma 4 MTP tree draft step captured in one CUDA graph"
        + (
            " (replayed as repeated eager calls: no CUDA here)"
            if device != "cuda"
            else ""
        )
        + ": replays against eager drafts, and timed with the host's work",
        flush=True,
    )
    summary["draft_step"] = {
        "check": draft_step.check(
            unified_attention, roots_kernel, spec_token_tree, device, args.smoke
        ),
        **draft_step.timings(
            unified_attention,
            roots_kernel,
            spec_token_tree,
            device,
            dtype,
            args.smoke,
            deadline,
        ),
    }
    draft_check = summary["draft_step"]["check"]
    print(
        f"  {draft_check['nodes_compared']} drafted nodes: replayed = eager "
        f"{draft_check['replayed_equal_eager']}, before capture = eager "
        f"{draft_check['before_equal_eager']}; roots not rewritten changed "
        f"{draft_check['negative_control_requests_changed']} of "
        f"{draft_check['requests']} requests",
        flush=True,
    )
    save()
    print(
        "* A whole step at Gemma 4 E4B shapes"
        + (" (tiny shapes with --smoke)" if args.smoke else "")
        + ": verify and drafting",
        flush=True,
    )
    summary["verify_step"] = verify_step.step_times(
        unified_attention, device, dtype, args.smoke, deadline
    )
    save()
    print("* Verify attention time per target forward (all layers)", flush=True)
    summary["timings"] = timings(unified_attention, device, dtype, args.smoke, deadline)
    save()
    failed = [
        n
        for n, r in summary["correctness"].items()
        if not r["passed"] or r["negative_control_bad_rows"] == 0
    ]
    replays = summary["graph_replay"]
    failed += [
        f"graph replay: {n}"
        for n, r in replays.items()
        if isinstance(r, dict) and not r["passed"]
    ]
    if replays["negative_control_bad_rows"] == 0:
        failed.append("graph replay: stale tree buffers changed no row")
    failed += [
        f"{name} kernel differs from the interpreter"
        for name, result in summary["tree_kernels"].items()
        if name != "timings" and not result["passed"]
    ]
    if summary["tree_kernels"]["walk"]["negative_control_mismatched_cases"] == 0:
        failed.append("tree walk: shifted parents changed no case")
    if not draft_check["replayed_equal_eager"]:
        failed.append("draft step: a replayed draft differs from the eager one")
    if not draft_check["before_equal_eager"]:
        failed.append("draft step: the drafter before capture drafts differently")
    if draft_check["negative_control_requests_changed"] == 0:
        failed.append("draft step: roots not rewritten changed no draft")
    consistency = summary["verify_step"].get("consistency")
    if consistency and not consistency["passed"]:
        failed.append("verify step: a tree node differs from its path as a chain")
    if not args.smoke:
        print(render(summary), flush=True)
    print(
        f"* Done in {summary['wall_s']:.0f} s; "
        + (
            f"FAILED: {', '.join(failed)}"
            if failed
            else "all correctness checks passed"
        )
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
