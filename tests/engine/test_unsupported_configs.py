# SPDX-License-Identifier: Apache-2.0
"""Settings a token tree cannot serve correctly are refused when the engine
configuration is built (what `vllm serve` and `LLM` do first), with a message
that names the setting. Each of these built a tree-mode engine configuration
before the stack refused it; the TRITON_ATTN-only refusals (chunked local
attention, R-SWA, non-causal windows) are unit-tested in the patched tree
(tests/v1/attention/test_triton_attn_tree.py)."""

from __future__ import annotations

import pytest

from .trained_pair import trained_pair

pytestmark = pytest.mark.engine


def mtp_tree(**extra) -> dict:
    _, assistant = trained_pair()
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": 3,
            "tree_width": 4, **extra}


def draft_model_tree(**extra) -> dict:
    target, _ = trained_pair()
    return {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
            "tree_width": 2, **extra}


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
    "heterogeneous-vocabulary": (
        draft_model_tree(use_heterogeneous_vocab=True), {}, "use_heterogeneous_vocab",
    ),
    "parallel-drafting": (
        draft_model_tree(parallel_drafting=True), {}, "parallel_drafting",
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


def test_model_runner_v2_serves_gemma4_mtp_trees_sized_by_a_schedule(monkeypatch):
    """Asked for, Model Runner V2 verifies a Gemma 4 MTP tree, sized by a
    schedule or by the schedule "auto" profiles at start-up."""
    from vllm.config import vllm as vllm_config_module

    # The CPU build has no Triton; the config only checks that it is there.
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert build_config(mtp_tree()).use_v2_model_runner
    assert build_config(mtp_tree(num_speculative_tokens_per_batch_size="auto")
                        ).use_v2_model_runner


def test_supported_tree_config_builds():
    config = build_config(mtp_tree())
    assert config.speculative_config.num_speculative_tokens == 12
    assert not config.use_v2_model_runner


@pytest.mark.parametrize("sizing", [
    {"num_speculative_tokens_per_batch_size": [(1, 8, 12), (9, 256, 4)]},
    {"num_speculative_tokens_per_batch_size": "auto"},
])
def test_tree_sized_by_load_builds_on_the_v1_runner(sizing):
    """Upstream's Dynamic SD schedule, or "auto", sizes a tree in the V1
    runner (the CPU build's)."""
    config = build_config(mtp_tree(**sizing))
    assert config.speculative_config.num_speculative_tokens == 12
    assert not config.use_v2_model_runner
