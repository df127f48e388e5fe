# SPDX-License-Identifier: Apache-2.0
"""Test-only: drafters that draft on the host from each request's token ids
(the scripted and adversarial tree drafters), served by Model Runner V2 as a
custom speculative method that drafts token trees.

`host_drafter(proposer, **spec)` is the speculative config of one: `proposer`
names a class with `__init__(vllm_config)` and `propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu)`, which returns each request's drafts (in a
tree's breadth-first order). `register()` must run in every process that
builds an engine config (tests/engine/model_runner_v2.py does it).

Model Runner V2 verifies every node the scheduler scheduled: a request has no
fewer drafts than the tree has nodes. A node the proposer leaves out (a
breadth-first prefix, or no drafts at all) is drafted as UNPROPOSED_TOKEN, the
checkpoints' <pad>, which no trained target ranks in its top-k: verified and
rejected like any wrong draft, so the step yields what it would without it.
"""

from __future__ import annotations

from typing import Any

import torch

METHOD = "tree_test_host_drafter"
UNPROPOSED_TOKEN = 0


def host_drafter(proposer: str, **spec: Any) -> dict[str, Any]:
    return {"method": METHOD, "speculator_options": {"proposer": proposer}, **spec}


def register() -> None:
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (
        SpeculatorConfig,
        register_speculative_method,
    )

    class HostDrafterConfig(SpeculatorConfig):
        speculator_class = f"{__name__}.HostDrafterSpeculator"
        supported_options = frozenset({"speculator_options"})
        drafts_token_trees = True

        @classmethod
        def apply_options(cls, spec) -> None:
            options = spec.speculator_options or {}
            if set(options) != {"proposer"}:
                raise ValueError(
                    f"{METHOD} takes speculator_options={{'proposer': ...}}; "
                    f"got {options}")

    globals()["HostDrafterConfig"] = HostDrafterConfig
    register_speculative_method(METHOD, f"{__name__}.HostDrafterConfig")


def _speculator_class():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    class HostDrafterSpeculator(BaseSpeculator):
        draft_logits = None

        def __init__(self, vllm_config, device, req_states) -> None:
            spec = vllm_config.speculative_config
            proposer = resolve_obj_by_qualname(spec.speculator_options["proposer"])
            self.proposer = proposer(vllm_config)
            self.num_speculative_steps = spec.num_speculative_tokens
            self.device = device
            self.req_states = req_states

        def use_token_trees(self, nested_trees) -> None:
            pass  # It drafts the whole tree it is configured with.

        def load_model(self, *args, **kwargs) -> None:
            pass

        def init_cudagraph_manager(self, cudagraph_mode) -> None:
            pass

        def capture(self) -> None:
            pass

        def propose(self, input_batch, attn_metadata, slot_mappings,
                    last_hidden_states, aux_hidden_states, num_sampled, num_rejected,
                    last_sampled, next_prefill_tokens, temperature, seeds,
                    dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False,
                    mm_inputs=None, is_profile=False, num_speculative_tokens=None):
            drafts = torch.full((input_batch.num_reqs, self.num_speculative_steps),
                                UNPROPOSED_TOKEN, dtype=torch.int64, device=self.device)
            if dummy_run:
                return drafts
            # Host reads: test-only, as the host drafters they serve.
            rows = input_batch.idx_mapping
            proposed = self.proposer.propose(
                [[0] if n > 0 else [] for n in num_sampled.tolist()],
                self.req_states.total_len.gpu[rows].cpu().numpy(),
                self.req_states.all_token_ids.gpu[rows].cpu().numpy(),
            )
            for row, tokens in enumerate(proposed):
                drafts[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            return drafts

    return HostDrafterSpeculator


def __getattr__(name: str):
    # Built on first use, after vLLM's kernels were handed to the interpreter.
    if name == "HostDrafterSpeculator":
        globals()[name] = _speculator_class()
        return globals()[name]
    raise AttributeError(name)
