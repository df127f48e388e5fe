# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 MTP drafting token trees on the trained tiny pair: the assistant
drafts the spine and its runner-ups (leaf-sibling trees) and children below
the runner-ups (continuation branches); the engine stays token-identical to
plain greedy (tie-aware, tests/engine/identity.py), and the branches really
are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import (
    accepted_tokens_per_node,
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from .identity import assert_greedy_identical
from .trained_pair import perturbed_draft_model, text_prompts, trained_pair

pytestmark = pytest.mark.engine

# Model Runner V2 runs its kernels in Triton's interpreter here, about ten
# times slower per step: few prompts, and the batch of many requests only.
NUM_PROMPTS = 16
MAX_TOKENS = 32
BATCH_SIZES = [16]


def print_acceptance(label: str, counters: dict) -> None:
    print(f"{label}: accepted per depth {counters['num_accepted_tokens_per_pos']}, "
          f"rescued per depth {counters['num_rescued_tokens_per_pos']}, "
          f"{counters['num_drafts']} drafts")


def generate(llm, prompts: list[str]) -> list[list[int]]:
    return greedy_generate(llm, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def plain_greedy():
    target, _ = trained_pair()
    prompts = text_prompts(NUM_PROMPTS)
    llm = make_llm(target)
    expected = plain_greedy_reference(llm, prompts, MAX_TOKENS)
    shutdown(llm)
    return prompts, expected


def run_mtp(speculative: dict, prompts: list[str], **options):
    target, assistant = trained_pair()
    llm = make_llm(target, {"method": "mtp", "model": str(assistant), **speculative}, **options)
    try:
        return generate(llm, prompts), spec_decode_counters(llm), accepted_tokens_per_node(llm)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def mtp_chain(plain_greedy):
    """The chain the trees are compared with, K=3 (one run: greedy drafts and
    acceptance do not depend on the batch)."""
    prompts, expected = plain_greedy
    chain, counters, _ = run_mtp({"num_speculative_tokens": 3}, prompts)
    assert_greedy_identical(chain, expected, "MTP chain K=3")
    # The trained assistant's chain really accepts, at every depth.
    assert all(n > 0 for n in counters["num_accepted_tokens_per_pos"])
    return chain, counters


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_mtp_leaf_sibling_tree_is_identical_and_rescues(plain_greedy, mtp_chain,
                                                         batch_size):
    prompts, expected = plain_greedy
    _, chain_counters = mtp_chain
    tree, tree_counters, _ = run_mtp({"num_speculative_tokens": 3, "tree_width": 4},
                                     prompts, max_num_seqs=batch_size)
    assert_greedy_identical(tree, expected, f"MTP tree K=3 W=4, batch {batch_size}")
    print_acceptance(f"MTP tree K=3 W=4, batch {batch_size}", tree_counters)

    def mean_acceptance_length(counters):
        return 1 + counters["num_accepted_tokens"] / counters["num_drafts"]

    # Siblings rescue tokens the chain lost, so the tree accepts more per step.
    assert sum(tree_counters["num_rescued_tokens_per_pos"]) > 0
    assert mean_acceptance_length(tree_counters) > mean_acceptance_length(chain_counters)
    # 12 draft tokens (3 depths x 4 candidates) per step.
    assert tree_counters["num_draft_tokens"] == 12 * tree_counters["num_drafts"]


def test_chain_shaped_tree_with_mtp_matches_chain_mode(plain_greedy, mtp_chain):
    prompts, expected = plain_greedy
    chain, chain_counters = mtp_chain
    tree, tree_counters, _ = run_mtp(
        {"speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"}, prompts
    )
    assert_greedy_identical(tree, expected, "MTP chain-shaped tree")
    # Equal outputs mean equal contexts, hence equal drafts, at every step;
    # outputs can only differ by a tie flip, allowed above.
    if tree == chain:
        for name in ("num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert tree_counters[name] == chain_counters[name], name


# Continuation branches: children below runner-ups, down to depth 5.
CONTINUATION_12 = [
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 0, 0),
]  # fmt: skip
# 32 nodes, 6 deep, up to 4 children per node.
CONTINUATION_32 = [
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0), (0, 0, 1, 0, 0),
    (1, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 0, 1, 0),
    (0, 0, 0, 1, 0, 0), (1, 0, 0, 0, 0, 0),
]  # fmt: skip


def planned_tree(budget: int) -> list[tuple[int, ...]]:
    """The tree the planner picks from the benchmark's calibration counters
    (docs/benchmarks/calibration_metrics.txt, a saved /metrics)."""
    from vllm.v1.spec_decode.tree_planner import (
        AcceptanceCounts,
        AcceptanceModel,
        plan_tree,
    )

    metrics = Path(__file__).parents[2] / "docs" / "benchmarks" / "calibration_metrics.txt"
    counts = AcceptanceCounts.from_prometheus_text(metrics.read_text())
    return list(plan_tree(AcceptanceModel(counts), budget)[0])


def accepted_below_runner_ups(per_node: dict[tuple[int, ...], int]) -> int:
    """Accepted tokens whose parent node is off the spine."""
    return sum(count for path, count in per_node.items() if any(path[:-1]))


TREES = {"12": CONTINUATION_12, "planned_32": "planned_32"}


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("tree", list(TREES.values()), ids=list(TREES))
def test_mtp_continuation_tree_is_identical_and_uses_its_branches(
    plain_greedy, tree, batch_size
):
    prompts, expected = plain_greedy
    kind = "continuation"
    if isinstance(tree, str):
        tree, kind = planned_tree(int(tree.removeprefix("planned_"))), "planned"
    got, counters, per_node = run_mtp(
        {"speculative_token_tree": str(tree)}, prompts, max_num_seqs=batch_size
    )
    assert_greedy_identical(
        got, expected, f"MTP {kind} tree of {len(tree)} nodes, batch {batch_size}"
    )
    print_acceptance(f"MTP {kind} tree of {len(tree)} nodes, batch {batch_size}", counters)
    assert set(per_node) == set(tree)
    # Children of runner-ups are accepted: the branches are drafted right.
    assert accepted_below_runner_ups(per_node) > 0, per_node
    # The per-node counts add up to the per-depth ones.
    for depth, accepted in enumerate(counters["num_accepted_tokens_per_pos"]):
        assert accepted == sum(n for path, n in per_node.items() if len(path) == depth + 1)
    assert sum(per_node.values()) == counters["num_accepted_tokens"]


def test_draft_model_leaf_sibling_tree_is_identical_and_rescues(plain_greedy):
    """A draft model (the target with noise on its weights) drafts the spine,
    one draft forward per depth, and its runner-ups as leaf siblings."""
    prompts, expected = plain_greedy
    target, _ = trained_pair()
    llm = make_llm(target, {"method": "draft_model", "model": str(perturbed_draft_model()),
                            "num_speculative_tokens": 3, "tree_width": 4},
                   max_num_seqs=BATCH_SIZES[-1], disable_hybrid_kv_cache_manager=True)
    try:
        tree, counters = generate(llm, prompts), spec_decode_counters(llm)
    finally:
        shutdown(llm)
    assert_greedy_identical(tree, expected, "draft_model tree K=3 W=4")
    print_acceptance("draft_model tree K=3 W=4", counters)
    assert counters["num_draft_tokens"] == 12 * counters["num_drafts"]
    # The spine is accepted at every depth, and siblings rescue its misses.
    assert all(n > 0 for n in counters["num_accepted_tokens_per_pos"]), counters
    assert sum(counters["num_rescued_tokens_per_pos"]) > 0, counters


def test_continuation_tree_is_refused_by_a_draft_model():
    """A drafter that writes its own KV drafts leaf-sibling trees only, and
    says at start-up which drafters draft continuation branches."""
    target, _ = trained_pair()
    with pytest.raises(Exception, match="Continuation branches are drafted by the Gemma 4 MTP"):
        make_llm(target, {"method": "draft_model", "model": str(target),
                          "speculative_token_tree": str(CONTINUATION_12)})
