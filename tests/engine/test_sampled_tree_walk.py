# SPDX-License-Identifier: Apache-2.0
"""The sampled tree walk against the exact distribution of plain sampling.

A plain engine gives the target's logprobs at the prompt P and at every
context P+y1 and P+y1+y2 within top-k, from which the exact joint of the first
three sampled tokens follows (temperature T, top-k 4: softmax of logprob / T
over the 4 best). A tree engine whose drafter drafts against that ranking
(tests/engine/adversarial_drafter.py: the second-best token as spine, the best
as its sibling, a duplicate decoy, a token outside top-k, continuations, and
contexts it drafts nothing at) must sample that joint (chi-square goodness of fit), with
per-depth acceptance within 4 sigma of its exact expectation (the walk accepts
exactly what it can), greedy requests beside it equal to plain greedy, and
seeded requests that reproduce. 384 samples: Model Runner V2 under
Triton's interpreter samples about 2 per second (every verify row runs the
Gumbel kernel), and a walk that reads the wrong rows fails at 128 (the
negative control below: p ~ 1e-19 at 192). A walk that reuses one noise
vector per request needs tens of thousands (p ~ 0.08 at 2,000); seeded
identity against plain decoding catches it
(tests/engine/test_seeded_tree_sampling.py).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from .adversarial_drafter import ADVERSARIAL_TREE, AdversarialTreeDrafter, RankingScript
from .host_drafter import host_drafter
from .conftest import make_llm, plain_greedy_reference, shutdown, spec_decode_counters
from .distribution import goodness_of_fit
from .identity import assert_greedy_identical
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

TEMPERATURE = 0.8
TOP_K = 4
NUM_SAMPLES = 384
NUM_NEGATIVE_SAMPLES = 128
NUM_TOKENS = 3
NUM_REPRODUCED = 64
DRAFTER = "tests.engine.adversarial_drafter.AdversarialTreeDrafter"
MIN_P_VALUE = 1e-3


def engine(speculative: dict | None):
    target, _ = trained_pair()
    # A token budget above max_num_seqs prompts: all are prefilled in one
    # step (seeded chunked prompts: tests/engine/test_seeded_requests.py).
    return make_llm(target, speculative, max_num_seqs=128, max_num_batched_tokens=8192,
                    enable_prefix_caching=True)


def tokenize(texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_pair()[0])
    return [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False).input_ids[-40:]]
            for t in texts]


def next_token_logprobs(llm, contexts: list[tuple[int, ...]]) -> list[dict[int, float]]:
    """The target's 8 best next tokens and raw logprobs at each context."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(c)) for c in contexts],
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=8),
        use_tqdm=False,
    )
    return [
        {token: lp.logprob for token, lp in o.outputs[0].logprobs[0].items()}
        for o in outputs
    ]


def processed(logprobs: dict[int, float]) -> dict[int, float]:
    """Plain sampling's distribution: temperature, then the top-k tokens."""
    best = sorted(logprobs, key=lambda t: -logprobs[t])[:TOP_K]
    weights = {t: math.exp((logprobs[t] - logprobs[best[0]]) / TEMPERATURE) for t in best}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


@pytest.fixture(scope="module")
def reference():
    """The prompt (the flattest of a few), the ranking script, the exact
    joint and per-depth acceptance, and plain greedy references."""
    candidates = [tuple(p) for p in tokenize([t[-200:] for t in text_prompts(12)])]
    greedy_prompts = tokenize([t[-120:] for t in text_prompts(44)[12:]])
    llm = engine(None)
    try:
        at_prompt = next_token_logprobs(llm, candidates)
        prompt = min(candidates,
                     key=lambda c: max(processed(at_prompt[candidates.index(c)]).values()))
        ranking: dict[tuple[int, ...], dict[int, float]] = {
            prompt: at_prompt[candidates.index(prompt)]
        }
        frontier = [prompt]
        for _ in range(2):
            contexts = [c + (t,) for c in frontier for t in processed(ranking[c])]
            ranking.update(zip(contexts, next_token_logprobs(llm, contexts)))
            frontier = contexts
        greedy_expected = plain_greedy_reference(llm, greedy_prompts, 16)
    finally:
        shutdown(llm)

    dist = {c: processed(lps) for c, lps in ranking.items()}
    ranked = {c: sorted(lps, key=lambda t: -lps[t]) for c, lps in ranking.items()}
    # The 4th-ranked first token's context is drafted nothing.
    no_drafts = {prompt + (ranked[prompt][3],)}
    joint = {
        (y1, y2, y3): p1 * p2 * p3
        for y1, p1 in dist[prompt].items()
        for y2, p2 in dist[prompt + (y1,)].items()
        for y3, p3 in dist[prompt + (y1, y2)].items()
    }

    def first_level_accepts(context) -> float:
        # The spine (2nd best) or its sibling (best); the decoy repeats the
        # best and the 4th node lies outside top-k.
        r = ranked[context]
        return dist[context][r[0]] + dist[context][r[1]]

    depth_1 = depth_2 = 0.0
    for y1, p1 in dist[prompt].items():
        c1 = prompt + (y1,)
        r1 = ranked[c1]
        if c1 in no_drafts:
            depth_1 += p1 * sum(p2 * first_level_accepts(c1 + (y2,))
                                for y2, p2 in dist[c1].items())
            continue
        depth_1 += p1 * first_level_accepts(c1)
        # Rejected at C1: the next step drafts C1 + y2's first level.
        depth_1 += p1 * sum(p2 * first_level_accepts(c1 + (y2,))
                            for y2, p2 in dist[c1].items() if y2 not in r1[:2])
        after_second, after_best = ranked[c1 + (r1[1],)], ranked[c1 + (r1[0],)]
        depth_2 += p1 * (
            dist[c1][r1[1]] * sum(dist[c1 + (r1[1],)][t] for t in after_second[:2])
            + dist[c1][r1[0]] * dist[c1 + (r1[0],)][after_best[0]]
        )
    script = RankingScript(ranking={c: r for c, r in ranked.items()}, no_drafts=no_drafts)
    return prompt, script, joint, (depth_1, depth_2), greedy_prompts, greedy_expected


def sample(llm, prompt, first_seed: int, count: int, greedy_prompts=()):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampled = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=first_seed + i,
                              max_tokens=NUM_TOKENS, ignore_eos=True) for i in range(count)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [list(prompt)] * count + list(greedy_prompts)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           sampled + [greedy] * len(greedy_prompts), use_tqdm=False)
    tokens = [tuple(o.outputs[0].token_ids) for o in outputs]
    return tokens[:count], [list(t) for t in tokens[count:]]


def test_sampled_tree_walk_samples_the_exact_distribution(reference):
    prompt, script, joint, (depth_1, depth_2), greedy_prompts, greedy_expected = reference
    AdversarialTreeDrafter.script = script
    llm = engine({**host_drafter(DRAFTER), "speculative_token_tree": ADVERSARIAL_TREE})
    try:
        samples, greedy_got = sample(llm, prompt, 0, NUM_SAMPLES, greedy_prompts)
        counters = spec_decode_counters(llm)
        again, _ = sample(llm, prompt, 0, NUM_REPRODUCED)
    finally:
        shutdown(llm)

    fit = goodness_of_fit(Counter(samples), joint)
    accepted = counters["num_accepted_tokens_per_pos"]
    deviations = []
    for count, p in zip(accepted, (depth_1, depth_2)):
        sigma = math.sqrt(NUM_SAMPLES * p * (1 - p))
        deviations.append((count - NUM_SAMPLES * p) / sigma)
    print(f"sampled tree walk vs exact joint: {fit}")
    print(f"accepted per depth {accepted[:2]}, expected "
          f"{NUM_SAMPLES * depth_1:.1f} / {NUM_SAMPLES * depth_2:.1f}, "
          f"deviations {deviations[0]:+.2f} / {deviations[1]:+.2f} sigma; "
          f"rescued {counters['num_rescued_tokens_per_pos']}")

    assert fit.outside_support == 0
    assert fit.p_value > MIN_P_VALUE, str(fit)
    assert all(abs(d) <= 4 for d in deviations), deviations
    assert sum(counters["num_rescued_tokens_per_pos"]) > 0
    assert again == samples[:NUM_REPRODUCED]
    assert_greedy_identical(greedy_got, greedy_expected,
                            "greedy beside the adversarial sampled tree")


def test_a_walk_that_reads_the_wrong_rows_fails_the_same_check(reference, monkeypatch):
    """The negative control: every row reports its request's root sample (a
    walk reading the wrong rows) must fail the goodness of fit above."""
    from vllm.v1.worker.gpu.spec_decode.tree import rejection_sampler

    walk = rejection_sampler.tree_walk

    def wrong_row_walk(target_tokens, input_tokens, positions, cu_num_logits, *args):
        starts = cu_num_logits[:-1].long()
        rows_per_request = (cu_num_logits[1:] - cu_num_logits[:-1]).long()
        roots = target_tokens[starts.repeat_interleave(rows_per_request)]
        return walk(roots, input_tokens, positions, cu_num_logits, *args)

    monkeypatch.setattr(rejection_sampler, "tree_walk", wrong_row_walk)
    prompt, script, joint, _, _, _ = reference
    AdversarialTreeDrafter.script = script
    llm = engine({**host_drafter(DRAFTER), "speculative_token_tree": ADVERSARIAL_TREE})
    try:
        samples, _ = sample(llm, prompt, 0, NUM_NEGATIVE_SAMPLES)
    finally:
        shutdown(llm)
    fit = goodness_of_fit(Counter(samples), joint)
    print(f"negative control, the wrong rows' samples: {fit}")
    assert fit.outside_support > 0 or fit.p_value < MIN_P_VALUE, str(fit)
