# SPDX-License-Identifier: Apache-2.0
"""Tree sizes that follow the load: with num_speculative_tokens_per_batch_size
in tree mode, each step drafts and verifies the n likeliest nodes of the
configured tree for its batch size (n = 0: no drafts); with "auto", the
schedule the engine fixed from its start-up profile (of modeled step times
here, so that no verdict depends on this machine's clock) and logged, which
pins to the same choices. Requests with
max_tokens 8 to 39 finish one after another, so the batch shrinks from 32 to
1 and n changes inside every request. Greedy output must stay plain greedy
decoding (tie-aware, tests/engine/identity.py) and seeded sampled output the
text those requests give decoded without drafts
(tests/engine/keyed_sampling.py). The schedule's trees are verified with
async scheduling, each step's output naming the tree its drafts came from."""

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
from .keyed_sampling import ScoreOracle, SeededRequest, assert_seeded_identical
from .test_mtp_tree import CONTINUATION_12
from .test_seeded_tree_sampling import SAMPLINGS
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_REQUESTS = 32
# Node counts of the 12-node continuation tree by batch size: the whole tree
# up to 8 requests, its 5 likeliest nodes up to 16, no drafts up to 24, the
# 3-node spine above.
SCHEDULE = [(1, 8, 12), (9, 16, 5), (17, 24, 0), (25, 256, 3)]


# Acceptance "measured earlier" (speculative_token_tree_acceptance) that
# makes the spine worth drafting at any step time this pair shows: its first
# 3 nodes yield 3.94 tokens per step where no drafts yield 1.
SPINE_ACCEPTED = [round(1.0 - 0.01 * len(path), 2) if set(path) == {0} else 0.0
                  for path in CONTINUATION_12]


def speculative(schedule, acceptance: list[float] | None = None) -> dict:
    """The continuation tree sized by `schedule` (a schedule, or "auto"),
    "auto" starting from `acceptance` when given."""
    _, assistant = trained_pair()
    return {"method": "mtp", "model": str(assistant),
            "speculative_token_tree": str(CONTINUATION_12),
            "num_speculative_tokens_per_batch_size": schedule,
            **({"speculative_token_tree_acceptance": acceptance} if acceptance else {})}


class LoggedSchedule:
    """The schedule line and the step-time table an "auto" engine logs."""

    def __init__(self):
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        # The profile's lines, and the re-fix's (TreeSizes).
        self.loggers = [logging.getLogger("vllm.v1.engine.core"),
                        logging.getLogger("vllm.v1.spec_decode.tree")]

    def __enter__(self):
        for logger in self.loggers:
            logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        for logger in self.loggers:
            logger.removeHandler(self.handler)

    def schedule(self) -> list[list[int]]:
        import ast

        line = self.schedule_lines()[0]
        return ast.literal_eval(line.split(": ", 1)[1])

    def schedule_lines(self) -> list[str]:
        """The schedule the profile fixed, then each one the re-fix did."""
        return [line for line in self.lines
                if line.startswith("num_speculative_tokens_per_batch_size: ")]

    def timed_batch_sizes(self) -> list[int]:
        """The batch sizes (rows) of the step-time table the profile logged."""
        _, _, *rows = self._profile_line().splitlines()
        return [int(row.split()[0]) for row in rows]

    def _profile_line(self) -> str:
        (line,) = [line for line in self.lines
                   if line.startswith("Tree schedule profile took")]
        return line


def scheduled_node_counts(llm) -> list[int]:
    """The node count the engine's scheduler drafts at each batch size."""
    return list(
        llm.llm_engine.engine_core.engine_core.scheduler.tree_sizes.num_nodes_by_batch_size
    )


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_pair()[0])
    return [[tokenizer.bos_token_id, *tokenizer(t, add_special_tokens=False).input_ids]
            for t in text_prompts(NUM_REQUESTS, length=200)]


def tree_sizes(llm) -> dict[int, int]:
    """Steps per drafted node count (vllm:spec_decode_tree_num_nodes)."""
    (histogram,) = [m for m in llm.get_metrics()
                    if m.name == "vllm:spec_decode_tree_num_nodes"]
    cumulative = sorted((float(le), count) for le, count in histogram.buckets.items()
                        if le != "+Inf")
    steps = {}
    below = 0
    for le, count in cumulative:
        if count > below:
            steps[int(le)] = count - below
        below = count
    return steps


def max_tokens(i: int) -> int:
    return 8 + i


def generate(llm, requests: list[SeededRequest], **extra) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                             seed=r.seed, max_tokens=max_tokens(i), ignore_eos=True,
                             **extra)
              for i, r in enumerate(requests)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_token_ids)
                            for r in requests], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy(batch: list[list[int]]) -> list[SeededRequest]:
    return [SeededRequest(p, temperature=0.0, top_k=0, top_p=1.0, seed=None) for p in batch]


def seeded(batch: list[list[int]]) -> list[SeededRequest]:
    return [SeededRequest(p, seed=2000 + i, **SAMPLINGS[i % 2]) for i, p in enumerate(batch)]


@pytest.fixture(scope="module")
def references():
    """Plain greedy decoding (with its top-2 logprobs) and the seeded
    requests decoded without drafts: by Model Runner V2 without speculation
    (whose keys a tree shares)."""
    batch = prompts()
    llm = make_llm(trained_pair()[0])
    try:
        expected = plain_greedy_reference(
            llm, batch, [max_tokens(i) for i in range(len(batch))])
        sampled = generate(llm, seeded(batch))
    finally:
        shutdown(llm)
    return batch, expected, sampled


def modeled_step_seconds(batch_size: int, num_nodes: int) -> float:
    """The step time the "auto" profile records here instead of the clock's:
    a fixed cost plus one per row verified."""
    return 0.010 + 0.0005 * batch_size * (1 + num_nodes)


@pytest.fixture
def modeled_profile(monkeypatch):
    """An "auto" start-up profile whose table is modeled_step_seconds: every
    cell timed once, whatever this machine's clock says, so the schedule it
    fixes is the same on every run."""
    from vllm.v1.engine import core
    from vllm.v1.spec_decode.tree_sizing import StepTimeTable

    monkeypatch.setattr(core, "PROFILE_SECONDS", float("inf"))
    monkeypatch.setattr(core, "PROFILE_MAX_ROUNDS", 1)
    monkeypatch.setattr(core, "PROFILE_MAX_CELL_STEPS", 1)
    add = StepTimeTable.add
    monkeypatch.setattr(
        StepTimeTable, "add",
        lambda table, batch_size, num_nodes, seconds: add(
            table, batch_size, num_nodes, modeled_step_seconds(batch_size, num_nodes)))


def test_tree_size_follows_the_load(references):
    batch, expected, sampled_expected = references
    llm = make_llm(trained_pair()[0], speculative(SCHEDULE), max_logprobs=-1)
    try:
        got = generate(llm, greedy(batch))
        greedy_counters = spec_decode_counters(llm)
        greedy_sizes = tree_sizes(llm)
        sampled = generate(llm, seeded(batch))
        sizes = tree_sizes(llm)
        oracle = ScoreOracle(llm)
        assert_seeded_identical(sampled, sampled_expected, seeded(batch), oracle,
                                "nested trees by schedule, seeded")
    finally:
        shutdown(llm)
    assert_greedy_identical(got, expected, "nested trees by schedule, greedy")
    drafted, drafts = greedy_counters["num_draft_tokens"], greedy_counters["num_drafts"]
    print(f"nested trees by schedule: {drafted} draft tokens in {drafts} drafts, "
          f"accepted {greedy_counters['num_accepted_tokens']}, rescued per depth "
          f"{greedy_counters['num_rescued_tokens_per_pos']}; steps per drafted node "
          f"count {greedy_sizes} greedy, {sizes} with the seeded requests after them")
    # Trees of several sizes were verified and drafts accepted; with the
    # schedule's long runs of the whole tree, runner-ups too.
    assert 1 < drafted / drafts < 12
    assert greedy_counters["num_accepted_tokens"] > 0
    assert set(greedy_sizes) == {0, 3, 5, 12}
    assert sum(greedy_counters["num_rescued_tokens_per_pos"]) > 0


@pytest.mark.parametrize("acceptance", [None, SPINE_ACCEPTED],
                         ids=["auto", "auto calibrated"])
def test_auto_fixes_a_schedule_at_start_up(references, modeled_profile, acceptance):
    """"auto" times each node count at each batch size on synthetic requests
    (here: records modeled_step_seconds for each), fixes a schedule, logs it
    as a literal and drafts it; pinned, that literal drafts the same. The
    profile adds requests whose prompt is cached up to its last token, which
    vLLM would pad to num_speculative_tokens placeholder drafts: under a
    pinned node count the step must verify that count's tree instead."""
    batch, expected, _ = references
    batch = batch[:8]
    expected = expected[:8]
    with LoggedSchedule() as logged:
        llm = make_llm(trained_pair()[0], speculative("auto", acceptance),
                       max_logprobs=-1, max_num_seqs=8)
    try:
        chosen = scheduled_node_counts(llm)
        got = generate(llm, greedy(batch))
        counters = spec_decode_counters(llm)
        sizes = tree_sizes(llm)
    finally:
        shutdown(llm)
    label = "calibrated auto" if acceptance else "auto"
    assert_greedy_identical(got, expected, f"nested trees by {label}")
    logged_schedule = logged.schedule()
    print(f"auto (acceptance {acceptance}): profile over batch sizes "
          f"{logged.timed_batch_sizes()}, num_speculative_tokens_per_batch_size: "
          f"{logged_schedule}; steps per drafted node count {sizes}, accepted "
          f"{counters.get('num_accepted_tokens', 0)}")
    assert logged.timed_batch_sizes() == [1, 2, 4, 8]
    # Sampled as served: the tiny checkpoint's generation config sets
    # nothing, so an OpenAI client's temperature 1.
    (timing,) = [line for line in logged.lines if line.startswith("Timing decode steps")]
    assert timing.endswith("sampled with {'temperature': 1.0}"), timing
    assert len({n for _, _, n in logged_schedule}) <= 4
    # The schedule's node counts, and the next larger ones its exploring
    # steps draft.
    from vllm.v1.spec_decode.tree_sizing import profile_node_counts

    candidates = profile_node_counts(len(CONTINUATION_12))
    scheduled = {n for _, _, n in logged_schedule}
    explored = {min((c for c in candidates if c > n), default=n) for n in scheduled}
    assert set(sizes) <= scheduled | explored
    if acceptance is not None:
        # From a spine accepted 95 to 99 % of the time, with rows this cheap,
        # the schedule drafts at every batch size and the drafts are accepted:
        # identity above held through accepts, not only through rejections.
        assert all(n > 0 for _, _, n in logged_schedule)
        assert counters["num_accepted_tokens"] > 0
    pinned = make_llm(trained_pair()[0], speculative(logged_schedule), max_num_seqs=8)
    try:
        assert scheduled_node_counts(pinned) == chosen
    finally:
        shutdown(pinned)


# Acceptance "measured earlier" that is far too low for this pair: "auto"
# starts by drafting no nodes at any batch size.
PESSIMISTIC = [0.01] * len(CONTINUATION_12)


def test_the_refix_moves_batch_sizes_off_zero_nodes(references, modeled_profile,
                                                    monkeypatch):
    """"auto" from a pessimistic acceptance drafts nothing; its exploring steps
    (every 2nd step at a batch size here, every 32nd when served) draft the
    next node count, the scheduler counts what the walk accepts there, and the
    re-fix (every 16 steps here) moves batch sizes off 0 nodes, logged with
    its counts. The output stays plain greedy decoding's."""
    from vllm.v1.spec_decode import tree_sizing

    monkeypatch.setattr(tree_sizing, "RESCHEDULE_STEPS", 16)
    monkeypatch.setattr(tree_sizing, "RESCHEDULE_ADOPT_AFTER_STEPS", 2)
    monkeypatch.setattr(tree_sizing, "EXPLORE_EVERY_STEPS", 2)
    batch, expected, _ = references
    with LoggedSchedule() as logged:
        llm = make_llm(trained_pair()[0], speculative("auto", PESSIMISTIC),
                       max_logprobs=-1)
        try:
            started = scheduled_node_counts(llm)
            got = generate(llm, greedy(batch))
            moved = scheduled_node_counts(llm)
            counters = spec_decode_counters(llm)
            sizes = tree_sizes(llm)
        finally:
            shutdown(llm)
    assert_greedy_identical(got, expected, "auto from a pessimistic acceptance")
    refixes = logged.schedule_lines()[1:]
    print(f"started from {PESSIMISTIC[0]} acceptance: {logged.schedule_lines()[0]}; "
          f"re-fixed: {refixes}; steps per drafted node count {sizes}, accepted "
          f"{counters.get('num_accepted_tokens', 0)}")
    assert set(started[1:]) == {0}
    assert refixes and "steps exploring a larger tree" in refixes[0]
    assert any(n > 0 for n in moved[1:])
    assert counters["num_accepted_tokens"] > 0


def test_a_schedule_of_zero_nodes_turns_speculation_off(references):
    batch, expected, _ = references
    llm = make_llm(trained_pair()[0], speculative([(1, 256, 0)]))
    try:
        got = generate(llm, greedy(batch))
        counters = spec_decode_counters(llm)
    finally:
        shutdown(llm)
    assert_greedy_identical(got, expected, "nested trees, schedule of 0 nodes")
    assert counters.get("num_draft_tokens", 0) == 0


def test_requests_reach_max_model_len_with_nested_trees_of_several_sizes():
    """Near max_model_len the runner hands the scheduler zero drafts instead
    of drafting: they must number the nodes of the tree the next step
    verifies (8 or all 32 here, by batch size), and drafts left from a step
    of another size must not be verified."""
    from .test_mtp_tree import CONTINUATION_32

    _, assistant = trained_pair()
    config = {"method": "mtp", "model": str(assistant),
              "speculative_token_tree": str(CONTINUATION_32),
              "num_speculative_tokens_per_batch_size": [(1, 2, 32), (3, 256, 8)]}
    batch = prompts()[:4]
    plain = make_llm(trained_pair()[0], max_model_len=256)
    try:
        expected = plain_greedy_reference(plain, batch, 256)
    finally:
        shutdown(plain)
    llm = make_llm(trained_pair()[0], config, max_model_len=256)
    try:
        got = greedy_generate(llm, batch, 256)
        counters = spec_decode_counters(llm)
        sizes = tree_sizes(llm)
    finally:
        shutdown(llm)
    assert all(len(p) + len(t) == 256 for p, t in zip(batch, got))
    assert_greedy_identical(got, expected, "nested trees to max_model_len")
    assert counters["num_accepted_tokens"] > 0
    assert {8, 32} <= set(sizes)
