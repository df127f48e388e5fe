# SPDX-License-Identifier: Apache-2.0
"""Tie-aware greedy identity: the one rule every test (and the E[L] harness)
uses to compare a speculative run with plain greedy decoding.

Speculative verify computes a token's logits in another batch shape, and on
CPU partly in another kernel, than plain decoding does, so the last bits of a
logit may differ between the two runs and between CPUs (AVX2 vs AVX-512).
Where plain decoding's best two tokens are tied to fp32 precision, which of
them wins is hardware luck, not a property of the tree. So:

- tokens must be equal up to the first difference;
- at the first difference, plain decoding's own top-2 logprob margin at that
  step must be at most `TIE_MARGIN_NATS`, and the speculative token must be
  one of those two; otherwise it is a mismatch and the check fails, naming
  prompt, step, both tokens and the margin;
- such a tie flip ends the comparison of that prompt (everything after it
  is conditioned on another token); more than `MAX_TIE_FLIP_SHARE` of the
  prompts flipping fails the check too.

The margins come from the plain run itself (`logprobs=2`), never from a
second engine.
"""

from __future__ import annotations

import ast
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

# The helper of the stack's in-tree identity tests, in the patched vLLM tree
# that `bash ci/test.sh` lays out.
IN_TREE_HELPER = (Path(__file__).resolve().parents[2] / "build" / "vllm-patched"
                  / "tests" / "v1" / "spec_decode" / "tree_utils.py")


def in_tree_constant(name: str) -> float:
    """A constant of the in-tree helper, read from its source (importing it
    would shadow this project's `tests` package with vLLM's)."""
    if not IN_TREE_HELPER.exists():
        raise FileNotFoundError(
            f"{IN_TREE_HELPER} is missing: `bash ci/test.sh` lays out the patched tree")
    for node in ast.parse(IN_TREE_HELPER.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == name for target in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{IN_TREE_HELPER} defines no {name}")


# One margin for the in-tree tests and these: fp32 logprobs of these tiny
# models lie in [-10, 0], where one ulp is at most ~1e-6; the
# kernel-vs-recomputation differences seen (last bits of a logit) stay within
# a few ulps. A real verify bug moves a logit by far more (the negative control
# in tests/engine/test_tree_verify.py sees margins >= 1e-2).
TIE_MARGIN_NATS = in_tree_constant("TIE_MARGIN_NATS")
# Tie flips allowed per check, as a share of its prompts.
MAX_TIE_FLIP_SHARE = 0.02

# Every check of the session, for the terminal summary (tests/conftest.py).
IDENTITY_REPORTS: list["IdentityReport"] = []


@dataclass(frozen=True)
class StepTop2:
    """Plain decoding's two best tokens at one step, with their logprobs."""

    first: int
    first_logprob: float
    second: int
    second_logprob: float

    @property
    def margin(self) -> float:
        return self.first_logprob - self.second_logprob

    @classmethod
    def from_logprobs(cls, logprobs: dict) -> "StepTop2":
        """From one step of vLLM's `CompletionOutput.logprobs` (token id ->
        object with `.logprob`) or of the OpenAI API's `top_logprobs` (token
        id -> float)."""
        items = sorted(
            ((getattr(lp, "logprob", lp), token) for token, lp in logprobs.items()),
            key=lambda item: (-item[0], item[1]),
        )
        if len(items) < 2:
            raise ValueError("tie-aware identity needs logprobs=2 in the plain run")
        (lp1, t1), (lp2, t2) = items[:2]
        return cls(int(t1), float(lp1), int(t2), float(lp2))


@dataclass
class GreedyReference:
    """Plain greedy decoding of some prompts: tokens and per-step top-2."""

    tokens: list[list[int]]
    top2: list[list[StepTop2]]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index) -> "GreedyReference":
        """A sub-reference (slice) or, for an int, a one-prompt reference."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return GreedyReference(self.tokens[index], self.top2[index])

    def suffix(self, start: int) -> "GreedyReference":
        """The same decoding from generated token `start` on (for requests
        resumed with their first `start` tokens in the prompt)."""
        return GreedyReference(
            [t[start:] for t in self.tokens], [s[start:] for s in self.top2]
        )

    def median_margin(self) -> float:
        margins = sorted(s.margin for steps in self.top2 for s in steps)
        return margins[len(margins) // 2] if margins else math.nan


@dataclass(frozen=True)
class Divergence:
    prompt: int
    step: int
    expected: int
    got: int
    margin: float
    second: int

    def __str__(self) -> str:
        return (
            f"prompt {self.prompt}, step {self.step}: plain greedy {self.expected}, "
            f"speculative {self.got}; plain top-2 margin {self.margin:.3g} nats "
            f"(runner-up {self.second})"
        )


@dataclass
class IdentityReport:
    label: str
    num_prompts: int
    num_tokens_compared: int = 0
    tie_flips: list[Divergence] = field(default_factory=list)
    mismatches: list[Divergence] = field(default_factory=list)
    length_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.mismatches
            and not self.length_errors
            and len(self.tie_flips) <= MAX_TIE_FLIP_SHARE * self.num_prompts
        )

    def summary(self) -> str:
        line = (
            f"{self.label}: {self.num_prompts} prompts, "
            f"{self.num_tokens_compared} tokens compared, "
            f"{len(self.tie_flips)} tie flips, {len(self.mismatches)} mismatches"
        )
        if self.mismatches:
            margins = sorted(d.margin for d in self.mismatches)
            line += (
                f" (plain top-2 margin at the mismatches: min {margins[0]:.3g}, "
                f"median {margins[len(margins) // 2]:.3g} nats)"
            )
        return line

    def failure_message(self) -> str:
        lines = [self.summary()]
        lines += [f"  mismatch: {d}" for d in self.mismatches[:10]]
        lines += [f"  length: {e}" for e in self.length_errors[:10]]
        if len(self.tie_flips) > MAX_TIE_FLIP_SHARE * self.num_prompts:
            lines.append(
                f"  more than {MAX_TIE_FLIP_SHARE:.0%} of the prompts flipped at ties:"
            )
        lines += [f"  tie flip: {d}" for d in self.tie_flips[:10]]
        return "\n".join(lines)


def current_test_id() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "speculative").rsplit(" (", 1)[0]


def compare_tokens(
    got: list[list[int]],
    expected: list[list[int]],
    judge,
    label: str,
) -> IdentityReport:
    """Compares two runs token by token up to each prompt's first difference,
    where `judge(prompt, step, expected_token, got_token)` returns
    (margin, runner_up, is_tie) from the reference run; records the report
    for the session summary and does not raise."""
    report = IdentityReport(label, len(expected))
    if len(got) != len(expected):
        report.length_errors.append(f"{len(got)} outputs for {len(expected)} prompts")
    for prompt, (tokens, reference) in enumerate(zip(got, expected)):
        step = next(
            (i for i, (g, e) in enumerate(zip(tokens, reference)) if g != e), None
        )
        if step is None:
            report.num_tokens_compared += min(len(tokens), len(reference))
            if len(tokens) != len(reference):
                report.length_errors.append(
                    f"prompt {prompt}: {len(tokens)} tokens, reference {len(reference)}"
                )
            continue
        report.num_tokens_compared += step + 1
        margin, runner_up, is_tie = judge(prompt, step, reference[step], tokens[step])
        divergence = Divergence(prompt, step, reference[step], tokens[step], margin,
                                runner_up)
        (report.tie_flips if is_tie else report.mismatches).append(divergence)
    IDENTITY_REPORTS.append(report)
    return report


def compare_with_plain_greedy(
    got: list[list[int]], reference: GreedyReference, label: str | None = None
) -> IdentityReport:
    """Compares speculative outputs with plain greedy under the tie rule and
    records the report for the session summary; does not raise. The label
    defaults to the running test's id."""

    def judge(prompt: int, step: int, expected: int, token: int):
        top = reference.top2[prompt][step]
        runner_up = top.second if top.first == expected else top.first
        return top.margin, runner_up, (
            top.margin <= TIE_MARGIN_NATS and token in (top.first, top.second))

    return compare_tokens(got, reference.tokens, judge, label or current_test_id())


def assert_greedy_identical(
    got: list[list[int]], reference: GreedyReference, label: str | None = None
) -> IdentityReport:
    """`compare_with_plain_greedy`, failing the test unless identical up to
    tolerated fp32 tie flips."""
    report = compare_with_plain_greedy(got, reference, label)
    assert report.ok, report.failure_message()
    return report
