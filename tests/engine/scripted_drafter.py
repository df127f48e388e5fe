# SPDX-License-Identifier: Apache-2.0
"""A tree drafter scripted from the plain-greedy reference, plugged into vLLM
as a host drafter (tests/engine/host_drafter.py: `host_drafter(
"tests.engine.scripted_drafter.ScriptedTreeDrafter")` is its speculative
config).

Knowing the tokens plain greedy decoding will produce, it decides per step and
per request which tree nodes carry them, so every path of the tree walk and of
the accepted-path KV commit is exercised on purpose: the spine right to some
depth, the right token only at a sibling of rank r, only on a deep node, on no
node at all, or along a random path, with decoy siblings that repeat the right
token. The choice depends only on the request's prompt and length, never on
batching, so two engines given the same script see the same drafts.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

import numpy as np

STRATEGIES = ("spine", "sibling", "deep", "all_wrong", "all_right", "random")


@dataclass
class DraftScript:
    """What the drafter knows and how it lies."""

    # Each prompt followed by its plain-greedy continuation.
    references: list[list[int]]
    prompt_lens: list[int]
    strategies: tuple[str, ...] = STRATEGIES
    vocab_size: int = 512
    # Probability that a wrong node repeats the right token of its depth.
    decoy_rate: float = 0.1
    seed: int = 0
    # Filled by the drafter: how often each strategy was drafted.
    drafted: dict[str, int] = field(default_factory=dict)


class ScriptedTreeDrafter:
    script: DraftScript | None = None

    def __init__(self, vllm_config) -> None:
        assert ScriptedTreeDrafter.script is not None, "set ScriptedTreeDrafter.script"
        self.script = ScriptedTreeDrafter.script
        spec = vllm_config.speculative_config
        if spec.token_tree is not None:
            self.paths = list(spec.token_tree)
        else:
            self.paths = [(0,) * depth for depth in range(1, spec.num_speculative_tokens + 1)]
        self.index = {path: node for node, path in enumerate(self.paths)}
        self.children: dict[tuple, list[int]] = {}
        for node, path in enumerate(self.paths):
            self.children.setdefault(path[:-1], []).append(node)
        self.max_depth = max(len(p) for p in self.paths)
        self._by_prefix = {}
        for ref, prompt_len in zip(self.script.references, self.script.prompt_lens):
            self._by_prefix.setdefault(tuple(ref[:4]), []).append((ref, prompt_len))

    def _reference(self, context: np.ndarray) -> list[int]:
        for ref, prompt_len in self._by_prefix.get(tuple(context[:4].tolist()), []):
            if len(context) >= prompt_len and ref[:prompt_len] == context[:prompt_len].tolist():
                return ref
        raise LookupError("request not in the script's references")

    def _right_path(self, rng: random.Random, strategy: str) -> list[int]:
        """Nodes (one per depth, from depth 1) that carry the right tokens."""
        path: list[int] = []
        cur: tuple = ()
        if strategy == "all_wrong":
            return path
        if strategy in ("spine", "all_right"):
            stop = self.max_depth if strategy == "all_right" else rng.randint(1, self.max_depth)
            while len(path) < stop and cur + (0,) in self.index:
                cur = cur + (0,)
                path.append(self.index[cur])
            return path
        if strategy == "sibling":
            # The spine to some depth, then a sibling of rank > 0 where one
            # exists, then down that sibling's rank-0 children.
            depth = rng.randint(1, self.max_depth)
            while len(path) < depth - 1 and cur + (0,) in self.index:
                cur = cur + (0,)
                path.append(self.index[cur])
            siblings = [n for n in self.children.get(cur, []) if self.paths[n][-1] > 0]
            if not siblings:
                return path
            node = rng.choice(siblings)
            path.append(node)
            cur = self.paths[node]
            while cur + (0,) in self.index:
                cur = cur + (0,)
                path.append(self.index[cur])
            return path
        if strategy == "deep":
            # A deepest node, reached through whatever ranks lead there.
            deepest = [n for n, p in enumerate(self.paths) if len(p) == self.max_depth]
            leaf = self.paths[rng.choice(deepest)]
            return [self.index[leaf[:d]] for d in range(1, len(leaf) + 1)]
        assert strategy == "random"
        stop = rng.randint(0, self.max_depth)
        while len(path) < stop and self.children.get(cur):
            node = rng.choice(self.children[cur])
            path.append(node)
            cur = self.paths[node]
        return path

    def _draft(self, context: np.ndarray) -> list[int]:
        ref = self._reference(context)
        n = len(context)
        seed = zlib.crc32(np.asarray(ref[:16], dtype=np.int64).tobytes()) ^ n ^ self.script.seed
        rng = random.Random(seed)
        strategy = rng.choice(self.script.strategies)
        self.script.drafted[strategy] = self.script.drafted.get(strategy, 0) + 1
        truth = [
            ref[n + d] if n + d < len(ref) else rng.randrange(3, self.script.vocab_size)
            for d in range(self.max_depth)
        ]
        right = set(self._right_path(rng, strategy))
        tokens = []
        for node, path in enumerate(self.paths):
            right_token = truth[len(path) - 1]
            if node in right or (
                strategy != "all_wrong" and rng.random() < self.script.decoy_rate
            ):
                tokens.append(right_token)
            else:
                wrong = rng.randrange(3, self.script.vocab_size - 1)
                tokens.append(wrong if wrong < right_token else wrong + 1)
        return tokens

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [
            self._draft(token_ids_cpu[i, : num_tokens_no_spec[i]]) if sampled else []
            for i, sampled in enumerate(sampled_token_ids)
        ]

    def load_model(self, *args, **kwargs) -> None:
        pass
