# SPDX-License-Identifier: Apache-2.0
"""Tie-aware identity for seeded sampling in tree mode.

A tree-mode engine samples the token at output position i of a request with
seed s as argmax_x(logprob(x) / T + g(x)) over the top-k / top-p support, with
Gumbel noise g that is a function of (s, i, x) alone: Model Runner V2's
murmur3 keys of (s, input position of the sampled row, x)
(vllm/v1/worker/gpu/sample/gumbel.py), which plain decoding draws too.
Two runs of the same seeded request
must therefore emit the same tokens whatever the tree, the drafter, the batch
or a preemption, up to fp32 noise in the logits. At the first difference the
rule of tests/engine/identity.py applies with these scores in place of greedy
logprobs: the two tokens must be the best two scores at that step, within
`TIE_MARGIN_NATS` of each other, or it is a mismatch.

The scores are recomputed here on the host, the noise bit for bit as the
engine draws it, from the full next-token logprobs of the reference text
(`ScoreOracle`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .identity import TIE_MARGIN_NATS, IdentityReport, compare_tokens

_MASK_32 = np.uint64(0xFFFFFFFF)


def _rotl32(value: np.ndarray, shift: int) -> np.ndarray:
    return ((value << np.uint64(shift)) | (value >> np.uint64(32 - shift))) & _MASK_32


def _murmur3_mix(h: np.ndarray, key: np.ndarray) -> np.ndarray:
    key = _rotl32((key * np.uint64(0xCC9E2D51)) & _MASK_32, 15)
    h = _rotl32(h ^ ((key * np.uint64(0x1B873593)) & _MASK_32), 13)
    return (h * np.uint64(5) + np.uint64(0xE6546B64)) & _MASK_32


def _murmur3_fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & _MASK_32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & _MASK_32
    return h ^ (h >> np.uint64(16))


def gumbel_noise_v2(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Model Runner V2's noise for every token sampled at input position
    `position` of a request with seed `seed` (`murmur3_uniform32`), in
    float64: near-ties are judged, not bits."""
    seed_bits = seed & 0xFFFFFFFFFFFFFFFF
    h = np.zeros(vocab_size, dtype=np.uint64)
    for word in (seed_bits & 0xFFFFFFFF, seed_bits >> 32, position & 0xFFFFFFFF):
        h = _murmur3_mix(h, np.full(vocab_size, word, dtype=np.uint64))
    h = _murmur3_mix(h, np.arange(vocab_size, dtype=np.uint64))
    random32 = _murmur3_fmix32(h ^ np.uint64(16))
    u = (random32.astype(np.float64) + 0.5) * 2.0**-32
    return -np.log(-np.log1p(-u))


@dataclass(frozen=True)
class SeededRequest:
    prompt_token_ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int | None

    def scores(self, logprobs: np.ndarray, position: int) -> np.ndarray:
        """Each token's sampling score at `position` given the full next-token
        logprobs there; -inf outside the top-k / top-p support."""
        if self.temperature == 0:
            return logprobs
        assert self.seed is not None
        scaled = logprobs / self.temperature
        order = np.argsort(-scaled, kind="stable")
        keep = np.zeros_like(scaled, dtype=bool)
        top_k = self.top_k if self.top_k > 0 else len(scaled)
        probs = np.exp(scaled[order[:top_k]] - scaled[order[0]])
        probs /= probs.sum()
        # vLLM's top-p keeps the tokens before the cumulative mass reaches p,
        # and always the best one.
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        keep[order[:top_k][before < self.top_p]] = True
        # V2 keys the row that samples output position i by its input
        # position, the prompt's length plus i - 1.
        input_position = len(self.prompt_token_ids) + position - 1
        noise = gumbel_noise_v2(self.seed, input_position, len(scaled))
        return np.where(keep, scaled + noise, -np.inf)


class ScoreOracle:
    """Full next-token logprobs of a context, from an engine started with
    max_logprobs=-1."""

    def __init__(self, llm):
        self.llm = llm

    def logprobs(self, context: list[int]) -> np.ndarray:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        output = self.llm.generate(
            TokensPrompt(prompt_token_ids=context),
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1),
            use_tqdm=False,
        )[0].outputs[0]
        logprobs = np.full(vocab_size, -np.inf)
        for token, lp in output.logprobs[0].items():
            logprobs[token] = lp.logprob
        return logprobs


def compare_seeded(
    got: list[list[int]],
    expected: list[list[int]],
    requests: list[SeededRequest],
    oracle: ScoreOracle,
    label: str,
) -> IdentityReport:
    """Tie-aware comparison of two runs of the same seeded requests; records
    the report for the session summary."""

    def judge(index: int, step: int, reference: int, token: int):
        request = requests[index]
        context = request.prompt_token_ids + expected[index][:step]
        scores = request.scores(oracle.logprobs(context), step)
        best, second = (int(t) for t in np.argsort(-scores, kind="stable")[:2])
        margin = float(scores[reference] - scores[token])
        return margin, second if best == reference else best, (
            {reference, token} == {best, second} and abs(margin) <= TIE_MARGIN_NATS)

    return compare_tokens(got, expected, judge, label)


def assert_seeded_identical(*args, **kwargs) -> IdentityReport:
    report = compare_seeded(*args, **kwargs)
    assert report.ok, report.failure_message()
    return report

