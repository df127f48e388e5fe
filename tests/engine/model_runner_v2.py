# SPDX-License-Identifier: Apache-2.0
"""Test-only: vLLM's Model Runner V2 on the CPU build, as CUDA users run it.

The CPU build disables Triton (its registry wheel has no CPU backend) and so
runs the V1 model runner. Triton's interpreter runs V2's kernels on CPU
tensors: with it installed before vLLM is imported, the CPU worker builds
`vllm/v1/worker/cpu/model_runner.py` (a V2 subclass) with CPU_ATTN.
`install()` also keeps async scheduling on (the CPU platform turns it off for
every configuration; on CUDA it is the default), routes top-k/top-p to
upstream's torch path (the Triton kernel's `row_id.to` fails in the
interpreter), lets the interpreter take integer masks as a GPU does, and
lets the tests' `custom_class` drafters, V1 proposers that
draft on the host, draft on V2, which has no such speculator. Call it before anything imports vLLM, in every process that
runs an engine (`sitecustomize.py` beside this file does it for servers).
"""

from __future__ import annotations

import os
import sys

ENV_FLAG = "TREE_TEST_MODEL_RUNNER"


def requested() -> bool:
    """Whether this process runs its engines on Model Runner V2."""
    return os.environ.get(ENV_FLAG) == "v2"


def use_triton_interpreter() -> None:
    """Hand Triton back to the CPU build, its kernels run by the interpreter;
    before anything imports vLLM's kernels."""
    os.environ["TRITON_INTERPRET"] = "1"

    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    _accept_integer_masks()

    import vllm.triton_utils as triton_utils
    from vllm.triton_utils import importing

    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    triton_utils.HAS_TRITON = importing.HAS_TRITON = True


def select_triton_attention(setattr=setattr) -> None:
    """TRITON_ATTN, the CUDA backend with tree attention, for every attention
    layer instead of CPU_ATTN (the CPU platform always picks CPU_ATTN); its
    KV cache writer asks CUDA for the device capability, a tuning choice only.
    `setattr`: e.g. a pytest monkeypatch's, to undo it after a test."""
    import torch

    from vllm.platforms import cpu
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cpu_backend = cpu.CpuPlatform.get_attn_backend_cls.__func__

    def triton_attn(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            return cpu_backend(cls, selected_backend, attn_selector_config, num_heads)
        return AttentionBackendEnum.TRITON_ATTN.get_path()

    setattr(cpu.CpuPlatform, "get_attn_backend_cls", classmethod(triton_attn))
    setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))


def install() -> None:
    os.environ[ENV_FLAG] = "v2"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    use_triton_interpreter()

    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False

    from vllm.platforms import cpu

    check_and_update_config = cpu.CpuPlatform.check_and_update_config.__func__

    def keep_async_scheduling(cls, vllm_config) -> None:
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        check_and_update_config(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        # For the logs of servers this process starts (tests/engine/test_serve.py).
        print(f"{ENV_FLAG}=v2: async_scheduling={async_scheduling}", file=sys.stderr,
              flush=True)

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_async_scheduling)
    _install_custom_class_speculator()


def _install_custom_class_speculator() -> None:
    """Model Runner V2 has no `custom_class` speculator: the scripted and
    adversarial drafters (V1 proposers that draft on the host from each
    request's token ids) draft through this one."""
    import torch

    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    class HostProposerSpeculator(BaseSpeculator):
        supports_mm_inputs = False
        draft_logits = None

        def __init__(self, vllm_config, device, req_states) -> None:
            self.proposer = create_custom_proposer(vllm_config)
            self.num_speculative_steps = vllm_config.num_speculative_tokens
            self.device = device
            self.req_states = req_states

        def use_token_trees(self, nested_trees) -> None:
            pass  # It drafts the whole tree it is configured with.

        def init_cudagraph_manager(self, cudagraph_mode) -> None:
            pass

        def capture(self) -> None:
            pass

        def propose(self, input_batch, attn_metadata, slot_mappings,
                    last_hidden_states, aux_hidden_states, num_sampled, num_rejected,
                    last_sampled, next_prefill_tokens, temperature, seeds,
                    dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False,
                    mm_inputs=None, is_profile=False, num_speculative_tokens=None):
            drafts = torch.full((input_batch.num_reqs, self.num_speculative_steps), -1,
                                dtype=torch.int64, device=self.device)
            if dummy_run:
                return drafts
            # Host reads: test-only, as the V1 proposers it hosts.
            rows = input_batch.idx_mapping
            proposed = self.proposer.propose(
                [[0] if n > 0 else [] for n in num_sampled.tolist()],
                self.req_states.total_len.gpu[rows].cpu().numpy(),
                self.req_states.all_token_ids.gpu[rows].cpu().numpy(),
            )
            for row, tokens in enumerate(proposed):
                drafts[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            return drafts

    from vllm.config import VllmConfig

    unsupported_features = VllmConfig._get_v2_model_runner_unsupported_features

    def without_custom_class(config) -> list[str]:
        return [
            feature
            for feature in unsupported_features(config)
            if "'custom_class'" not in feature
        ]

    VllmConfig._get_v2_model_runner_unsupported_features = without_custom_class

    init_speculator = model_runner.init_speculator

    def with_custom_class(vllm_config, device, req_states):
        if vllm_config.speculative_config.method == "custom_class":
            return HostProposerSpeculator(vllm_config, device, req_states)
        return init_speculator(vllm_config, device, req_states)

    model_runner.init_speculator = with_custom_class


def _accept_integer_masks() -> None:
    """The interpreter gives a scalar condition combined with a vector one
    (`is_active & (block < n)`, as in V2's grammar bitmask kernel) an int32
    mask, which its load and store then refuse; a GPU takes it as a boolean."""
    import numpy as np
    from triton.runtime import interpreter

    native = interpreter._interpreter
    load, store = native.load, native.store

    def load_with_mask(ptrs, mask, other, dtype):
        return load(ptrs, mask.astype(np.bool_), other, dtype)

    def store_with_mask(ptrs, value, mask):
        return store(ptrs, value, mask.astype(np.bool_))

    native.load, native.store = load_with_mask, store_with_mask
