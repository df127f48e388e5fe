# SPDX-License-Identifier: Apache-2.0
"""Settings a token tree cannot serve correctly are refused when the engine
configuration is built (what `vllm serve` and `LLM` do first), with a message
that names the setting. Each of these built a tree-mode engine configuration
before the stack refused it; the TRITON_ATTN-only refusals (chunked local
attention, R-SWA, non-causal windows) are unit-tested in the patched tree
(tests/v1/attention/test_triton_attn_tree.py). Drafters whose speculator
drafts chains (EAGLE, EAGLE-3, MTP other than Gemma 4's assistant) are refused
a tree naming their method, while a Gemma 4 MTP tree builds, sized by load or
not. No weights are loaded: the configurations are only built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .trained_pair import trained_pair

pytestmark = pytest.mark.engine


def mtp_tree(**extra) -> dict:
    _, assistant = trained_pair()
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3,
            "tree_width": 4, **extra}


CASES = {
    "dual-batch-overlap": (mtp_tree(), {"enable_dbo": True}, "enable_dbo"),
    "micro-batching": (mtp_tree(), {"ubatch_size": 2}, "ubatch_size=2"),
    "data-parallel": (mtp_tree(), {"data_parallel_size": 2}, "data_parallel_size=2"),
    "kv-connector": (
        mtp_tree(),
        {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
        "kv_transfer_config",
    ),
    "lora": (mtp_tree(), {"enable_lora": True}, "enable_lora"),
    "kv-sharing-fast-prefill": (
        mtp_tree(), {"kv_sharing_fast_prefill": True}, "kv_sharing_fast_prefill",
    ),
    "sampling-mask": (mtp_tree(), {"return_sampling_mask": True}, "return_sampling_mask"),
    "probabilistic-drafts": (
        mtp_tree(draft_sample_method="probabilistic"), {},
        "draft_sample_method='probabilistic' is not supported",
    ),
    "adaptive-verification": (
        mtp_tree(enable_adaptive_verification=True), {},
        "num_speculative_tokens_per_batch_size to 'auto'",
    ),
}


def build_config(speculative: dict, **options):
    from vllm.engine.arg_utils import EngineArgs

    target, _ = trained_pair()
    return EngineArgs(model=str(target), dtype="float32", max_model_len=512,
                      speculative_config=speculative, **options).create_engine_config()


@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_setting_is_refused_naming_it(case):
    speculative, options, match = CASES[case]
    with pytest.raises(Exception, match=f"speculative_token_tree .*{match}") as error:
        build_config(speculative, **options)
    print(f"{case}: {str(error.value).splitlines()[1].strip()[:240]}")


def llama_draft(directory: Path, architecture: str) -> str:
    """A draft checkpoint of a tiny Llama architecture (EAGLE or EAGLE-3
    heads are Llama layers) on the target's vocabulary: its config only, as
    building the configuration reads no weights."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 2048, "torch_dtype": "float32",
    }))
    return str(directory)


# Drafters whose speculators draft chains, by method.
CHAIN_DRAFTERS = {
    "eagle": lambda tmp: {"method": "eagle",
                          "model": llama_draft(tmp / "eagle", "LlamaForCausalLM")},
    "eagle3": lambda tmp: {"method": "eagle3",
                           "model": llama_draft(tmp / "eagle3", "LlamaForCausalLMEagle3")},
    # An MTP drafter other than Gemma 4's assistant: no draft model, the MTP
    # layers of the target's own checkpoint (as DeepSeek or Qwen3-Next ship
    # theirs).
    "mtp": lambda tmp: {"method": "mtp"},
}


@pytest.mark.parametrize("method", list(CHAIN_DRAFTERS))
def test_a_chain_drafter_is_refused_a_tree_naming_its_method(tmp_path, method):
    drafter = CHAIN_DRAFTERS[method](tmp_path)
    # Its chain builds: the refusal below is the tree's, not the drafter's.
    chain = build_config({**drafter, "num_speculative_tokens": 3}).speculative_config
    assert chain.method == method
    assert not chain.speculator_config.drafts_token_trees
    with pytest.raises(Exception, match=f"speculative_token_tree is not supported with "
                                        f"method='{method}'") as error:
        build_config({**drafter, "num_speculative_tokens": 3, "tree_width": 4})
    print(f"{method}: {str(error.value).splitlines()[1].strip()[:240]}")


@pytest.mark.parametrize("sizing", [
    {},
    {"num_speculative_tokens_per_batch_size": [(1, 8, 12), (9, 256, 4)]},
    {"num_speculative_tokens_per_batch_size": "auto"},
], ids=["fixed", "schedule", "auto"])
def test_gemma4_mtp_tree_builds_fixed_or_sized_by_load(sizing):
    """A Gemma 4 MTP tree builds as it is, sized by a schedule, or sized by
    the schedule "auto" profiles at start-up; Gemma 4's tree speculator
    drafts it."""
    speculative = build_config(mtp_tree(**sizing)).speculative_config
    assert speculative.num_speculative_tokens == 12
    assert speculative.num_speculative_tokens_per_batch_size == sizing.get(
        "num_speculative_tokens_per_batch_size")
    assert speculative.speculator_config.drafts_token_trees
    assert speculative.speculator_config.speculator_class == (
        "vllm.v1.worker.gpu.spec_decode.gemma4.tree.Gemma4TreeSpeculator")
