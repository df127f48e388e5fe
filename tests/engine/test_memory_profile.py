# SPDX-License-Identifier: Apache-2.0
"""The start-up memory profile, which sizes the KV cache, verifies the
largest sampled tree step the scheduler can produce: min(max_num_seqs x
(1 + nodes), max_num_batched_tokens) rows of random requests."""

from __future__ import annotations

import pytest

from .conftest import make_llm, shutdown
from .trained_pair import trained_pair

pytestmark = pytest.mark.engine

NUM_TREE_NODES = 12  # K=3, W=4: three spine nodes and three siblings each


def profiled_verify_rows(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, sampled) of each tree verify the engine runs."""
    from vllm.v1.worker.gpu.spec_decode.tree import rejection_sampler

    calls = []
    sampler_cls = rejection_sampler.TreeRejectionSampler
    verify = sampler_cls.__call__

    def spy(self, logits, input_batch, *args, **kwargs):
        temperature = self.sampler.sampling_states.temperature.np
        sampled = bool((temperature[input_batch.idx_mapping_np] > 0).all())
        calls.append((logits.shape[0], sampled))
        return verify(self, logits, input_batch, *args, **kwargs)

    monkeypatch.setattr(sampler_cls, "__call__", spy)
    return calls


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens, expected_rows",
                         [(4, 2048, 4 * (1 + NUM_TREE_NODES)), (64, 600, 600)])
def test_the_profile_verifies_the_largest_sampled_tree_step(
        monkeypatch, max_num_seqs, max_num_batched_tokens, expected_rows):
    calls = profiled_verify_rows(monkeypatch)
    target, assistant = trained_pair()
    llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                            "num_speculative_tokens": 3, "tree_width": 4},
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    try:
        # A GPU worker always profiles at start-up; the CPU worker skips it
        # for an eager model with a given KV cache size, as here.
        llm.collective_rpc(lambda worker: worker.model_runner.profile_run())
    finally:
        shutdown(llm)
    print(f"\nmax_num_seqs {max_num_seqs}, max_num_batched_tokens "
          f"{max_num_batched_tokens}: profiled verify steps (rows, sampled) {calls}")
    assert (expected_rows, True) in calls
