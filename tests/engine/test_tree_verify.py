# SPDX-License-Identifier: Apache-2.0
"""Tree verify on the real engine: for every tree shape, batch size and
scheduler situation below, the patched CPU wheel must produce the plain-greedy
tokens (tie-aware, tests/engine/identity.py), while the scripted drafter makes
the walk accept deep paths and sibling rescues (asserted from the engine's own
metrics). A deliberately wrong verify must fail the same check."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from .host_drafter import host_drafter
from .conftest import (
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from .identity import TIE_MARGIN_NATS, assert_greedy_identical, compare_with_plain_greedy
from .scripted_drafter import DraftScript, ScriptedTreeDrafter

pytestmark = pytest.mark.engine

NUM_PROMPTS = 12
MAX_TOKENS = 16
VOCAB_SIZE = 512
DRAFTER = "tests.engine.scripted_drafter.ScriptedTreeDrafter"

CHAIN_TREE = "[(0,), (0, 0), (0, 0, 0)]"
# Continuation children under non-spine nodes: (1, 0), (1, 1), (0, 1, 0), ...
CONTINUATION_TREE = (
    "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0), "
    "(1, 0, 0), (0, 0, 0, 0)]"
)
SHAPES = {
    "chain": {"speculative_token_tree": CHAIN_TREE},
    "leaf_siblings_k3_w4": {"num_speculative_tokens": 3, "tree_width": 4},
    "continuations": {"speculative_token_tree": CONTINUATION_TREE},
}

# Totals over every tree run of this module, checked at the end.
COVERAGE: Counter = Counter()


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Many prompts are longer than the tiny target's sliding window (16).
    return [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(4, 100))]
        for _ in range(count)
    ]


def generate(llm, prompts, max_tokens: int = MAX_TOKENS, **params) -> list[list[int]]:
    return greedy_generate(llm, prompts, max_tokens, **params)


@pytest.fixture(scope="module")
def reference(tiny_gemma4):
    """Plain greedy decoding of the prompts (with its top-2 logprobs), and
    the drafter's script."""
    target, _ = tiny_gemma4
    prompts = make_prompts(NUM_PROMPTS, seed=1)
    llm = make_llm(target)
    expected = plain_greedy_reference(llm, prompts, MAX_TOKENS)
    shutdown(llm)
    ScriptedTreeDrafter.script = DraftScript(
        references=[p + e for p, e in zip(prompts, expected.tokens)],
        prompt_lens=[len(p) for p in prompts],
        vocab_size=VOCAB_SIZE,
    )
    return prompts, expected


def run_tree(target, shape: dict, prompts, **engine_options):
    llm = make_llm(target, {**host_drafter(DRAFTER), **shape}, **engine_options)
    try:
        got = generate(llm, prompts)
        counters = spec_decode_counters(llm)
        extra = {m.name: m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"}
    finally:
        shutdown(llm)
    record_coverage(counters)
    return got, counters, extra


def record_coverage(counters: dict) -> None:
    per_depth = counters["num_accepted_tokens_per_pos"]
    COVERAGE["accepted"] += counters["num_accepted_tokens"]
    COVERAGE["rescued"] += sum(counters.get("num_rescued_tokens_per_pos", []))
    COVERAGE["max_depth"] = max(
        COVERAGE["max_depth"], max((d + 1 for d, n in enumerate(per_depth) if n), default=0)
    )


@pytest.mark.parametrize("batch_size", [1, 12])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_is_token_identical_to_plain_greedy(tiny_gemma4, reference, shape, batch_size):
    prompts, expected = reference
    got, counters, _ = run_tree(tiny_gemma4[0], SHAPES[shape], prompts, max_num_seqs=batch_size)
    assert_greedy_identical(got, expected)
    assert counters["num_accepted_tokens"] > 0
    if shape != "chain":
        assert sum(counters["num_rescued_tokens_per_pos"]) > 0


def test_chain_shaped_tree_accepts_exactly_what_chain_mode_accepts(tiny_gemma4, reference):
    prompts, expected = reference
    target = tiny_gemma4[0]
    tree_tokens, tree_counters, _ = run_tree(target, SHAPES["chain"], prompts)
    llm = make_llm(target, {**host_drafter(DRAFTER), "num_speculative_tokens": 3})
    try:
        chain_tokens = generate(llm, prompts)
        chain_counters = spec_decode_counters(llm)
    finally:
        shutdown(llm)
    assert_greedy_identical(chain_tokens, expected, "chain mode")
    assert_greedy_identical(tree_tokens, expected, "chain-shaped tree")
    # The scripted drafter drafts from the context alone, so equal outputs
    # mean equal drafts at every step: the walk must then count exactly what
    # chain acceptance counts. (Outputs can only differ by a tie flip in one
    # of the runs, allowed above; then the two runs drafted different tokens.)
    if tree_tokens == chain_tokens:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "num_accepted_tokens_per_pos"):
            assert tree_counters[name] == chain_counters[name], name
    assert sum(tree_counters["num_rescued_tokens_per_pos"]) == 0


def test_chunked_prefill_mixes_prefill_chunks_with_tree_rows(tiny_gemma4, reference):
    prompts, expected = reference
    # A token budget far below the prompt lengths: prompts arrive in chunks in
    # the same steps as other requests' tree rows, and some steps truncate the
    # tree to a breadth-first prefix.
    got, counters, _ = run_tree(
        tiny_gemma4[0], SHAPES["continuations"], prompts,
        enable_chunked_prefill=True, max_num_batched_tokens=48,
    )
    assert_greedy_identical(got, expected)
    assert sum(counters["num_rescued_tokens_per_pos"]) > 0


def test_prefix_cache_hits_give_the_same_tokens(tiny_gemma4, reference):
    prompts, expected = reference
    llm = make_llm(tiny_gemma4[0], {**host_drafter(DRAFTER), **SHAPES["leaf_siblings_k3_w4"]},
                   enable_prefix_caching=True, block_size=32)
    try:
        first = generate(llm, prompts)
        # Each finished request's prompt plus 8 of its tokens, again: the
        # full blocks it left, written by tree steps (with moved accepted-path
        # KV), are now served from the prefix cache.
        resumed = generate(llm, [p + e[:8] for p, e in zip(prompts, expected.tokens)],
                           max_tokens=MAX_TOKENS - 8)
        hits = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}.get(
            "vllm:prefix_cache_hits"
        )
        counters = spec_decode_counters(llm)
    finally:
        shutdown(llm)
    record_coverage(counters)
    assert_greedy_identical(first, expected)
    assert_greedy_identical(resumed, expected.suffix(8), "resumed from the prefix cache")
    assert hits and hits > 0


def test_preemption_and_recompute_give_the_same_tokens(tiny_gemma4, reference):
    prompts, expected = reference
    got, counters, extra = run_tree(
        tiny_gemma4[0], SHAPES["leaf_siblings_k3_w4"], prompts,
        kv_cache_memory_bytes=1 << 20, block_size=32, max_model_len=160,
    )
    assert_greedy_identical(got, expected)
    assert extra.get("vllm:num_preemptions", 0) > 0


def test_requests_a_tree_cannot_verify_are_decoded_without_drafts(tiny_gemma4, reference):
    """Penalties, logit_bias, min_p and structured outputs fall back to zero
    drafts (a plain decode inside the same batches), counted by
    vllm:spec_decode_num_tree_fallback_requests, and decode as plain decoding
    with the same parameters does."""
    from vllm.sampling_params import StructuredOutputsParams

    prompts, expected = reference
    penalized = {"repetition_penalty": 1.3}
    biased = {"logit_bias": {100: 3.0, 200: 2.0}}
    plain = make_llm(tiny_gemma4[0])
    try:
        penalized_expected = plain_greedy_reference(plain, prompts[:8], MAX_TOKENS,
                                                    **penalized)
        biased_expected = plain_greedy_reference(plain, prompts[8:12], MAX_TOKENS, **biased)
    finally:
        shutdown(plain)

    llm = make_llm(tiny_gemma4[0], {**host_drafter(DRAFTER), **SHAPES["leaf_siblings_k3_w4"]})
    try:
        (digits,) = generate(llm, prompts[:1],
                             structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
        (min_p_sample,) = generate(llm, prompts[:1], temperature=0.8, min_p=0.1)
        penalized_got = generate(llm, prompts[:8], **penalized)
        biased_got = generate(llm, prompts[8:12], **biased)
        greedy_got = generate(llm, prompts[:8])
        fallbacks = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}.get(
            "vllm:spec_decode_num_tree_fallback_requests"
        )
    finally:
        shutdown(llm)
    assert digits and len(min_p_sample) == MAX_TOKENS
    assert_greedy_identical(penalized_got, penalized_expected, "repetition_penalty fallback")
    assert_greedy_identical(biased_got, biased_expected, "logit_bias fallback")
    assert_greedy_identical(greedy_got, expected[:8])
    assert fallbacks == 1 + 1 + 8 + 4


@pytest.mark.parametrize("speculative, engine_options, match", [
    ({**host_drafter(DRAFTER), "speculative_token_tree": "[(1,)]"}, {},
     "speculative_token_tree"),
    ({**host_drafter(DRAFTER), "speculative_token_tree": "[(0,), (0, 0)]",
      "num_speculative_tokens": 3}, {}, "num_speculative_tokens"),
    ({**host_drafter(DRAFTER), "num_speculative_tokens": 9, "tree_width": 4}, {}, "tree_width"),
    # A drafter whose drafts are chains.
    ({"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 2,
      "tree_width": 2}, {}, "method='ngram'"),
    # The accepted-path KV commit runs on the sampling rank only.
    ({**host_drafter(DRAFTER), **SHAPES["leaf_siblings_k3_w4"]},
     {"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
], ids=["bad-tree", "node-count", "too-many-nodes", "chain-drafter", "pipeline-parallel"])
def test_bad_tree_config_fails_at_engine_start(tiny_gemma4, speculative, engine_options,
                                                match):
    with pytest.raises(Exception, match=match):
        make_llm(tiny_gemma4[0], speculative, **engine_options)


def test_identity_check_fails_a_verify_with_flat_positions(
    tiny_gemma4, reference, monkeypatch
):
    """Negative control: the tree's position offsets (host and device), which
    the CPU tree attention measures sliding windows from, made flat (node t at
    root + t + 1 instead of root + depth: the window measured from the flat
    index, as in SGLang #39160) must fail the tie-aware check, with margins
    far above the tie tolerance."""
    import torch
    from vllm.v1.attention.spec_tree import SpecTokenTree

    prompts, expected = reference
    build_tree = SpecTokenTree.__init__

    def build_tree_with_flat_positions(tree, *args, **kwargs):
        build_tree(tree, *args, **kwargs)
        tree.position_offsets_cpu = torch.arange(tree.num_nodes + 1)
        tree.position_offsets = tree.position_offsets_cpu.to(tree.position_offsets.device)

    monkeypatch.setattr(SpecTokenTree, "__init__", build_tree_with_flat_positions)
    llm = make_llm(tiny_gemma4[0], {**host_drafter(DRAFTER), **SHAPES["leaf_siblings_k3_w4"]})
    try:
        got = generate(llm, prompts)
    finally:
        shutdown(llm)
    report = compare_with_plain_greedy(
        got, expected, "negative control: flat positions (must fail)"
    )
    print(report.failure_message())
    assert not report.ok
    assert len(report.mismatches) >= 3
    assert min(d.margin for d in report.mismatches) > 100 * TIE_MARGIN_NATS


def test_walk_really_accepted_deep_paths_and_rescues():
    """Identity must not come from rejecting everything: across this module's
    runs the engine accepted tokens at depth >= 3 and rescued siblings."""
    if not COVERAGE["accepted"]:
        pytest.skip("run with the tree tests of this module")
    print(f"tree coverage: {dict(COVERAGE)}")
    assert COVERAGE["max_depth"] >= 3
    assert COVERAGE["rescued"] > 0
