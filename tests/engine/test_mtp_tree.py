# SPDX-License-Identifier: Apache-2.0
"""Gemma 4 MTP drafting leaf-sibling trees on the trained tiny pair: the
assistant's centroid head drafts the spine and its runner-ups, the engine
stays token-identical to plain greedy (tie-aware, tests/engine/identity.py),
and siblings really rescue tokens."""

from __future__ import annotations

import pytest

from .conftest import (
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from .identity import assert_greedy_identical
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_PROMPTS = 64
MAX_TOKENS = 32


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
        return generate(llm, prompts), spec_decode_counters(llm)
    finally:
        shutdown(llm)


@pytest.mark.parametrize("batch_size", [1, 16])
def test_mtp_leaf_sibling_tree_is_identical_and_rescues(plain_greedy, batch_size):
    prompts, expected = plain_greedy
    chain, chain_counters = run_mtp({"num_speculative_tokens": 3}, prompts,
                                    max_num_seqs=batch_size)
    tree, tree_counters = run_mtp({"num_speculative_tokens": 3, "tree_width": 4}, prompts,
                                  max_num_seqs=batch_size)
    assert_greedy_identical(chain, expected, f"MTP chain K=3, batch {batch_size}")
    assert_greedy_identical(tree, expected, f"MTP tree K=3 W=4, batch {batch_size}")

    def mean_acceptance_length(counters):
        return 1 + counters["num_accepted_tokens"] / counters["num_drafts"]

    # The trained assistant's chain really accepts, at every depth.
    assert all(n > 0 for n in chain_counters["num_accepted_tokens_per_pos"])
    # Siblings rescue tokens the chain lost, so the tree accepts more per step.
    assert sum(tree_counters["num_rescued_tokens_per_pos"]) > 0
    assert mean_acceptance_length(tree_counters) > mean_acceptance_length(chain_counters)
    # 12 draft tokens (3 depths x 4 candidates) per step.
    assert tree_counters["num_draft_tokens"] == 12 * tree_counters["num_drafts"]


def test_chain_shaped_tree_with_mtp_matches_chain_mode(plain_greedy):
    prompts, expected = plain_greedy
    chain, chain_counters = run_mtp({"num_speculative_tokens": 3}, prompts)
    tree, tree_counters = run_mtp({"speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"},
                                  prompts)
    assert_greedy_identical(chain, expected, "MTP chain K=3")
    assert_greedy_identical(tree, expected, "MTP chain-shaped tree")
    # Equal outputs mean equal contexts, hence equal drafts, at every step;
    # outputs can only differ by a tie flip, allowed above.
    if tree == chain:
        for name in ("num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert tree_counters[name] == chain_counters[name], name


def test_continuation_tree_is_refused_by_the_mtp_drafter():
    with pytest.raises(Exception, match="leaf-sibling tree"):
        run_mtp({"speculative_token_tree": "[(0,), (1,), (1, 0)]"}, ["def f():"])
