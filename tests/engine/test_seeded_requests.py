# SPDX-License-Identifier: Apache-2.0
"""Seeded requests whose prompts are chunked are served in tree mode, and
give the text they give unchunked: Model Runner V2 keys a seeded request's
noise by its seed and the position it samples, so a partial prefill's
discarded sample moves nothing. Two ways users chunk a prompt: a step budget
below the prompt (`--max-num-batched-tokens 64`), and one `LLM.generate` of
more seeded prompt tokens than a step's budget (the last prompt of the batch
is split)."""

from __future__ import annotations

import pytest

from .conftest import make_llm, shutdown, spec_decode_counters
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

SAMPLING = {"temperature": 0.7, "max_tokens": 16}
SMALL_BUDGET = 64
# Model Runner V2 runs its kernels in Triton's interpreter here: a small
# batch over a small budget, and tree mode only (plain V2 has no stack code).
NUM_BATCHED = 12
BATCH_BUDGET = 1024
MODES = ["tree"]


def speculative_config(mode: str) -> dict | None:
    if mode == "plain":
        return None
    _, assistant = trained_pair()
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3,
            "tree_width": 4}


def seeded_generate(llm, prompts: list[str], first_seed: int = 7) -> list:
    from vllm import SamplingParams

    params = [SamplingParams(seed=first_seed + i, **SAMPLING) for i in range(len(prompts))]
    return [
        (len(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text)
        for o in llm.generate(prompts, params, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[str]]:
    return {
        # 250 to 400 tokens each: four or more chunks of SMALL_BUDGET.
        "long": text_prompts(4, length=700),
        # About 130 tokens each: NUM_BATCHED of them exceed BATCH_BUDGET.
        "batch": text_prompts(NUM_BATCHED, length=300),
    }


@pytest.mark.parametrize("mode", MODES)
def test_seeded_chunked_prompts_give_the_unchunked_text(prompts, mode):
    target, _ = trained_pair()
    speculative = speculative_config(mode)
    results, counters = {}, {}
    for name, budget in (("whole", 8192), ("small budget", SMALL_BUDGET),
                         ("batch budget", BATCH_BUDGET)):
        llm = make_llm(target, speculative, enable_chunked_prefill=True,
                       max_num_batched_tokens=budget)
        try:
            if name != "batch budget":
                results[name, "long"] = seeded_generate(llm, prompts["long"])
            if name != "small budget":
                results[name, "batch"] = seeded_generate(llm, prompts["batch"])
            # The engine keeps serving after its chunked seeded requests.
            results[name, "after"] = seeded_generate(llm, prompts["long"][:1], 99)
            counters[name] = spec_decode_counters(llm)
        finally:
            shutdown(llm)

    long_lens = [n for n, _, _ in results["whole", "long"]]
    batch_lens = [n for n, _, _ in results["whole", "batch"]]
    print(f"{mode}: long prompts of {long_lens} tokens (budget {SMALL_BUDGET}); "
          f"{NUM_BATCHED} prompts of {min(batch_lens)}-{max(batch_lens)} tokens, "
          f"{sum(batch_lens)} in all (budget {BATCH_BUDGET})")
    assert min(long_lens) > 3 * SMALL_BUDGET
    assert sum(batch_lens) > BATCH_BUDGET
    for kind, chunked in (("long", "small budget"), ("batch", "batch budget")):
        whole = results["whole", kind]
        got = results[chunked, kind]
        differing = [i for i, (a, b) in enumerate(zip(whole, got)) if a != b]
        assert not differing, f"{mode}, {chunked}: prompts {differing} differ"
        assert all(len(tokens) == SAMPLING["max_tokens"] for _, tokens, _ in got)
    for name in ("small budget", "batch budget"):
        assert results[name, "after"] == results["whole", "after"]
    if mode == "tree":
        assert all(c["num_accepted_tokens"] > 0 for c in counters.values())
