# SPDX-License-Identifier: Apache-2.0
"""A tree drafter that drafts against the target's own ranking, for the
sampled tree walk's exact distribution test, plugged in as a host drafter
(tests/engine/host_drafter.py).

It knows the target's best tokens at some contexts (from a plain engine) and
drafts, for ADVERSARIAL_TREE: the second-best token as the spine with the best
as its sibling, a duplicate of the best (a decoy that must count once), a
token outside the top-k (never sampled), and the top-ranked continuations of
the spine and of the best token. Where it knows the context but not the
continuations it drafts the first level only (a breadth-first prefix); where
the script says so, or the context is unknown, it drafts nothing (Model Runner
V2 verifies those nodes as <pad>, tests/engine/host_drafter.py: rejected at
the root, as if undrafted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Breadth-first: four candidates for the next token, then continuations of the
# spine (node 0), of the best token (node 1) and of the outside-top-k token.
ADVERSARIAL_TREE = "[(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (3, 0)]"
NUM_FIRST_LEVEL = 4


@dataclass
class RankingScript:
    # Context (token ids) -> the target's tokens best first (at least 6).
    ranking: dict[tuple[int, ...], list[int]]
    # Contexts that get no drafts.
    no_drafts: set[tuple[int, ...]] = field(default_factory=set)


def first_level(ranked: list[int]) -> list[int]:
    best, second = ranked[0], ranked[1]
    return [second, best, best, ranked[5]]


def adversarial_drafts(script: RankingScript, context: tuple[int, ...]) -> list[int]:
    """The drafted nodes for a context, in ADVERSARIAL_TREE's order."""
    ranked = script.ranking.get(context)
    if ranked is None or context in script.no_drafts:
        return []
    drafts = first_level(ranked)
    after_second = script.ranking.get(context + (ranked[1],))
    after_best = script.ranking.get(context + (ranked[0],))
    if after_second is None or after_best is None:
        return drafts
    return drafts + [after_second[0], after_second[1], after_best[0], ranked[4]]


class AdversarialTreeDrafter:
    script: RankingScript | None = None

    def __init__(self, vllm_config) -> None:
        assert AdversarialTreeDrafter.script is not None, "set the script first"
        self.script = AdversarialTreeDrafter.script

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [
            adversarial_drafts(self.script, tuple(token_ids_cpu[i, :n].tolist()))
            if sampled else []
            for i, (sampled, n) in enumerate(zip(sampled_token_ids, num_tokens_no_spec))
        ]

    def load_model(self, *args, **kwargs) -> None:
        pass
