# SPDX-License-Identifier: Apache-2.0
"""Engine test rig: the installed (patched) vLLM, in-process, on tiny local
Gemma 4 checkpoints, greedy and float32 so that token identity is exact."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

# Before vllm is imported: engines run in this process (start-up ~3 s instead
# of ~18 s), and nothing may reach a model hub.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"

from .identity import GreedyReference, StepTop2  # noqa: E402
from .tiny_gemma4 import build_tiny_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_gemma4() -> tuple[Path, Path]:
    """(target_dir, assistant_dir), built once and cached under build/fixtures."""
    return build_tiny_pair(ROOT / "build" / "fixtures")


def make_llm(model: Path, speculative_config: dict | None = None, **overrides):
    from vllm import LLM

    options = dict(
        model=str(model),
        dtype="float32",
        max_model_len=512,
        # A fixed KV budget: a fraction of host memory depends on what else runs.
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=True,
        seed=0,
        max_num_seqs=32,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    options.update(overrides)
    return LLM(**options)


def _greedy_outputs(llm, prompts: list, max_tokens: int | list[int], **params):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    sampling = [
        SamplingParams(**{"temperature": 0.0, "max_tokens": n, "ignore_eos": True, **params})
        for n in max_tokens
    ]
    inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=p) for p in prompts]
    return [o.outputs[0] for o in llm.generate(inputs, sampling, use_tqdm=False)]


def greedy_generate(llm, prompts: list, max_tokens: int, **params) -> list[list[int]]:
    """Greedy token ids per prompt; a prompt is text or a list of token ids."""
    return [list(o.token_ids) for o in _greedy_outputs(llm, prompts, max_tokens, **params)]


def plain_greedy_reference(llm, prompts: list, max_tokens: int | list[int],
                           **params) -> GreedyReference:
    """Greedy tokens per prompt with plain decoding's top-2 logprobs at every
    step, the reference of the tie-aware identity check (identity.py);
    `max_tokens` for all prompts or per prompt."""
    outputs = _greedy_outputs(llm, prompts, max_tokens, logprobs=2, **params)
    return GreedyReference(
        tokens=[list(o.token_ids) for o in outputs],
        top2=[[StepTop2.from_logprobs(step) for step in o.logprobs] for o in outputs],
    )


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def accepted_tokens_per_node(llm) -> dict[tuple[int, ...], int]:
    """vllm:spec_decode_num_accepted_tokens_per_node, by the node's path."""
    import ast

    return {
        ast.literal_eval(metric.labels["path"]): int(metric.value)
        for metric in llm.get_metrics()
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_node"
    }


def spec_decode_counters(llm) -> dict[str, float | list]:
    """vllm:spec_decode_* metrics of this engine, by name without the prefix."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            if hasattr(metric, "buckets"):  # a histogram
                counters[name] = metric.buckets
            else:
                counters[name] = getattr(metric, "values", None) or metric.value
    return counters
