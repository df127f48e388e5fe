# SPDX-License-Identifier: Apache-2.0
"""What the engine and the server tests of request kinds share: the
structured-output constraints and their check, how stops are chosen from a
plain continuation, and how returned logprobs are compared."""

from __future__ import annotations

import json
import re

# Differences seen between a tree row's and plain decoding's logprobs: about
# 1e-5 nats (last bits of the attention); a wrong row is off by far more.
LOGPROB_TOLERANCE = 1e-4
JSON_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
REGEX = r"def [a-z_]{1,12}\(self\):"
# Without it the tiny model pads JSON with whitespace up to max_tokens.
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}


def check_structured_output(kind: str, text: str) -> None:
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 99, text
        assert isinstance(value["b"], bool), text
    else:
        assert re.fullmatch(REGEX, text), text


def pick_stops(tokenizer, continuation: list[int],
               step_tokens: int | None = None) -> list[tuple[int, dict]]:
    """A stop token and a stop string that end a greedy continuation at a
    chosen output index i (from 3 on), as (i, stop parameters): the token at
    i where it first occurs, and the text of tokens i - 1 and i where it is
    first met at token i. With `step_tokens` (tokens a tree step emits when
    every draft is accepted), i is never a step's bonus token: the stop falls
    inside an accepted path (index 0 is the prefill's token)."""
    texts = [tokenizer.decode(continuation[:i]) for i in range(len(continuation) + 1)]
    stop_token = stop_string = None
    for i in range(3, len(continuation)):
        if step_tokens and i % step_tokens == 0:
            continue
        if stop_token is None and continuation[i] not in continuation[:i]:
            stop_token = (i, {"stop_token_ids": [continuation[i]]})
        piece = texts[i + 1][len(texts[i - 1]):]
        if (stop_string is None and i >= 6 and len(piece.strip()) >= 2
                and piece not in texts[i]):
            stop_string = (i, {"stop": [piece]})
    return [stop for stop in (stop_token, stop_string) if stop is not None]


def logprob_difference(plain_steps: list[dict | None],
                       tree_steps: list[dict | None]) -> tuple[float, list[str]]:
    """Largest difference of the logprobs both runs returned (each step a
    dict token id -> logprob), and the steps whose returned token sets
    differ, unless the tokens swapped across the top-k cut are tied there
    within LOGPROB_TOLERANCE."""
    largest, differing = 0.0, []
    for step, (plain, tree) in enumerate(zip(plain_steps, tree_steps)):
        if plain is None and tree is None:
            continue
        for token in plain.keys() & tree.keys():
            largest = max(largest, abs(plain[token] - tree[token]))
        if plain.keys() != tree.keys():
            cut = min(plain.values())
            swapped = [plain.get(t, tree.get(t)) for t in plain.keys() ^ tree.keys()]
            if any(abs(value - cut) > LOGPROB_TOLERANCE for value in swapped):
                differing.append(f"step {step}: {sorted(plain)} vs {sorted(tree)}")
    return largest, differing


def common_prefix_len(first: list[int], second: list[int]) -> int:
    """Tokens compared for logprobs: up to and including a first (tie-flip)
    difference, after which the contexts differ."""
    for i, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return i + 1
    return min(len(first), len(second))
