# SPDX-License-Identifier: Apache-2.0
"""Upstream `vllm serve`, unchanged, from the installed patched wheel: a token
tree in --speculative-config serves concurrent completions that equal the same
server without speculation (tie-aware, tests/engine/identity.py: the plain
server's own top-2 logprobs decide a tie), serves ordinary sampled, structured
and penalized requests beside them, and exports the tree metrics."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

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
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

# Model Runner V2 runs its kernels in Triton's interpreter here: few requests.
NUM_REQUESTS = 16
MAX_TOKENS = 24
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` on loopback, shut down with SIGINT like a user would."""

    def __init__(self, model: Path, speculative_config: dict | None, log: Path,
                 extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        command = [
            str(Path(sys.executable).with_name("vllm")), "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
            "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0", *extra_args,
        ]
        if speculative_config:
            command += ["--speculative-config", json.dumps(speculative_config)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # The server and its engine process run Model Runner V2 as this
        # process does (model_runner_v2_site/sitecustomize.py).
        site = Path(__file__).with_name("model_runner_v2_site")
        root = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), str(root), env.get("PYTHONPATH")]))
        self.log = log
        self.process = subprocess.Popen(command, env=env, stdout=log.open("w"),
                                         stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"vllm serve not ready: {self.log.read_text()[-3000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        assert self.process.returncode is not None


def complete_concurrently(
    url: str, model: Path, prompts: list[str], logprobs: int | None = None
) -> list:
    """One completion choice per prompt, all requests in flight at once, with
    the generated token ids (and top logprobs keyed by token id if asked)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)

    def complete(prompt: str):
        response = client.completions.create(
            model=str(model), prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            logprobs=logprobs,
            extra_body={"ignore_eos": True, "return_token_ids": True,
                        "return_tokens_as_token_ids": True},
        )
        return response.choices[0]

    with concurrent.futures.ThreadPoolExecutor(max_workers=NUM_REQUESTS) as pool:
        return list(pool.map(complete, prompts))


# Ordinary client requests beside the greedy ones: (name, create() arguments).
ORDINARY_REQUESTS = [
    # The server applies temperature 1.0 when the client leaves it out.
    ("default sampling", {}),
    ("Gemma 4 defaults", {"temperature": 1.0, "top_p": 0.95,
                          "extra_body": {"top_k": 64}}),
    ("JSON schema", {"temperature": 0.0, "extra_body": {"structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a"]}}}}),
    ("penalties", {"frequency_penalty": 0.5, "presence_penalty": 0.3}),
]
# Of those, the ones a tree cannot verify: decoded without drafts.
NUM_FALLBACK_REQUESTS = 2


def complete_ordinary(url: str, model: Path, prompt: str) -> dict[str, int]:
    """HTTP status of each ordinary request, sent concurrently."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300,
                           max_retries=0)

    def complete(arguments: dict) -> int:
        try:
            client.completions.with_raw_response.create(
                model=str(model), prompt=prompt, max_tokens=MAX_TOKENS, **arguments
            )
            return 200
        except openai.APIStatusError as error:
            return error.status_code

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(ORDINARY_REQUESTS)) as pool:
        statuses = pool.map(complete, [arguments for _, arguments in ORDINARY_REQUESTS])
        return {name: status for (name, _), status in zip(ORDINARY_REQUESTS, statuses)}


def serve_and_complete(model, speculative_config, prompts, log, logprobs=None,
                       ordinary_prompt=None):
    server = Server(model, speculative_config, log)
    try:
        server.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            greedy = pool.submit(complete_concurrently, server.url, model, prompts, logprobs)
            ordinary = (pool.submit(complete_ordinary, server.url, model, ordinary_prompt)
                        if ordinary_prompt else None)
            choices = greedy.result()
            statuses = ordinary.result() if ordinary else {}
        metrics = server.metrics()
    finally:
        server.stop()
    return choices, metrics, statuses


def token_ids(choice) -> list[int]:
    return list(choice.token_ids)


def plain_reference(choices) -> GreedyReference:
    """The plain server's tokens and top-2 logprobs ("token_id:N" keys)."""
    return GreedyReference(
        tokens=[token_ids(c) for c in choices],
        top2=[
            [
                StepTop2.from_logprobs(
                    {int(k.removeprefix("token_id:")): v for k, v in step.items()}
                )
                for step in c.logprobs.top_logprobs
            ]
            for c in choices
        ],
    )


def counter_total(metrics: str, name: str) -> float:
    """The sum of a sample (e.g. a counter's `..._total`) over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(metrics)
               for sample in family.samples if sample.name == name)


def test_vllm_serve_with_a_token_tree(tmp_path):
    target, assistant = trained_pair()
    prompts = text_prompts(NUM_REQUESTS)
    tree_config = {"method": "mtp", "model": str(assistant),
                   "num_speculative_tokens": 3, "tree_width": 4}

    tree_choices, metrics, statuses = serve_and_complete(
        target, tree_config, prompts, tmp_path / "tree.log", ordinary_prompt=prompts[0]
    )
    plain_choices, _, _ = serve_and_complete(target, None, prompts,
                                             tmp_path / "plain.log", logprobs=2)

    # Every ordinary request is served, concurrently with the greedy ones.
    assert statuses == {name: 200 for name, _ in ORDINARY_REQUESTS}
    assert counter_total(metrics, "vllm:spec_decode_num_tree_fallback_requests_total") == (
        NUM_FALLBACK_REQUESTS
    )
    assert all(c.text for c in tree_choices)
    assert_greedy_identical([token_ids(c) for c in tree_choices],
                            plain_reference(plain_choices), "vllm serve, MTP tree K=3 W=4")
    for name in ("vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:spec_decode_num_rescued_tokens_per_pos_total"):
        assert name in metrics, name
    assert counter_total(metrics, "vllm:spec_decode_num_drafts_total") > 0
    assert counter_total(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0
    # The server ran the tests' Model Runner V2 set-up, with async scheduling.
    log = (tmp_path / "tree.log").read_text()
    assert "tests/engine/model_runner_v2.py: async_scheduling=True" in log


# Both servers of the request-kind test: a step budget far below the long
# prompts (their prefills are chunked), and JSON without free whitespace.
KINDS_SERVER_ARGS = (
    "--enable-chunked-prefill", "--max-num-batched-tokens", "64",
    "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG),
)
SEEDED = {"temperature": 0.7, "seed": 7, "max_tokens": 16}
TOKEN_IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True}


def send_all(url: str, model: Path, requests: dict[str, list[dict]]) -> dict[str, list]:
    """Every request at once; per kind, each response's choices (or the HTTP
    status of a failed request)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300,
                           max_retries=0)

    def send(arguments: dict):
        try:
            return client.completions.create(model=str(model), **arguments).choices
        except openai.APIStatusError as error:
            return error.status_code

    flat = [(kind, arguments) for kind, batch in requests.items() for arguments in batch]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(flat)) as pool:
        responses = list(pool.map(send, [arguments for _, arguments in flat]))
    results: dict[str, list] = {kind: [] for kind in requests}
    for (kind, _), response in zip(flat, responses):
        results[kind].append(response)
    return results


def greedy_requests(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 5,
             "extra_body": {"ignore_eos": True, "prompt_logprobs": 3, **TOKEN_IDS}}
            for p in prompts]


def request_kinds(tokenizer, continuations: list[list[int]]) -> dict[str, list[dict]]:
    """The other kinds, their stops chosen from plain greedy continuations."""
    prompts = text_prompts(8)
    long_prompts = [
        tokenizer(text).input_ids[: MAX_MODEL_LEN - left]
        for left, text in enumerate(text_prompts(12, length=2400)[8:], start=1)
    ]
    greedy = {"temperature": 0.0, "logprobs": 2}
    return {
        # A prompt of about 390 tokens: seven prefill chunks.
        "seeded": [{"prompt": text_prompts(1, length=700)[0], **SEEDED,
                    "extra_body": TOKEN_IDS}],
        "stop": [
            {"prompt": prompt, "max_tokens": 2 * MAX_TOKENS, "temperature": 0.0,
             "extra_body": {"ignore_eos": False, **TOKEN_IDS, **stop}}
            for prompt, continuation in zip(prompts, continuations)
            for _, stop in pick_stops(tokenizer, continuation)
        ],
        "n2": [{"prompt": p, "n": 2, "temperature": 1.0, "seed": 100 + i,
                "max_tokens": MAX_TOKENS} for i, p in enumerate(prompts[:4])],
        # No max_tokens: the rest of max_model_len, 1 to 4 tokens.
        "max_model_len": [{"prompt": p, "temperature": 0.0, "extra_body": TOKEN_IDS}
                          for p in long_prompts],
        "json": [{"prompt": p, "max_tokens": 48, **greedy, "extra_body": {
            "structured_outputs": {"json": JSON_SCHEMA}, **TOKEN_IDS}} for p in prompts[:4]],
        "regex": [{"prompt": p, "max_tokens": 48, **greedy, "extra_body": {
            "structured_outputs": {"regex": REGEX}, **TOKEN_IDS}} for p in prompts[4:]],
    }


def prompt_logprob_values(steps: list) -> list[dict | None]:
    return [None if step is None else {int(t): v["logprob"] for t, v in step.items()}
            for step in steps]


def top_logprob_values(choice) -> list[dict]:
    return [{int(k.removeprefix("token_id:")): v for k, v in step.items()}
            for step in choice.logprobs.top_logprobs]


def offline_seeded_tokens(speculative: dict | None) -> list[int]:
    """The seeded request decoded offline with an unchunked prompt."""
    from vllm import SamplingParams

    from .conftest import make_llm, shutdown

    llm = make_llm(trained_pair()[0], speculative, max_num_batched_tokens=8192)
    try:
        (output,) = llm.generate(text_prompts(1, length=700),
                                 SamplingParams(**SEEDED), use_tqdm=False)
        return list(output.outputs[0].token_ids)
    finally:
        shutdown(llm)


def test_requests_users_send_through_vllm_serve(tmp_path):
    """Tree server against plain server: a seeded chunked prompt is served
    (and the server keeps serving) with its unchunked text; logprobs and
    prompt_logprobs, stop tokens and strings, n=2, max_model_len and
    structured outputs, all in flight at once."""
    from transformers import AutoTokenizer

    target, assistant = trained_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    tree_config = {"method": "mtp", "model": str(assistant),
                   "num_speculative_tokens": 3, "tree_width": 4}
    results, metrics = {}, ""
    for name, speculative in (("plain", None), ("tree", tree_config)):
        server = Server(target, speculative, tmp_path / f"{name}-kinds.log",
                        KINDS_SERVER_ARGS)
        try:
            server.wait_ready()
            if name == "plain":
                greedy = send_all(server.url, target,
                                  {"greedy": greedy_requests(text_prompts(8))})
                continuations = [token_ids(c[0]) for c in greedy["greedy"]]
                kinds = {"greedy": greedy_requests(text_prompts(8)),
                         **request_kinds(tokenizer, continuations)}
            results[name] = send_all(server.url, target, kinds)
            assert server.healthy(), server.log.read_text()[-3000:]
            # Still serving after them.
            assert send_all(server.url, target, {"seeded": kinds["seeded"]})["seeded"] == \
                results[name]["seeded"]
            if name == "tree":
                metrics = server.metrics()
        finally:
            server.stop()

    failed = {name: {kind: [r for r in responses if isinstance(r, int)]
                     for kind, responses in result.items()} for name, result in results.items()}
    assert all(not statuses for f in failed.values() for statuses in f.values()), failed
    plain, tree = results["plain"], results["tree"]
    assert counter_total(metrics, "vllm:spec_decode_num_accepted_tokens_total") > 0

    # Seeded, chunked: the text of the same request decoded unchunked.
    for name, speculative in (("plain", None), ("tree", tree_config)):
        assert token_ids(results[name]["seeded"][0][0]) == offline_seeded_tokens(speculative)

    first = lambda responses: [r[0] for r in responses]  # noqa: E731
    reference = GreedyReference(
        tokens=[token_ids(c) for c in first(plain["greedy"])],
        top2=[[StepTop2.from_logprobs(step) for step in top_logprob_values(c)]
              for c in first(plain["greedy"])],
    )
    report = assert_greedy_identical([token_ids(c) for c in first(tree["greedy"])],
                                     reference, "vllm serve: logprobs=5 requests, tree")
    largest = largest_prompt = 0.0
    for p, t in zip(first(plain["greedy"]), first(tree["greedy"])):
        steps = common_prefix_len(token_ids(p), token_ids(t))
        d, differing = logprob_difference(top_logprob_values(p)[:steps],
                                          top_logprob_values(t)[:steps])
        assert not differing, differing
        largest = max(largest, d)
        d, differing = logprob_difference(prompt_logprob_values(p.prompt_logprobs),
                                          prompt_logprob_values(t.prompt_logprobs))
        assert not differing, differing
        largest_prompt = max(largest_prompt, d)
    print(f"vllm serve logprobs: {report.num_tokens_compared} tokens, largest "
          f"difference {largest:.3g} nats; prompt_logprobs {largest_prompt:.3g} nats")
    assert max(largest, largest_prompt) <= LOGPROB_TOLERANCE

    def outcome(choice):
        return token_ids(choice), choice.text, choice.finish_reason, choice.stop_reason

    assert [outcome(c) for c in first(tree["stop"])] == \
        [outcome(c) for c in first(plain["stop"])]
    assert sum(c.finish_reason == "stop" for c in first(plain["stop"])) >= \
        0.9 * len(plain["stop"])
    assert [outcome(c) for c in first(tree["max_model_len"])] == \
        [outcome(c) for c in first(plain["max_model_len"])]
    assert [len(token_ids(c)) for c in first(plain["max_model_len"])] == [1, 2, 3, 4]
    for kind in ("json", "regex"):
        kind_reference = GreedyReference(
            tokens=[token_ids(c) for c in first(plain[kind])],
            top2=[[StepTop2.from_logprobs(step) for step in top_logprob_values(c)]
                  for c in first(plain[kind])],
        )
        assert_greedy_identical([token_ids(c) for c in first(tree[kind])],
                                kind_reference, f"vllm serve: {kind} structured outputs")
        for choice in first(tree[kind]):
            check_structured_output(kind, choice.text)
    for choices in tree["n2"]:
        assert sorted(c.index for c in choices) == [0, 1]
        assert choices[0].text != choices[1].text


def test_seeded_requests_reproduce_through_vllm_serve(tmp_path):
    """A tree-mode server gives seeded requests the same text alone, among
    NUM_REQUESTS concurrent requests, after a restart, and as the offline engine
    (tie-aware, tests/engine/keyed_sampling.py)."""
    from transformers import AutoTokenizer

    from .conftest import make_llm, shutdown
    from .keyed_sampling import ScoreOracle, SeededRequest, assert_seeded_identical
    from .test_seeded_tree_sampling import SAMPLINGS

    target, assistant = trained_pair()
    tokenizer = AutoTokenizer.from_pretrained(target)
    tree_config = {"method": "mtp", "model": str(assistant),
                   "num_speculative_tokens": 3, "tree_width": 4}
    prompts = [tokenizer(text).input_ids for text in text_prompts(NUM_REQUESTS, length=200)]
    seeded = [SeededRequest(prompts[i], seed=500 + i, **SAMPLINGS[i % 2]) for i in range(4)]
    # The load beside them: other seeds, unseeded and greedy requests.
    others = [SeededRequest(p, seed=(900 + i) if i % 3 == 0 else None,
                            **SAMPLINGS[i % 2]) if i % 3 < 2
              else SeededRequest(p, temperature=0.0, top_k=0, top_p=1.0, seed=None)
              for i, p in enumerate(prompts[4:])]

    def arguments(request: SeededRequest) -> dict:
        return {"prompt": request.prompt_token_ids, "max_tokens": MAX_TOKENS,
                "temperature": request.temperature, "top_p": request.top_p,
                "seed": request.seed, "extra_body": {"top_k": request.top_k,
                                                     "ignore_eos": True, **TOKEN_IDS}}

    def alone(url: str) -> list[list[int]]:
        return [token_ids(send_all(url, target, {"r": [arguments(r)]})["r"][0][0])
                for r in seeded]

    runs = {}
    for name in ("first", "restarted"):
        server = Server(target, tree_config, tmp_path / f"{name}.log")
        try:
            server.wait_ready()
            runs[name] = alone(server.url)
            if name == "first":
                together = send_all(server.url, target,
                                    {"seeded": [arguments(r) for r in seeded],
                                     "others": [arguments(r) for r in others]})
                runs[f"among {NUM_REQUESTS}"] = [token_ids(c[0]) for c in together["seeded"]]
                assert all(not isinstance(c, int) for c in together["others"])
        finally:
            server.stop()

    llm = make_llm(target, tree_config, max_logprobs=-1)
    try:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in seeded],
            [SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                            seed=r.seed, max_tokens=MAX_TOKENS, ignore_eos=True)
             for r in seeded], use_tqdm=False)
        runs["offline"] = [list(o.outputs[0].token_ids) for o in outputs]
        oracle = ScoreOracle(llm)
        for name in (f"among {NUM_REQUESTS}", "restarted", "offline"):
            assert_seeded_identical(runs[name], runs["first"], seeded, oracle,
                                    f"vllm serve: seeded, {name} vs alone")
    finally:
        shutdown(llm)
