# SPDX-License-Identifier: Apache-2.0
"""Seeded sampling in tree mode depends on the seed and the model only.

A tree-mode engine samples every random row with noise keyed by the
request's seed and the position the row samples, siblings sharing their
depth's (tests/engine/keyed_sampling.py), so the same seeded requests must
give the same text (tie-aware) across:
- the same requests decoded without drafts, by Model Runner V2 without
  speculation, whose keys tree mode shares;
- a chain-shaped tree, K=3 W=4, a 12-node continuation tree (Gemma 4 MTP)
  and the draft_model drafter's tree;
- a batch of mixed requests (two sampling set-ups, greedy, unseeded and
  fallback requests) and requests alone;
- preemption and recompute.
The negative control keys the noise by verify row instead of depth, which
must break drafter invariance on a branching tree.
"""

from __future__ import annotations

import pytest

from .conftest import make_llm, shutdown, spec_decode_counters
from .keyed_sampling import (
    ScoreOracle,
    SeededRequest,
    assert_seeded_identical,
    compare_seeded,
)
from .test_mtp_tree import CONTINUATION_12
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

# Model Runner V2 runs its kernels in Triton's interpreter here: few requests.
NUM_REQUESTS = 16
NUM_ALONE = 2
MAX_TOKENS = 24
# T 0.8 / top-p 0.9, and Gemma 4's generation defaults (T 1.0, top-k 64,
# top-p 0.95).
SAMPLINGS = [
    {"temperature": 0.8, "top_k": 0, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 64, "top_p": 0.95},
]
NO_DRAFTS = {"logit_bias": {0: 0.0}}


def batch(mixed: bool) -> list[tuple[SeededRequest, dict]]:
    """NUM_REQUESTS requests: per 8, three of each sampling set-up, one greedy and one
    unseeded (load only, never compared). With `mixed`, every eighth request
    is a zero-draft fallback inside the tree's batches."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_pair()[0])
    requests = []
    for i, text in enumerate(text_prompts(NUM_REQUESTS, length=200)):
        prompt = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False).input_ids]
        kind = i % 8
        if kind < 6:
            sampling, seed = SAMPLINGS[kind % 2], 1000 + i
        elif kind == 6:
            sampling, seed = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, None
        else:
            sampling, seed = SAMPLINGS[0], None
        extra = NO_DRAFTS if mixed and kind == 5 else {}
        requests.append((SeededRequest(prompt, seed=seed, **sampling), extra))
    return requests


def generate(llm, requests: list[tuple[SeededRequest, dict]], extra: dict | None = None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=r.seed,
                       max_tokens=MAX_TOKENS, ignore_eos=True, **(extra or own))
        for r, own in requests
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_token_ids)
                            for r, _ in requests], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def compared(requests, tokens):
    """The requests whose text a seed fixes, and their tokens."""
    kept = [i for i, (r, _) in enumerate(requests) if r.seed is not None or r.temperature == 0]
    return [requests[i][0] for i in kept], [tokens[i] for i in kept]


def engine(speculative: dict | None, **options):
    target, _ = trained_pair()
    return make_llm(target, speculative, max_logprobs=-1, **options)


def mtp(**tree) -> dict:
    """Gemma 4 MTP: K=3 with `tree_width`, or drafting `speculative_token_tree`."""
    _, assistant = trained_pair()
    size = {} if "speculative_token_tree" in tree else {"num_speculative_tokens": 3}
    return {"method": "mtp", "model": str(assistant), **size, **tree}


def draft_model_tree() -> tuple[dict, dict]:
    target, _ = trained_pair()
    return ({"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
             "tree_width": 3}, {"disable_hybrid_kv_cache_manager": True})


DRAFTERS = {
    "chain_shaped_tree": lambda: (mtp(speculative_token_tree="[(0,), (0, 0), (0, 0, 0)]"), {}),
    "k3_w4": lambda: (mtp(tree_width=4), {}),
    "continuation_12": lambda: (mtp(speculative_token_tree=str(CONTINUATION_12)), {}),
    "draft_model_tree": draft_model_tree,
}


@pytest.fixture(scope="module")
def reference():
    """The batch decoded without drafts: by Model Runner V2 without
    speculation, whose keys a tree shares."""
    requests = batch(mixed=False)
    llm = engine(None)
    try:
        return compared(requests, generate(llm, requests))
    finally:
        shutdown(llm)


def run(llm, label: str, reference) -> dict:
    """The mixed batch at once and its first requests alone, compared with
    the reference; returns the engine's counters."""
    requests = batch(mixed=True)
    together = generate(llm, requests)
    alone = [generate(llm, [request])[0] for request in requests[:NUM_ALONE]]
    expected_requests, expected = reference
    oracle = ScoreOracle(llm)
    got_requests, got = compared(requests, together)
    assert_seeded_identical(got, expected, got_requests, oracle,
                            f"{label}, batch of {NUM_REQUESTS}")
    alone_requests, alone_tokens = compared(requests[:NUM_ALONE], alone)
    assert_seeded_identical(alone_tokens, expected[:len(alone_tokens)], alone_requests,
                            oracle, f"{label}, alone")
    return spec_decode_counters(llm)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_seeded_text_does_not_depend_on_the_drafter(reference, drafter):
    speculative, options = DRAFTERS[drafter]()
    llm = engine(speculative, **options)
    try:
        counters = run(llm, drafter, reference)
    finally:
        shutdown(llm)
    print(f"{drafter}: {counters['num_accepted_tokens']} drafts accepted of "
          f"{counters['num_draft_tokens']}, rescued per depth "
          f"{counters['num_rescued_tokens_per_pos']}, "
          f"{counters['num_tree_fallback_requests']} fallback requests")
    # Drafts were verified and accepted, beyond the first node at a depth
    # where the tree branches.
    assert counters["num_accepted_tokens"] > 0
    if drafter != "chain_shaped_tree":
        assert sum(counters["num_rescued_tokens_per_pos"]) > 0
    assert counters["num_tree_fallback_requests"] > 0


def test_seeded_text_survives_preemption(reference):
    llm = engine(mtp(tree_width=4), kv_cache_memory_bytes=1 << 20, block_size=32)
    try:
        run(llm, "k3_w4, preempted", reference)
        preemptions = sum(m.value for m in llm.get_metrics()
                          if m.name == "vllm:num_preemptions")
    finally:
        shutdown(llm)
    print(f"k3_w4 with 1 MiB of KV cache: {preemptions:.0f} preemptions")
    assert preemptions > 0


def key_noise_by_row(monkeypatch) -> None:
    """Noise keyed by each verify row's flat index instead of its depth."""
    import torch

    from vllm.v1.worker.gpu.spec_decode.tree import rejection_sampler

    gumbel_sample = rejection_sampler.gumbel_sample

    def by_row(logits, expanded_idx_mapping, temperature, seeds, pos, **kwargs):
        # Rows of a request are consecutive: its root's position plus the
        # row's index among them.
        rows = torch.arange(pos.shape[0])
        starts = torch.ones_like(rows, dtype=torch.bool)
        starts[1:] = expanded_idx_mapping[1:] != expanded_idx_mapping[:-1]
        first_row = torch.cummax(torch.where(starts, rows, 0), dim=0).values
        flat = pos[first_row] + rows - first_row
        return gumbel_sample(logits, expanded_idx_mapping, temperature, seeds, flat,
                             **kwargs)

    monkeypatch.setattr(rejection_sampler, "gumbel_sample", by_row)


def test_negative_control_noise_keyed_by_row(reference, monkeypatch):
    """Noise keyed by (seed, position + verify row) instead of the row's
    depth: siblings draw other noise than the decode without drafts, so
    accepted branches change the text."""
    key_noise_by_row(monkeypatch)
    llm = engine(mtp(tree_width=4))
    try:
        requests = batch(mixed=True)
        tokens = generate(llm, requests)
        expected_requests, expected = reference
        got_requests, got = compared(requests, tokens)
        report = compare_seeded(got, expected, got_requests, ScoreOracle(llm),
                                "negative control: noise keyed by row (must fail)")
    finally:
        shutdown(llm)
    print(report.summary())
    assert len(report.mismatches) >= NUM_REQUESTS // 4, report.summary()
