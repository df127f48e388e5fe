# SPDX-License-Identifier: Apache-2.0
"""Device checks of the tree kernels besides attention: the tree walk, the
tree rows and the accepted-path KV commit. Each is compiled on the GPU, run
on random cases and checked, bit for bit, against the same kernel's result
under Triton's interpreter (this module run in a subprocess with
TRITON_INTERPRET=1, on CPU tensors built from the same seeds), then timed at
serving sizes: the walk and the tree rows for 64 requests with the 32-node
tree, the KV commit for 64 requests accepting 3 nodes in Gemma 4 E4B's 42 KV
caches (bfloat16, 2 KV heads, head_dim 256 sliding, 512 full) against the
per-cache torch copies it replaced.

The kernels are read from the patched tree (--vllm-src), without vLLM: the
walk's and the rows' kernel functions are cut out of their modules, whose
other imports the device machine lacks, and the KV commit module is loaded
under run_device_checks.py's stand-ins. run_device_checks.py starts `InterpreterResults`
(this module run as a script with --reference, in the background) and calls
`checks`.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gpu.tree_batches import leaf_sibling_tree, random_tree, time_ms  # noqa: E402

# (module of the patched tree, the functions cut out of it)
CUT_KERNELS = {
    "vllm/v1/worker/gpu/spec_decode/tree/rejection_sampler.py": (
        "_tree_walk_kernel",
        "tree_walk",
    ),
    "vllm/v1/worker/gpu/spec_decode/tree/verifier.py": ("_prepare_tree_rows_kernel",),
}
KV_COMMIT_MODULE = "vllm/v1/attention/ops/spec_tree_kv_commit.py"
MAX_NUM_NODES = 32  # the envelope that sizes the walk and rows kernels
KV_BLOCK_SIZE = 16


def cut_kernels_source(vllm_src: Path, kernels: dict = CUT_KERNELS) -> str:
    """The functions `kernels` names (the walk's and the rows' by default),
    decorators included, as one module's source (Triton reads a kernel's
    source from its file)."""
    parts = ["import torch\nfrom vllm.triton_utils import tl, triton\n"]
    for relative, names in kernels.items():
        source = (vllm_src / relative).read_text()
        lines = source.splitlines(keepends=True)
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                parts.append("\n\n" + "".join(lines[start - 1 : node.end_lineno]))
    return "".join(parts)


def load(package: Path, vllm_src: Path) -> tuple[ModuleType, ModuleType]:
    """(cut tree kernels, KV commit module), imported from `package`, the
    scratch package of run_device_checks.py's stand-ins (on sys.path)."""
    ops = package / "vllm/v1/attention/ops"
    (ops / "spec_tree_kv_commit.py").write_text((vllm_src / KV_COMMIT_MODULE).read_text())
    cut = package / "tree_kernels_cut.py"
    cut.write_text(cut_kernels_source(vllm_src))
    spec = importlib.util.spec_from_file_location("tree_kernels_cut", cut)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    return kernels, importlib.import_module("vllm.v1.attention.ops.spec_tree_kv_commit")


def tree_tensors(paths: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """What the kernels read of a tree (vLLM's SpecTokenTree, here because
    the device machine has no vLLM)."""
    index = {path: node for node, path in enumerate(paths)}
    parents = [index.get(path[:-1], -1) for path in paths]
    bits = [1]
    for node, parent in enumerate(parents):
        bits.append((bits[parent + 1] if parent >= 0 else 1) | 1 << (node + 1))
    return {
        "parents": torch.tensor(parents, dtype=torch.int64),
        "position_offsets": torch.tensor([0, *map(len, paths)], dtype=torch.int64),
        "ancestor_bits": torch.tensor(bits, dtype=torch.int64),
        "tree_depth": max(map(len, paths)),
    }


def walk_case(rng: random.Random, paths, num_reqs: int) -> dict:
    tree = tree_tensors(paths)
    num_nodes = len(paths)
    vocab_size = 4
    target_tokens, input_tokens, positions, num_rows = [], [], [], []
    prefill_len = []
    for _ in range(num_reqs):
        n = rng.choice([num_nodes, rng.randint(0, num_nodes)])
        row_tokens = [rng.randrange(vocab_size) for _ in range(n + 1)]
        # A draft copies its parent row's target token half the time, so
        # walks go deep.
        drafts = [
            row_tokens[int(tree["parents"][node]) + 1]
            if rng.random() < 0.5
            else rng.randrange(vocab_size)
            for node in range(n)
        ]
        in_prefill = rng.random() < 0.1
        target_tokens += row_tokens
        input_tokens += [vocab_size, *drafts]
        positions += [
            (40 if in_prefill else 100) + int(tree["position_offsets"][row])
            for row in range(n + 1)
        ]
        num_rows.append(n + 1)
        prefill_len.append(50)
    return {
        "target_tokens": torch.tensor(target_tokens, dtype=torch.int64),
        "input_tokens": torch.tensor(input_tokens, dtype=torch.int32),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "cu_num_logits": torch.tensor(
            [sum(num_rows[:i]) for i in range(num_reqs + 1)], dtype=torch.int32
        ),
        "idx_mapping": torch.arange(num_reqs),
        "prefill_len": torch.tensor(prefill_len, dtype=torch.int32),
        "parents": tree["parents"],
    }


def run_walk(kernels, case: dict, device) -> list[torch.Tensor]:
    inputs = {k: v.to(device) for k, v in case.items()}
    sampled, num_sampled, accepted, path_rows = kernels.tree_walk(
        **inputs, max_num_nodes=MAX_NUM_NODES, max_tree_depth=MAX_NUM_NODES
    )
    # Past num_sampled, `sampled` holds what its allocation held.
    emitted = torch.arange(sampled.shape[1], device=device) < num_sampled[:, None]
    return [sampled.where(emitted, -1), num_sampled, accepted, path_rows]


def rows_case(rng: random.Random, paths) -> dict:
    tree = tree_tensors(paths)
    query_lens, num_drafts = [], []
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(["tree", "decode", "prefill"])
        n = rng.randint(1, len(paths)) if kind == "tree" else 0
        num_drafts.append(n)
        query_lens.append(n + 1 if kind == "tree" else rng.choice([1, 37]))
    num_tokens = sum(query_lens)
    return {
        "positions": torch.tensor(
            [200 + row for q in query_lens for row in range(q)] + [0] * 5
        ),
        "query_start_loc": torch.tensor(
            [sum(query_lens[:i]) for i in range(len(query_lens) + 1)],
            dtype=torch.int32,
        ),
        "cu_num_logits": torch.tensor(
            [sum(n + 1 for n in num_drafts[:i]) for i in range(len(num_drafts) + 1)],
            dtype=torch.int32,
        ),
        "row_depths": tree["position_offsets"],
        "row_ancestor_bits": tree["ancestor_bits"],
        "num_tokens": num_tokens,
        "bits_dtype": torch.int32 if len(paths) + 1 <= 32 else torch.int64,
    }


def run_rows(kernels, case: dict, device) -> list[torch.Tensor]:
    positions = case["positions"].to(device)
    num_tokens_padded = positions.shape[0]
    shift = torch.full((num_tokens_padded,), 7, dtype=torch.int32, device=device)
    bits = torch.full((num_tokens_padded,), 7, dtype=case["bits_dtype"], device=device)
    num_reqs = case["query_start_loc"].shape[0] - 1
    kernels._prepare_tree_rows_kernel[(num_reqs + 1,)](
        positions,
        shift,
        bits,
        case["query_start_loc"].to(device),
        case["cu_num_logits"].to(device),
        case["row_depths"].to(device),
        case["row_ancestor_bits"].to(device),
        case["num_tokens"],
        num_tokens_padded,
        BLOCK_SIZE=64,  # next power of two of MAX_NUM_NODES + 1
    )
    return [positions, shift, bits]


class TritonSlots:
    """TRITON_ATTN's slot view of its KV cache ([num_blocks, num_kv_heads,
    block_size, content] -> slots first)."""

    @staticmethod
    def spec_tree_kv_slots(kv_cache: torch.Tensor) -> torch.Tensor:
        return kv_cache.transpose(1, 2)


def kv_commit_case(seed: int, layouts, num_reqs: int, tree_depth: int,
                   num_blocks: int) -> dict:
    """KV caches of two groups (each layout: (num_kv_heads, content bytes),
    bytes as uint8 viewed as bfloat16 pairs), each request's accepted nodes
    and each group's slot of every row."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    groups = [
        [
            torch.randint(0, 256, (num_blocks, heads, KV_BLOCK_SIZE, content),
                          generator=generator, dtype=torch.uint8)
            for heads, content in layers
        ]
        for layers in layouts
    ]
    num_nodes = 3 * tree_depth
    rows_per_req = 1 + num_nodes
    blocks_per_req = -(-rows_per_req // KV_BLOCK_SIZE)
    slot_mappings = []
    for _ in groups:
        first_blocks = rng.sample(range(1, num_blocks // blocks_per_req), num_reqs)
        slots = [
            block * blocks_per_req * KV_BLOCK_SIZE + row
            for block in first_blocks
            for row in range(rows_per_req)
        ]
        slot_mappings.append(slots + [-1, -1])
    accepted = []
    for _ in range(num_reqs):
        nodes, node = [], -1
        for depth in range(rng.randint(0, tree_depth)):
            node = rng.randint(max(node + 1, depth), num_nodes - tree_depth + depth)
            nodes.append(node)
        accepted.append(nodes + [-1] * (tree_depth - len(nodes)))
    accepted_ids = torch.tensor(accepted, dtype=torch.int64)
    root_rows = torch.arange(num_reqs).unsqueeze(1) * rows_per_req
    is_accepted = accepted_ids >= 0
    src_rows = torch.where(is_accepted, root_rows + 1 + accepted_ids, root_rows)
    dst_rows = torch.where(
        is_accepted, root_rows + 1 + torch.arange(tree_depth), root_rows
    )
    return {
        "groups": groups,
        "slot_mappings": torch.tensor(slot_mappings, dtype=torch.int64),
        "src_rows": src_rows.flatten(),
        "dst_rows": dst_rows.flatten(),
        "tree_depth": tree_depth,
    }


def per_cache_commit(groups, slot_mappings, src_rows, dst_rows) -> None:
    """The commit the kernel replaced: a gather and a scatter per KV cache."""
    for group, kv_caches in enumerate(groups):
        src = slot_mappings[group][src_rows]
        dst = slot_mappings[group][dst_rows]
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
        for kv_cache in kv_caches:
            slots = kv_cache.transpose(1, 2)
            slots[dst // KV_BLOCK_SIZE, dst % KV_BLOCK_SIZE] = slots[
                src // KV_BLOCK_SIZE, src % KV_BLOCK_SIZE
            ]


def run_kv_commit(kv_commit_module, case: dict, device) -> tuple[list, object]:
    groups = [[kv.to(device).view(torch.bfloat16) for kv in kvs] for kvs in case["groups"]]
    commit = kv_commit_module.SpecTreeKVCommit(
        [[(TritonSlots, kv) for kv in kvs] for kvs in groups]
    )
    commit(case["slot_mappings"].to(device), case["src_rows"].to(device),
           case["dst_rows"].to(device), case["tree_depth"])
    return [kv.view(torch.uint8) for kvs in groups for kv in kvs], commit


def kv_layouts(smoke: bool):
    """Per group (num_kv_heads, content bytes per head): E4B's sliding and
    full caches, K and V of bfloat16 head_dim 256 and 512."""
    if smoke:
        return [[(2, 2 * 2 * 16)] * 3, [(2, 2 * 2 * 32)]]
    return [[(2, 2 * 2 * 256)] * 35, [(2, 2 * 2 * 512)] * 7]


def cases(smoke: bool) -> dict[str, list]:
    rng = random.Random(0)
    trees = [leaf_sibling_tree(12), leaf_sibling_tree(32), *(
        random_tree(rng, rng.randint(1, MAX_NUM_NODES)) for _ in range(6 if smoke else 16)
    )]
    return {
        "walk": [walk_case(rng, paths, rng.randint(1, 8)) for paths in trees],
        "rows": [rows_case(rng, paths) for paths in trees],
        "kv_commit": [
            kv_commit_case(seed, kv_layouts(True), num_reqs=5, tree_depth=4, num_blocks=64)
            for seed in range(3 if smoke else 6)
        ],
    }


def results(kernels, kv_commit_module, smoke: bool, device) -> dict[str, list]:
    all_cases = cases(smoke)
    return {
        "walk": [[t.cpu() for t in run_walk(kernels, c, device)] for c in all_cases["walk"]],
        "rows": [[t.cpu() for t in run_rows(kernels, c, device)] for c in all_cases["rows"]],
        "kv_commit": [
            [t.cpu() for t in run_kv_commit(kv_commit_module, c, device)[0]]
            for c in all_cases["kv_commit"]
        ],
    }


class InterpreterResults:
    """This module's cases under Triton's interpreter, on CPU tensors, run in
    a subprocess from construction on (it overlaps the device's work)."""

    def __init__(self, vllm_src: Path, smoke: bool):
        self.scratch = tempfile.TemporaryDirectory()
        self.out = Path(self.scratch.name) / "reference.pt"
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--vllm-src", str(vllm_src), "--reference",
             str(self.out), *(["--smoke"] if smoke else [])],
            env={**os.environ, "TRITON_INTERPRET": "1"},
        )

    def get(self) -> dict[str, list]:
        if self.process.wait() != 0:
            raise RuntimeError("the interpreter's run of the tree kernels failed")
        results = torch.load(self.out)
        self.scratch.cleanup()
        return results


def timings(kernels, kv_commit_module, device, smoke: bool) -> dict:
    rng = random.Random(1)
    repeats = 3 if smoke else 50
    num_reqs = 4 if smoke else 64
    tree = leaf_sibling_tree(12 if smoke else 32)
    walk = walk_case(rng, tree, num_reqs)
    rows = rows_case(rng, tree)
    commit_case = kv_commit_case(7, kv_layouts(smoke), num_reqs=num_reqs, tree_depth=3,
                                 num_blocks=4 * num_reqs)
    groups = [[kv.to(device) for kv in kvs] for kvs in commit_case["groups"]]
    slot_mappings = commit_case["slot_mappings"].to(device)
    src_rows, dst_rows = commit_case["src_rows"].to(device), commit_case["dst_rows"].to(device)
    commit = kv_commit_module.SpecTreeKVCommit(
        [[(TritonSlots, kv.view(torch.bfloat16)) for kv in kvs] for kvs in groups]
    )
    kernel_us = 1000 * time_ms(
        lambda: commit(slot_mappings, src_rows, dst_rows, 3), device, repeats)
    per_cache_us = 1000 * time_ms(
        lambda: per_cache_commit(groups, slot_mappings, src_rows, dst_rows), device,
        repeats)
    return {
        "requests": num_reqs,
        "tree_nodes": len(tree),
        "walk_us": 1000 * time_ms(lambda: run_walk(kernels, walk, device), device, repeats),
        "rows_us": 1000 * time_ms(lambda: run_rows(kernels, rows, device), device, repeats),
        "kv_commit": {
            "kv_caches": sum(len(kvs) for kvs in groups),
            "word_bytes": commit.word_bytes,
            "aligned_16": commit.align_16,
            "kernel_us": kernel_us,
            "per_cache_copies_us": per_cache_us,
            "per_cache_over_kernel": per_cache_us / kernel_us,
        },
    }


def mismatched_cases(measured: list, expected: list) -> list[int]:
    return [
        i for i, (got, want) in enumerate(zip(measured, expected, strict=True))
        if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    ]


def checks(kernels, kv_commit_module, reference: InterpreterResults, device,
           smoke: bool) -> dict:
    """Every case on `device` against the interpreter; a negative control (the
    walk of a tree whose parents are shifted must differ somewhere); then the
    timings."""
    measured = results(kernels, kv_commit_module, smoke, device)
    expected = reference.get()
    summary: dict = {}
    for name, want in expected.items():
        mismatched = mismatched_cases(measured[name], want)
        summary[name] = {"cases": len(want), "mismatched_cases": mismatched,
                         "passed": not mismatched}
    shifted = []
    for case in cases(smoke)["walk"]:
        parents = case["parents"]
        case = {**case, "parents": torch.where(parents > 0, parents - 1, parents)}
        shifted.append([t.cpu() for t in run_walk(kernels, case, device)])
    summary["walk"]["negative_control_mismatched_cases"] = len(
        mismatched_cases(shifted, expected["walk"]))
    summary["timings"] = timings(kernels, kv_commit_module, device, smoke)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True,
                        help="write the interpreter's results here (TRITON_INTERPRET=1)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.gpu.run_device_checks import kernel_package

    kernels, kv_commit_module = load(kernel_package(args.vllm_src), args.vllm_src)
    torch.save(results(kernels, kv_commit_module, args.smoke, "cpu"), args.reference)


if __name__ == "__main__":
    main()
