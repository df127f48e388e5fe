# SPDX-License-Identifier: Apache-2.0
"""The real engine with the TRITON_ATTN backend on CPU, its Triton kernels run
by Triton's interpreter: plain greedy decoding, then a Gemma 4 MTP tree, then
the same tree with the kernel's ancestor mask dropped. Prints one JSON line.

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
from tests.engine.trained_pair import text_prompts, trained_pair  # noqa: E402

NUM_PROMPTS = 4
MAX_TOKENS = 12
TREE = {"num_speculative_tokens": 3, "tree_width": 4}


def attention_backends(llm) -> list[str]:
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return sorted(
        {g.backend.get_name() for groups in runner.attn_groups for g in groups}
    )


def drop_the_ancestor_mask() -> None:
    """The negative control: every tree row sees every row of its block."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    set_tree_rows = TritonAttentionMetadataBuilder._set_tree_rows

    def without_mask(self, attn_metadata, common_attn_metadata):
        set_tree_rows(self, attn_metadata, common_attn_metadata)
        self.tree_ancestor_bits.fill_(-1)

    TritonAttentionMetadataBuilder._set_tree_rows = without_mask


def main() -> None:
    target, assistant = trained_pair()
    prompts = text_prompts(NUM_PROMPTS)
    options = dict(max_num_seqs=NUM_PROMPTS, kv_cache_memory_bytes=64 << 20)
    result = {}

    llm = make_llm(target, **options)
    result["plain_backends"] = attention_backends(llm)
    reference = plain_greedy_reference(llm, prompts, MAX_TOKENS)
    shutdown(llm)

    for run in ("tree", "tree_without_mask"):
        if run == "tree_without_mask":
            drop_the_ancestor_mask()
        llm = make_llm(
            target, {"method": "mtp", "model": str(assistant), **TREE}, **options
        )
        result[f"{run}_backends"] = attention_backends(llm)
        tokens = greedy_generate(llm, prompts, MAX_TOKENS)
        counters = spec_decode_counters(llm)
        shutdown(llm)
        identity = compare_with_plain_greedy(tokens, reference, run)
        result[run] = {
            "identical": identity.ok,
            "summary": identity.summary(),
            "mismatches": len(identity.mismatches),
            "tie_flips": len(identity.tie_flips),
            "num_drafts": counters["num_drafts"],
            "num_accepted_tokens": counters["num_accepted_tokens"],
            "num_rescued_tokens_per_pos": counters["num_rescued_tokens_per_pos"],
        }
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
