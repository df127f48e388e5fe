# SPDX-License-Identifier: Apache-2.0
"""Tensor parallel 2 in tree mode, on this CPU (two workers, one core each).

Every rank verifies the tree, walks it and moves the accepted path's KV in
its own shard of the KV cache, from its own copy of the logits and of the
noise: the ranks must agree on every step's accepted nodes. Greedy output
equals plain greedy decoding at TP=1 (tie-aware), and seeded sampled output
equals plain seeded decoding at TP=1 token for token (Model Runner V2 keys a
sample's noise by the request's seed and the position, which every rank
shares)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .conftest import (
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from .identity import assert_greedy_identical
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_PROMPTS = 16
MAX_TOKENS = 24
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 4, "max_tokens": 8,
            "ignore_eos": True}
NUM_SEEDED = 16


def sample(llm, prompts: list[str]) -> list[list[int]]:
    """Seeded samples of `prompts`, one seed each."""
    from vllm import SamplingParams

    params = [SamplingParams(seed=1000 + i, **SAMPLING) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def engine(speculative: dict | None, **options):
    target, _ = trained_pair()
    return make_llm(target, speculative, max_num_seqs=32, max_num_batched_tokens=8192,
                    **options)


def test_tree_at_tensor_parallel_2(monkeypatch):
    # One NUMA node here: each CPU worker gets one core.
    monkeypatch.setitem(os.environ, "VLLM_CPU_OMP_THREADS_BIND", "0|1")
    # The workers run Model Runner V2 as this process does
    # (model_runner_v2_site/sitecustomize.py).
    site = Path(__file__).with_name("model_runner_v2_site")
    root = Path(__file__).resolve().parents[2]
    monkeypatch.setitem(os.environ, "PYTHONPATH", os.pathsep.join(
        filter(None, [str(site), str(root), os.environ.get("PYTHONPATH")])))
    _, assistant = trained_pair()
    prompts = text_prompts(NUM_PROMPTS)
    seeded_prompts = [p[-80:] for p in text_prompts(NUM_SEEDED)]

    llm = engine(None)
    try:
        expected = plain_greedy_reference(llm, prompts, MAX_TOKENS)
        plain_samples = sample(llm, seeded_prompts)
    finally:
        shutdown(llm)

    tree = {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3,
            "tree_width": 4}
    llm = engine(tree, tensor_parallel_size=2)
    try:
        got = greedy_generate(llm, prompts, MAX_TOKENS)
        tree_samples = sample(llm, seeded_prompts)
        counters = spec_decode_counters(llm)
    finally:
        shutdown(llm)

    assert_greedy_identical(got, expected, "MTP tree K=3 W=4 at TP=2 vs plain at TP=1")
    print(f"TP=2 tree vs TP=1 plain: {NUM_SEEDED} seeded requests, accepted "
          f"{counters['num_accepted_tokens']}, rescued "
          f"{sum(counters['num_rescued_tokens_per_pos'])}")
    assert tree_samples == plain_samples
    assert counters["num_accepted_tokens"] > 0
    assert sum(counters["num_rescued_tokens_per_pos"]) > 0
