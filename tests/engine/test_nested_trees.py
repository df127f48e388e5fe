# SPDX-License-Identifier: Apache-2.0
"""Tree sizes that follow the load: with num_speculative_tokens_per_batch_size
in tree mode, each step drafts and verifies the n likeliest nodes of the
configured tree for its batch size (n = 0: no drafts); with
enable_adaptive_verification, the n its measured acceptance and step times
favour (here from a synthetic step-time table, so that the sizes it picks do
not depend on this machine). Requests with
max_tokens 8 to 39 finish one after another, so the batch shrinks from 32 to
1 and n changes inside every request. Greedy output must stay plain greedy
decoding (tie-aware, tests/engine/identity.py) and seeded sampled output the
text those requests give decoded without drafts
(tests/engine/keyed_sampling.py). On Model Runner V2 the schedule's trees are
verified with async scheduling, each step's output naming the tree its drafts
came from."""

from __future__ import annotations

import pytest

from . import model_runner_v2
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
from .test_seeded_tree_sampling import NO_DRAFTS, SAMPLINGS
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_REQUESTS = 32
# Node counts of the 12-node continuation tree by batch size: the whole tree
# up to 8 requests, its 5 likeliest nodes up to 16, no drafts up to 24, the
# 3-node spine above.
SCHEDULE = [(1, 8, 12), (9, 16, 5), (17, 24, 0), (25, 256, 3)]


ADAPTIVE = "adaptive"


def speculative(schedule) -> dict:
    """The continuation tree sized by `schedule`, or by measured acceptance
    and step times (enable_adaptive_verification) for ADAPTIVE."""
    _, assistant = trained_pair()
    sizing = ({"enable_adaptive_verification": True} if schedule == ADAPTIVE
              else {"num_speculative_tokens_per_batch_size": schedule})
    return {"method": "mtp", "model": str(assistant),
            "speculative_token_tree": str(CONTINUATION_12), **sizing}


def synthetic_step_times(llm, monkeypatch) -> None:
    """Replaces the start-up profile's table by steps of 6 ms + 1 ms per
    draft forward + 25 us per row and request (rows cost more in a larger
    batch), left uncorrected: the size then follows the batch and the
    measured acceptance, not this machine (the whole tree for one or two
    requests, a few nodes for 4 to 16, none from about 24), at rows of 1 to
    32 requests whichever batch sizes the profile timed (on a busy machine
    its time bound leaves some out, and a table of fewer rows chooses
    otherwise)."""
    import numpy as np

    from vllm.v1.spec_decode import tree_sizing

    chooser = llm.llm_engine.engine_core.engine_core.scheduler.tree_size_chooser
    assert chooser.seconds is not None, "the start-up profile did not run"
    monkeypatch.setattr(tree_sizing.TreeSizeChooser, "_correct_table", lambda self: None)
    paths = chooser.nested.ranked_paths
    depths = [max((len(p) for p in paths[:n]), default=0) for n in chooser.node_counts]
    chooser.batch_sizes = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    chooser.seconds = np.array([
        [6e-3 + 1e-3 * depth + 25e-6 * batch * batch * (n + 1)
         for n, depth in zip(chooser.node_counts, depths)]
        for batch in chooser.batch_sizes])


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
    (whose keys a V2 tree shares), or by a V1 tree-mode engine."""
    batch = prompts()
    llm = make_llm(trained_pair()[0])
    try:
        expected = plain_greedy_reference(
            llm, batch, [max_tokens(i) for i in range(len(batch))])
        if model_runner_v2.requested():
            sampled = generate(llm, seeded(batch))
    finally:
        shutdown(llm)
    if not model_runner_v2.requested():
        llm = make_llm(trained_pair()[0], speculative(SCHEDULE), max_logprobs=-1)
        try:
            sampled = generate(llm, seeded(batch), **NO_DRAFTS)
            assert spec_decode_counters(llm)["num_draft_tokens"] == 0
        finally:
            shutdown(llm)
    return batch, expected, sampled


@pytest.mark.model_runner_v2
@pytest.mark.parametrize(
    # Sizes from measured step times run on the V1 runner only.
    "sizing", ["schedule"] if model_runner_v2.requested() else ["schedule", ADAPTIVE])
def test_tree_size_follows_the_load(references, sizing, monkeypatch):
    batch, expected, sampled_expected = references
    schedule = SCHEDULE if sizing == "schedule" else ADAPTIVE
    llm = make_llm(trained_pair()[0], speculative(schedule), max_logprobs=-1)
    try:
        if sizing == ADAPTIVE:
            synthetic_step_times(llm, monkeypatch)
        got = generate(llm, greedy(batch))
        greedy_counters = spec_decode_counters(llm)
        greedy_sizes = tree_sizes(llm)
        sampled = generate(llm, seeded(batch))
        sizes = tree_sizes(llm)
        oracle = ScoreOracle(llm)
        assert_seeded_identical(sampled, sampled_expected, seeded(batch), oracle,
                                f"nested trees by {sizing}, seeded")
    finally:
        shutdown(llm)
    assert_greedy_identical(got, expected, f"nested trees by {sizing}, greedy")
    drafted, drafts = greedy_counters["num_draft_tokens"], greedy_counters["num_drafts"]
    print(f"nested trees by {sizing}: {drafted} draft tokens in {drafts} drafts "
          f"({drafted / drafts:.2f} per draft), accepted "
          f"{greedy_counters['num_accepted_tokens']}, rescued per depth "
          f"{greedy_counters['num_rescued_tokens_per_pos']}")
    print(f"nested trees by {sizing}: steps per drafted node count {greedy_sizes} "
          f"greedy, {sizes} with the seeded requests after them")
    # Trees of several sizes were verified and drafts accepted; with the
    # schedule's long runs of the whole tree, runner-ups too.
    assert 1 < drafted / drafts < 12
    assert greedy_counters["num_accepted_tokens"] > 0
    if sizing == "schedule":
        assert set(greedy_sizes) == {0, 3, 5, 12}
        assert sum(greedy_counters["num_rescued_tokens_per_pos"]) > 0
    else:
        # Steps without drafts (the full batch) and trees of several sizes;
        # over both runs, one with siblings (few steps run at few requests,
        # several requests ending per step, and the size is chosen anew only
        # as the batch shrinks by a quarter).
        assert len(greedy_sizes) >= 3 and 0 in greedy_sizes
        assert max(sizes) > 3


@pytest.mark.model_runner_v2
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
