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
from .trained_pair import text_prompts, trained_pair

pytestmark = pytest.mark.engine

NUM_REQUESTS = 32
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` on loopback, shut down with SIGINT like a user would."""

    def __init__(self, model: Path, speculative_config: dict | None, log: Path):
        self.port = free_port()
        command = [
            str(Path(sys.executable).with_name("vllm")), "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
            "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
        ]
        if speculative_config:
            command += ["--speculative-config", json.dumps(speculative_config)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.log = log
        self.process = subprocess.Popen(command, env=env, stdout=log.open("w"),
                                         stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 240) -> None:
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
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


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
