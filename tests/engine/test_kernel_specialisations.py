# SPDX-License-Identifier: Apache-2.0
"""No Triton kernel compiles on the serving path: after start-up (with its JIT
warmup, as `vllm serve` starts without --enforce-eager), serving steps at the
node counts the tree sizes may pick (on CPU_ATTN at every node count of the
tree), greedy with logprobs and sampled, launches no kernel specialisation
that start-up did not launch. Counted as a GPU would
compile them (kernel_specialisations.py); the interpreter compiles nothing.
On CPU_ATTN and on TRITON_ATTN, whose tree variant of the attention kernel and
the KV commit kernel run only there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).with_name("kernel_specialisations.py")


# TRITON_ATTN's kernel picks its launch by query length (split-KV up to 8
# query rows): start-up warms the node counts the schedule picks, here one of
# each kind.
TRITON_SCHEDULE = [[1, 1, 12], [2, 2, 5]]


@pytest.mark.parametrize(
    "backend, flags, node_counts, tree_kernels",
    [
        ("CPU_ATTN", [], list(range(13)),
         ["_prepare_tree_rows_kernel", "_tree_walk_kernel"]),
        ("TRITON_ATTN", ["--triton-attn", "--schedule", json.dumps(TRITON_SCHEDULE)],
         [0, 5, 12],
         ["_commit_spec_tree_kv_kernel", "_prepare_tree_rows_kernel",
          "_tree_walk_kernel", "kernel_unified_attention"]),
    ],
)
def test_no_kernel_specialised_while_serving(backend, flags, node_counts, tree_kernels):
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, str(SCRIPT), *flags],
                            capture_output=True, text=True, timeout=1200)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    report = json.loads(lines[-1].removeprefix("RESULT "))
    new = report["new_while_serving"]
    print(f"{backend}: start-up launched {report['startup']} specialisations, serving "
          f"{report['serving']} at node counts {report['node_counts']}; new while "
          f"serving: {len(new)}; drafts {report['drafts']}")
    assert report["backends"] == [backend]
    assert report["drafts"] > 0
    assert report["tree_kernels"] == tree_kernels
    assert report["node_counts"] == node_counts
    assert not new, "\n".join(new)
    if backend == "TRITON_ATTN":
        # The tree variant of attention only on batches that hold a tree:
        # prefills and 0-node steps run the plain one.
        attention = report["attention_launches_while_serving"]
        print(f"attention launches while serving: {attention}")
        assert attention["tree"] > 0 and attention["plain"] > 0


def test_the_count_sees_a_kernel_sized_by_the_step_tree():
    """The control: a walk sized by a nested tree instead of the configured
    one is a specialisation of its own."""
    pytest.importorskip("triton")
    import torch

    from vllm.v1.attention.spec_tree import SpecTokenTree
    from vllm.v1.worker.gpu.spec_decode.tree.rejection_sampler import tree_walk

    from .kernel_specialisations import KernelSpecialisations

    envelope = SpecTokenTree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    nested = SpecTokenTree([(0,), (0, 0)])

    def walk(max_num_nodes: int, max_tree_depth: int) -> None:
        tree_walk(
            torch.tensor([5, 7, 9]),
            torch.tensor([0, 5, 7], dtype=torch.int32),
            torch.tensor([100, 101, 102]),
            torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([0]),
            torch.tensor([0], dtype=torch.int32),
            nested.parents,
            max_num_nodes,
            max_tree_depth,
        )

    recorder = KernelSpecialisations()
    with recorder.recording() as by_envelope:
        walk(envelope.num_nodes, envelope.tree_depth)
    with recorder.recording() as same:
        walk(envelope.num_nodes, envelope.tree_depth)
    with recorder.recording() as by_nested:
        walk(nested.num_nodes, nested.tree_depth)
    assert same.keys() == by_envelope.keys()
    assert len(by_nested.keys() - by_envelope.keys()) == 1
