# SPDX-License-Identifier: Apache-2.0
"""Requests users send, decoded in tree mode and by plain decoding on the
trained pair, compared kind by kind:

- logprobs (top 5) and prompt_logprobs (top 3): the same tokens, values
  within LOGPROB_TOLERANCE nats;
- stop strings and stop tokens that fall inside an accepted path, with
  `ignore_eos=False`: the same text, tokens, finish and stop reasons;
- a request that reaches max_model_len in the middle of a tree;
- n=2 (sampled; vLLM refuses n > 1 greedy): two distinct choices per
  request, indexed 0 and 1, reproduced by their seed;
- structured outputs (JSON schema, regex): valid, and greedy equal to plain's.

Greedy tokens are compared tie-aware (identity.py). The Gemma 4 MTP tree
(K=3, W=4) decodes every kind; a scripted drafter that drafts the plain
continuation on the spine (every draft accepted, 4 tokens a step) puts each
stop and each max_model_len limit at a chosen place of an accepted path."""

from __future__ import annotations

from collections import Counter

import pytest

from .host_drafter import host_drafter
from .conftest import make_llm, shutdown, spec_decode_counters
from .identity import GreedyReference, StepTop2, assert_greedy_identical
from .request_kinds import (
    JSON_SCHEMA,
    LOGPROB_TOLERANCE,
    REGEX,
    STRUCTURED_OUTPUTS_CONFIG,
    check_structured_output,
    common_prefix_len,
    logprob_difference,
    pick_stops,
)
from .scripted_drafter import DraftScript, ScriptedTreeDrafter
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

# Model Runner V2 runs its kernels in Triton's interpreter here: few prompts.
NUM_PROMPTS = 8
# Prompts that end 1, 2, ... tokens before max_model_len: at least a step's.
NUM_LONG = 4
NUM_N2 = 4
MAX_TOKENS = 24
NUM_LOGPROBS = 5
NUM_PROMPT_LOGPROBS = 3
MAX_MODEL_LEN = 512
# The scripted tree: 3 deep, so a step emits 3 accepted drafts and a bonus.
SCRIPTED_TREE = {"num_speculative_tokens": 3, "tree_width": 4}
STEP_TOKENS = 4
DRAFTER = "tests.engine.scripted_drafter.ScriptedTreeDrafter"


def mtp_tree() -> dict:
    _, assistant = trained_pair()
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3,
            "tree_width": 4}


def token_prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


class Requests:
    """Every request of this module, built once from plain greedy decoding,
    so that each engine is sent exactly the same ones."""

    def __init__(self, llm) -> None:
        from vllm import SamplingParams

        tokenizer = llm.get_tokenizer()
        self.text_prompts = text_prompts(NUM_PROMPTS)
        self.token_prompts = [tokenizer(p).input_ids for p in self.text_prompts]
        continuations = [
            list(o.outputs[0].token_ids)
            for o in llm.generate(
                [token_prompt(p) for p in self.token_prompts],
                SamplingParams(temperature=0.0, max_tokens=2 * MAX_TOKENS,
                               ignore_eos=True),
                use_tqdm=False,
            )
        ]
        # (prompt, output index of the stop, stop_token_ids or stop).
        self.stops = [
            (prompt, *stop)
            for prompt, continuation in enumerate(continuations)
            for stop in pick_stops(tokenizer, continuation, STEP_TOKENS)
        ]
        # Other files than the short prompts': the scripted drafter finds a
        # request's script by its prompt.
        long_text = text_prompts(NUM_PROMPTS + NUM_LONG, length=2400)[NUM_PROMPTS:]
        # 1 to NUM_LONG tokens left before max_model_len: the limit falls on
        # every place of a scripted step.
        self.long_prompts = [
            tokenizer(text).input_ids[: MAX_MODEL_LEN - left]
            for left, text in enumerate(long_text, start=1)
        ]
        long_continuations = [
            list(o.outputs[0].token_ids)
            for o in llm.generate([token_prompt(p) for p in self.long_prompts],
                                  SamplingParams(temperature=0.0, max_tokens=64),
                                  use_tqdm=False)
        ]
        self.script = DraftScript(
            references=[p + c for p, c in zip(self.token_prompts + self.long_prompts,
                                               continuations + long_continuations)],
            prompt_lens=[len(p) for p in self.token_prompts + self.long_prompts],
            strategies=("all_right",),
        )

    def stop_prompts(self):
        return [token_prompt(self.token_prompts[prompt]) for prompt, _, _ in self.stops]

    def stop_params(self):
        from vllm import SamplingParams

        return [
            SamplingParams(temperature=0.0, max_tokens=2 * MAX_TOKENS, ignore_eos=False,
                           **stop)
            for _, _, stop in self.stops
        ]


def run_requests(llm, requests: Requests, scripted: bool) -> dict:
    """Each kind of request, in its own generate call."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    results = {}
    results["stop"] = llm.generate(requests.stop_prompts(), requests.stop_params(),
                                   use_tqdm=False)
    results["max_model_len"] = llm.generate(
        [token_prompt(p) for p in requests.long_prompts],
        SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    if scripted:
        return results
    results["logprobs"] = llm.generate(
        requests.text_prompts,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                       logprobs=NUM_LOGPROBS, prompt_logprobs=NUM_PROMPT_LOGPROBS),
        use_tqdm=False)
    results["json"] = llm.generate(
        requests.text_prompts[: NUM_PROMPTS // 2],
        SamplingParams(temperature=0.0, max_tokens=48, logprobs=2,
                       structured_outputs=StructuredOutputsParams(json=JSON_SCHEMA)),
        use_tqdm=False)
    results["regex"] = llm.generate(
        requests.text_prompts[NUM_PROMPTS // 2 :],
        SamplingParams(temperature=0.0, max_tokens=48, logprobs=2,
                       structured_outputs=StructuredOutputsParams(regex=REGEX)),
        use_tqdm=False)
    sampled = [SamplingParams(n=2, temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS,
                              ignore_eos=True) for i in range(NUM_N2)]
    results["n2_sampled"] = llm.generate(requests.text_prompts[:NUM_N2], sampled,
                                         use_tqdm=False)
    results["n2_sampled_again"] = llm.generate(requests.text_prompts[:NUM_N2], sampled,
                                               use_tqdm=False)
    return results


@pytest.fixture(scope="module")
def runs() -> dict:
    target, _ = trained_pair()
    llm = make_llm(target, structured_outputs_config=STRUCTURED_OUTPUTS_CONFIG)
    try:
        requests = Requests(llm)
        runs = {"plain": run_requests(llm, requests, scripted=False)}
    finally:
        shutdown(llm)
    for name, speculative in (("tree", mtp_tree()),
                              ("scripted", {**host_drafter(DRAFTER), **SCRIPTED_TREE})):
        ScriptedTreeDrafter.script = requests.script
        llm = make_llm(target, speculative,
                       structured_outputs_config=STRUCTURED_OUTPUTS_CONFIG)
        try:
            runs[name] = run_requests(llm, requests, scripted=name == "scripted")
            runs[name]["counters"] = spec_decode_counters(llm)
        finally:
            shutdown(llm)
    runs["requests"] = requests
    return runs


def reference_of(outputs) -> GreedyReference:
    """Plain greedy tokens and top-2 logprobs of generate() outputs."""
    completions = [c for o in outputs for c in o.outputs]
    return GreedyReference(
        tokens=[list(c.token_ids) for c in completions],
        top2=[[StepTop2.from_logprobs(step) for step in c.logprobs] for c in completions],
    )


def tokens_of(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


@pytest.mark.parametrize("engine", ["tree"])
def test_logprobs_and_prompt_logprobs_equal_plain(runs, engine):
    plain, tree = runs["plain"]["logprobs"], runs[engine]["logprobs"]
    report = assert_greedy_identical(tokens_of(tree), reference_of(plain),
                                     "logprobs=5 requests, MTP tree K=3 W=4")
    largest, differing = 0.0, []
    largest_prompt, differing_prompt = 0.0, []
    for p, t in zip(plain, tree):
        steps = common_prefix_len(p.outputs[0].token_ids, t.outputs[0].token_ids)
        d, bad = logprob_difference(values(p.outputs[0].logprobs[:steps]),
                                    values(t.outputs[0].logprobs[:steps]))
        largest, differing = max(largest, d), differing + bad
        d, bad = logprob_difference(values(p.prompt_logprobs), values(t.prompt_logprobs))
        largest_prompt, differing_prompt = max(largest_prompt, d), differing_prompt + bad
    counters = runs[engine]["counters"]
    print(f"logprobs: {report.num_tokens_compared} tokens, largest difference "
          f"{largest:.3g} nats; prompt_logprobs: largest difference "
          f"{largest_prompt:.3g} nats; tree accepted {counters['num_accepted_tokens']}, "
          f"rescued {sum(counters['num_rescued_tokens_per_pos'])}")
    assert not differing and not differing_prompt, differing + differing_prompt
    assert largest <= LOGPROB_TOLERANCE and largest_prompt <= LOGPROB_TOLERANCE
    # Logprobs of accepted drafts and rescued siblings were returned.
    assert counters["num_accepted_tokens"] > 0
    assert sum(counters["num_rescued_tokens_per_pos"]) > 0


def values(steps) -> list[dict | None]:
    """vLLM's per-step logprobs as token id -> logprob."""
    return [None if step is None else {t: lp.logprob for t, lp in step.items()}
            for step in steps]


def same_completion(plain, tree) -> bool:
    a, b = plain.outputs[0], tree.outputs[0]
    return (list(a.token_ids), a.text, a.finish_reason, a.stop_reason) == (
        list(b.token_ids), b.text, b.finish_reason, b.stop_reason)


@pytest.mark.parametrize("engine", ["tree", "scripted"])
def test_stops_inside_an_accepted_path_end_where_plain_ends(runs, engine):
    requests: Requests = runs["requests"]
    plain, tree = runs["plain"]["stop"], runs[engine]["stop"]
    differing = [i for i, (p, t) in enumerate(zip(plain, tree)) if not same_completion(p, t)]
    assert not differing, [(plain[i].outputs[0].text, tree[i].outputs[0].text)
                           for i in differing]
    # Each stop ended the text at the chosen token, inside a scripted step.
    at_choice = sum(
        o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) == index + 1
        for o, (_, index, _) in zip(plain, requests.stops)
    )
    kinds = Counter(next(iter(stop)) for _, _, stop in requests.stops)
    print(f"{engine}: {len(plain)} stop requests ({dict(kinds)}) equal plain's, "
          f"{at_choice} stopped inside an accepted path of a scripted step")
    assert min(kinds.values()) >= NUM_PROMPTS // 2
    assert at_choice >= 0.9 * len(plain)
    if engine == "scripted":
        # Every scripted draft before the stop is accepted: each stop request
        # verified at least one whole path, which its stop then cut.
        assert runs[engine]["counters"]["num_accepted_tokens_per_pos"][-1] >= len(plain)


@pytest.mark.parametrize("engine", ["tree", "scripted"])
def test_max_model_len_reached_mid_tree_ends_as_plain(runs, engine):
    plain, tree = runs["plain"]["max_model_len"], runs[engine]["max_model_len"]
    for left, (p, t) in enumerate(zip(plain, tree), start=1):
        assert len(p.outputs[0].token_ids) == left
        assert p.outputs[0].finish_reason == "length"
        assert same_completion(p, t), (left, p.outputs[0], t.outputs[0])


def test_structured_outputs_are_valid_and_equal_plain(runs):
    for kind in ("json", "regex"):
        plain, tree = runs["plain"][kind], runs["tree"][kind]
        assert_greedy_identical(tokens_of(tree), reference_of(plain),
                                f"{kind} structured outputs, MTP tree K=3 W=4")
        for output in tree:
            check_structured_output(kind, output.outputs[0].text)


def test_n2_requests(runs):
    for name in ("plain", "tree"):
        outputs = runs[name]["n2_sampled"]
        assert all(sorted(c.index for c in o.outputs) == [0, 1] for o in outputs)
        distinct = sum(o.outputs[0].token_ids != o.outputs[1].token_ids for o in outputs)
        print(f"n=2 sampled, {name}: {distinct} of {len(outputs)} requests with two "
              "distinct choices")
        assert distinct == len(outputs)
        again = runs[name]["n2_sampled_again"]
        assert tokens_of(again) == tokens_of(outputs)
