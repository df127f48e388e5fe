# SPDX-License-Identifier: Apache-2.0
"""Device checks of tree verify on CUDA: the patched Triton unified attention
kernel, compiled on the GPU, against a dense reference, then timed for chain
and tree verify at Gemma 4 E4B and 31B attention shapes.

Needs only torch and Triton: the kernel's two source files are loaded from the
patched tree under stand-ins for the few vllm modules they import, so vLLM
need not be installed on the GPU machine. From the repository root, after
`bash ci/test.sh` laid out the patched tree in build/vllm-patched:

    python tests/gpu/run_device_checks.py --out docs/benchmarks-gpu.json

(with the device tool, carry build/vllm-patched/vllm/v1/attention/ops). About
5 minutes on one H200: (a) correctness cases in bfloat16, every row against a
float32 dense reference, and a negative control (the mask dropped) that must
fail; (b) verify attention per layer for chain K=3 (4 query rows per request)
and trees of 12, 16 and 32 nodes (leaf-sibling, W=4), contexts 1k / 8k / 32k,
batch 1 / 8 / 32, and the whole model's attention time per extra node.

Shapes, from the published configs: E4B has 42 layers (35 sliding: 8 query
heads, 2 KV heads, head_dim 256, window 512; 7 full: head_dim 512, 2 KV
heads); 31B has 60 layers (50 sliding: 32 query heads, 16 KV heads, head_dim
256, window 1024; 10 full: head_dim 512, 4 KV heads).

Without a GPU, `TRITON_INTERPRET=1 python tests/gpu/run_device_checks.py
--smoke` runs the same code on CPU tensors at tiny sizes.
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
KERNEL_FILES = ("triton_unified_attention.py", "triton_attention_helpers.py")
BLOCK_SIZE = 16

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


def load_unified_attention(vllm_src: Path):
    """The patched kernel's `unified_attention`, imported from a scratch
    package: the kernel files plus stand-ins for their vllm imports."""
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
    module = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
    return module.unified_attention


def leaf_sibling_tree(num_nodes: int, width: int = 4) -> list[tuple[int, ...]]:
    """A spine of num_nodes / width with width - 1 siblings per depth."""
    paths, spine = [], ()
    for _ in range(num_nodes // width):
        paths += [spine + (rank,) for rank in range(width)]
        spine += (0,)
    return sorted(paths, key=lambda p: (len(p), p))


def random_tree(rng: random.Random, num_nodes: int) -> list[tuple[int, ...]]:
    """A random tree, breadth-first: each node a new child of the root or of
    an earlier node."""
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


def make_inputs(
    requests, num_heads, num_kv_heads, head_size, dtype, device, randomize=True
):
    num_tokens = sum(r.query_len for r in requests)
    max_blocks = max(-(-r.seq_len // BLOCK_SIZE) for r in requests)
    num_blocks = len(requests) * max_blocks + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    make = torch.randn if randomize else torch.empty
    query = make(num_tokens, num_heads, head_size, dtype=dtype, device=device)
    key_cache = make(*shape, dtype=dtype, device=device)
    value_cache = make(*shape, dtype=dtype, device=device)
    block_table = (
        torch.arange(len(requests) * max_blocks, dtype=torch.int32, device=device).view(
            len(requests), max_blocks
        )
        + 1
    )
    query_lens = torch.tensor([r.query_len for r in requests], device=device)
    cu_seqlens_q = torch.zeros(len(requests) + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = query_lens.cumsum(0)
    seq_lens = torch.tensor(
        [r.seq_len for r in requests], dtype=torch.int32, device=device
    )
    tree_mask = torch.tensor(
        [m for r in requests for m in r.masks], dtype=torch.int64, device=device
    )
    tree_shift = torch.tensor(
        [s for r in requests for s in r.shifts()], dtype=torch.int32, device=device
    )
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        max_seqlen_q=int(query_lens.max()),
        max_seqlen_k=int(seq_lens.max()),
        tree_mask=tree_mask,
        tree_shift=tree_shift,
    )


def run(unified_attention, inputs, window, use_tree=True):
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
        tree_mask=inputs["tree_mask"] if use_tree else None,
        tree_pos_shift=inputs["tree_shift"] if use_tree else None,
    )
    return output


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
        dropped = dict(inputs, tree_mask=torch.full_like(inputs["tree_mask"], -1))
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


def timings(unified_attention, device, dtype, smoke: bool) -> dict:
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
                by_config = {}
                for config, num_nodes in CONFIGS.items():
                    paths = (
                        None
                        if config.startswith("chain")
                        else leaf_sibling_tree(num_nodes)
                    )
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
                    model_ms = sum(kinds[k][0] * ms for k, ms in per_kind.items())
                    by_config[config] = {"per_layer_ms": per_kind, "model_ms": model_ms}
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
                    + "; per extra node "
                    + ", ".join(
                        f"{r['ms_per_extra_node']:.4f}"
                        for c, r in by_config.items()
                        if c != "chain_k3"
                    ),
                    flush=True,
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm-src", type=Path, default=ROOT / "build" / "vllm-patched"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write the results as JSON here"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (for TRITON_INTERPRET=1 on CPU)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    started = time.perf_counter()
    unified_attention = load_unified_attention(args.vllm_src)
    name = (
        torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    )
    print(f"* Device: {name}, {dtype}", flush=True)
    print("* Correctness against the dense reference", flush=True)
    checks = correctness(unified_attention, device, dtype, args.smoke)
    print("* Verify attention time per target forward (all layers)", flush=True)
    times = timings(unified_attention, device, dtype, args.smoke)
    summary = {
        "device": name,
        "dtype": str(dtype),
        "correctness": checks,
        "timings": times,
        "wall_s": time.perf_counter() - started,
    }
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    failed = [
        n
        for n, r in checks.items()
        if not r["passed"] or r["negative_control_bad_rows"] == 0
    ]
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
