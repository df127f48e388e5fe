# SPDX-License-Identifier: Apache-2.0
"""The real engine with the TRITON_ATTN backend on CPU, its Triton kernels run
by Triton's interpreter: plain greedy decoding, then every tree the CPU_ATTN
tests prove (Gemma 4 MTP K=3 W=4, the 12-node continuation tree, the planned
32-node tree, a draft_model K=3 W=4 tree), then the first with the kernel's
ancestor mask dropped. Prints one JSON line.

Run by test_triton_tree_engine.py in a subprocess, on Model Runner V2 as
the tests' own process runs it (tests/engine/model_runner_v2.py: the
interpreter, async scheduling, the torch top-k/top-p path), with TRITON_ATTN
for every attention layer: both must be in place before vLLM is imported.
Test-only overrides: the CPU build disables Triton (it has no CPU backend; the
interpreter needs none), the CPU platform always picks CPU_ATTN, and
TRITON_ATTN's KV cache writer asks CUDA for the device capability (a tuning
choice only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engine.model_runner_v2 import (  # noqa: E402
    install,
    select_triton_attention,
)

install()
select_triton_attention()

from tests.engine.conftest import (  # noqa: E402
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
    spec_decode_counters,
)
from tests.engine.identity import compare_with_plain_greedy  # noqa: E402
from tests.engine.test_mtp_tree import CONTINUATION_12, planned_tree  # noqa: E402
from tests.engine.trained_pair import (  # noqa: E402
    perturbed_draft_model,
    text_prompts,
    trained_pair,
)

NUM_PROMPTS = 4
MAX_TOKENS = 12
K3_W4 = {"num_speculative_tokens": 3, "tree_width": 4}


def tree_runs() -> dict[str, tuple[dict, dict]]:
    """Run name -> (speculative config, engine options); the last run is the
    negative control (the first tree, its mask dropped)."""
    _, assistant = trained_pair()
    mtp = {"method": "mtp", "model": str(assistant)}
    return {
        "mtp_k3_w4": ({**mtp, **K3_W4}, {}),
        "mtp_continuation_12": ({**mtp, "speculative_token_tree": str(CONTINUATION_12)}, {}),
        "mtp_planned_32": ({**mtp, "speculative_token_tree": str(planned_tree(32))}, {}),
        "draft_model_k3_w4": (
            {"method": "draft_model", "model": str(perturbed_draft_model()), **K3_W4},
            {"disable_hybrid_kv_cache_manager": True},
        ),
        "mtp_k3_w4_without_mask": ({**mtp, **K3_W4}, {}),
    }


def attention_backends(llm) -> list[str]:
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return sorted(
        {g.backend.get_name() for groups in runner.attn_groups for g in groups}
    )


def drop_the_ancestor_mask() -> None:
    """The negative control: every tree row sees every row of its block."""
    import torch

    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    build = TritonAttentionMetadataBuilder.build

    def without_mask(self, *args, **kwargs):
        attn_metadata = build(self, *args, **kwargs)
        if attn_metadata.tree_ancestor_bits is not None:
            attn_metadata.tree_ancestor_bits = torch.full_like(
                attn_metadata.tree_ancestor_bits, -1)
        return attn_metadata

    TritonAttentionMetadataBuilder.build = without_mask


def main() -> None:
    target, _ = trained_pair()
    prompts = text_prompts(NUM_PROMPTS)
    options = dict(max_num_seqs=NUM_PROMPTS, kv_cache_memory_bytes=64 << 20)
    result = {}

    llm = make_llm(target, **options)
    result["plain_backends"] = attention_backends(llm)
    reference = plain_greedy_reference(llm, prompts, MAX_TOKENS)
    shutdown(llm)

    for run, (speculative, engine_options) in tree_runs().items():
        if run.endswith("_without_mask"):
            drop_the_ancestor_mask()
        llm = make_llm(target, speculative, **options, **engine_options)
        backends = attention_backends(llm)
        tokens = greedy_generate(llm, prompts, MAX_TOKENS)
        counters = spec_decode_counters(llm)
        shutdown(llm)
        identity = compare_with_plain_greedy(tokens, reference, run)
        result[run] = {
            "backends": backends,
            "identical": identity.ok,
            "summary": identity.summary(),
            "mismatches": len(identity.mismatches),
            "tie_flips": len(identity.tie_flips),
            "num_drafts": counters["num_drafts"],
            "num_accepted_tokens": counters["num_accepted_tokens"],
            "num_accepted_tokens_per_pos": counters["num_accepted_tokens_per_pos"],
            "num_rescued_tokens_per_pos": counters["num_rescued_tokens_per_pos"],
        }
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
