# SPDX-License-Identifier: Apache-2.0
"""Tie-aware identity for seeded sampling in tree mode.

A tree-mode engine samples the token at output position i of a request with
seed s as argmax_x(logprob(x) / T + g(x)) over the top-k / top-p support, with
Gumbel noise g that is a function of (s, i, x) alone
(vllm/v1/sample/ops/position_keyed.py). Two runs of the same seeded request
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

_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gumbel_noise(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """The engine's noise for every token at output position `position` of a
    request with seed `seed`, as the CPU kernel draws it."""
    from vllm.v1.sample.ops.position_keyed import position_keys, request_noise_seed

    key = position_keys(
        np.array([request_noise_seed(seed)], dtype=np.uint64), np.array([position])
    ).view(np.uint64)
    counters = np.arange(1, vocab_size + 1, dtype=np.uint64) * _GAMMA
    bits = _splitmix64(_splitmix64(key) + counters) >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(-np.log(u))


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
        scores = scaled + gumbel_noise(self.seed, position, len(scaled))
        return np.where(keep, scores, -np.inf)


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

