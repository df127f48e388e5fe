# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding at temperature > 0 keeps plain decoding's
distribution on the CPU build: the joint of the first three tokens, sampled
with seeds from a plain engine and from a speculative one, must be
homogeneous (two-sample chi-square, tests/engine/distribution.py).

Chains first (Gemma 4 MTP and a draft model; vllm#55005 broke both on CPU
until the stack's expand patch), then token trees verified by the sampled
tree walk, with greedy requests in the same batches."""

from __future__ import annotations

from collections import Counter

import pytest

from .conftest import make_llm, plain_greedy_reference, shutdown, spec_decode_counters
from .distribution import homogeneity_test
from .identity import assert_greedy_identical
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_SAMPLES = 1500
# Three tokens: the second and third come from one tree step (the first is
# the prefill's), so a walk that reused one position's noise for the next would show.
NUM_TOKENS = 3
# top_k keeps the joint at most 4 ** 3 = 64 cells.
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 4}
MIN_P_VALUE = 1e-3
NUM_GREEDY = 32


def sample_joint(llm, prompt: str, first_seed: int, greedy_prompts=(),
                 sampling: dict = SAMPLING) -> tuple:
    """Joint counts of the first tokens of NUM_SAMPLES seeded samples, the
    samples themselves, and the greedy continuations of `greedy_prompts`
    decoded in the same batches."""
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, seed=first_seed + i,
                       **sampling)
        for i in range(NUM_SAMPLES)
    ]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    outputs = llm.generate([prompt] * NUM_SAMPLES + list(greedy_prompts),
                           params + [greedy] * len(greedy_prompts), use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outputs[:NUM_SAMPLES]]
    greedy_tokens = [list(o.outputs[0].token_ids) for o in outputs[NUM_SAMPLES:]]
    return Counter(samples), samples, greedy_tokens


def engine(speculative: dict | None, **options):
    target, _ = trained_pair()
    # A token budget above max_num_seqs prompts: all are prefilled in one
    # step (seeded chunked prompts: tests/engine/test_seeded_requests.py).
    return make_llm(target, speculative, max_num_seqs=128, max_num_batched_tokens=8192,
                    enable_prefix_caching=True, **options)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p[-80:] for p in text_prompts(3)]


@pytest.fixture(scope="module")
def plain_samples(prompts) -> list[Counter]:
    llm = engine(None)
    try:
        return [sample_joint(llm, prompt, first_seed=0)[0] for prompt in prompts]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def greedy_reference():
    """Plain greedy decoding (with top-2 logprobs) of prompts that the
    speculative engines decode greedily beside the sampled requests."""
    prompts = [p[-60:] for p in text_prompts(NUM_GREEDY + 3)[3:]]
    llm = engine(None)
    try:
        return prompts, plain_greedy_reference(llm, prompts, 16)
    finally:
        shutdown(llm)


def mtp_chain() -> tuple[dict, dict]:
    _, assistant = trained_pair()
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3}, {}


def draft_model_chain() -> tuple[dict, dict]:
    target, _ = trained_pair()
    # The target drafting for itself: most drafts are accepted, so the
    # rejection sampler's accept and resample paths both run.
    return (
        {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3},
        # Draft models need one KV cache group (Gemma 4 has two).
        {"disable_hybrid_kv_cache_manager": True},
    )


def mtp_tree() -> tuple[dict, dict]:
    speculative, options = mtp_chain()
    return {**speculative, "tree_width": 4}, options


def draft_model_tree() -> tuple[dict, dict]:
    speculative, options = draft_model_chain()
    return {**speculative, "tree_width": 3}, options


@pytest.mark.parametrize(
    "drafter", [mtp_chain, draft_model_chain, mtp_tree, draft_model_tree]
)
def test_sampling_keeps_the_plain_distribution(prompts, plain_samples, greedy_reference,
                                               drafter):
    speculative, options = drafter()
    greedy_prompts, greedy_expected = greedy_reference
    llm = engine(speculative, **options)
    try:
        runs = [
            sample_joint(llm, prompt, first_seed=NUM_SAMPLES,
                         greedy_prompts=greedy_prompts if i == 0 else ())
            for i, prompt in enumerate(prompts)
        ]
        # The same seeded requests again reproduce their samples.
        _, again, _ = sample_joint(llm, prompts[0], first_seed=NUM_SAMPLES)
        counters = spec_decode_counters(llm)
    finally:
        shutdown(llm)
    results = [homogeneity_test(p, run[0]) for p, run in zip(plain_samples, runs)]
    for i, result in enumerate(results):
        print(f"{drafter.__name__} prompt {i}: {result}")
    # Drafts were verified, and some accepted: the sampler really ran.
    assert counters["num_draft_tokens"] > 0 and counters["num_accepted_tokens"] > 0
    if "tree_width" in speculative:
        assert sum(counters["num_rescued_tokens_per_pos"]) > 0
    assert all(r.p_value > MIN_P_VALUE for r in results), [str(r) for r in results]
    assert_greedy_identical(runs[0][2], greedy_expected,
                            f"greedy beside sampled requests, {drafter.__name__}")
    reproduced = sum(a == b for a, b in zip(runs[0][1], again))
    print(f"{drafter.__name__}: {reproduced}/{NUM_SAMPLES} seeded samples reproduced")
    assert reproduced == NUM_SAMPLES


# Gemma 4 checkpoints' sampling defaults, a little cooler: no top-k, so the
# joint has many cells; the rare ones are merged.
GEMMA_SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def test_mtp_tree_at_gemma_sampling_keeps_the_plain_distribution(prompts):
    samples = {}
    for name, speculative in (("plain", None), ("tree", mtp_tree()[0])):
        llm = engine(speculative)
        try:
            samples[name] = [
                sample_joint(llm, prompt, first_seed=NUM_SAMPLES * (name == "tree"),
                             sampling=GEMMA_SAMPLING)[0]
                for prompt in prompts
            ]
        finally:
            shutdown(llm)
    results = [homogeneity_test(p, t) for p, t in zip(samples["plain"], samples["tree"])]
    for i, result in enumerate(results):
        print(f"mtp_tree at T 0.8 / top_p 0.95, prompt {i}: {result}")
    assert all(r.p_value > MIN_P_VALUE for r in results), [str(r) for r in results]
