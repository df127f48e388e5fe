# SPDX-License-Identifier: Apache-2.0
"""What a tree costs at real shapes on this CPU: the verify forward of a target
with Gemma 4 E2B's layer shapes, chain K = 3 (4 query rows per request) vs
leaf-sibling trees of 12 and 32 nodes (13 and 33 rows), at batch 1 and 8, and
the tree/chain tokens/s projected for the full 35-layer model from the E[L]
measured on the trained pair (a benchmark, not a test).

Shapes, from google/gemma-4-E2B-it's published config.json (text_config) and
its MTP assistant google/gemma-4-E2B-it-assistant:

    target     hidden 1536, 8 query heads, 1 KV head, head_dim 256 (sliding,
               window 512) / 512 (full), MLP 6144 (12288 in the KV-shared
               layers: use_double_wide_mlp), vocab 262144 with final logit
               soft-cap 30, per-layer embeddings 256; E2B has 35 layers,
               4 sliding : 1 full, the last 20 sharing the KV of earlier ones
    assistant  hidden 256, 4 layers (3 sliding, 1 full), 4 query heads, 1 KV
               head, q-only attention to the target's KV, 2048 centroids
               (top 32), backbone 1536; intermediate 2048 (assumed: the
               quoted configs do not give it)

Weights are random (the assistant is never accepted, so every step verifies
the whole tree), bfloat16. The target has 10 layers, E2B's pattern in small:
5 that write KV (4 sliding, 1 full) then 5 KV-shared with the double-wide MLP;
each layer kind is timed on its own, so the full model's verify forward is
projected as 12 + 3 + 16 + 4 layers of the four kinds plus the measured
embeddings, per-layer inputs and logits. Only decode steps are kept (prompts
of 256 tokens, 10 new tokens each).

The projection: a step of the full model costs its projected verify forward
plus what the step spends outside the target forward, as measured here
(drafting with the E2B-sized assistant, scheduler, walk, KV commit); tree/chain
tokens/s = (E[L] tree / E[L] chain) x (chain step / tree step), with E[L] from
the trained pair on HumanEval (docs/benchmarks.md).

Reproduce (after `bash ci/test.sh` built build/test-venv; a few minutes, the first
run also writes the 3 GB random checkpoint under build/fixtures):

    build/test-venv/bin/python tests/benchmarks/cost_model.py

It writes docs/benchmarks/cost_model.json; `el_harness.py --render-only` puts
it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"

PROMPT_TOKENS = 256
NEW_TOKENS = 10
BATCHES = (1, 8)
# name -> (speculative config extras, query rows per request)
CONFIGS = {
    "chain_k3": ({"num_speculative_tokens": 3}, 4),
    "tree_k3_w4": ({"num_speculative_tokens": 3, "tree_width": 4}, 13),
    "tree_k8_w4": ({"num_speculative_tokens": 8, "tree_width": 4}, 33),
}
# E[L] of the trained pair on HumanEval, greedy, batch 1 (docs/benchmarks.md).
MEASURED_EL = {"chain_k3": 2.724, "tree_k3_w4": 3.213, "tree_k8_w4": 4.329}
# Layers of each kind in E2B: (writes KV or shares it, sliding or full).
E2B_LAYERS = {
    ("own", "sliding"): 12,
    ("own", "full"): 3,
    ("shared", "sliding"): 16,
    ("shared", "full"): 4,
}
TARGET_LAYER_TYPES = (["sliding_attention"] * 4 + ["full_attention"]) * 2
# The same for the 10-layer target measured here.
TARGET_LAYERS = {
    ("own", "sliding"): 4,
    ("own", "full"): 1,
    ("shared", "sliding"): 4,
    ("shared", "full"): 1,
}


def build_e2b_like(root: Path) -> tuple[Path, Path]:
    """(target_dir, assistant_dir) with E2B's layer shapes, random weights,
    cached under root."""
    import torch
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    out = root / "e2b-like-v1"
    target_dir, assistant_dir = out / "target", out / "assistant"
    if (out / "done").exists():
        return target_dir, assistant_dir
    common = dict(
        vocab_size=262144,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        max_position_embeddings=131072,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        print("* Writing the E2B-shaped target (10 layers, random weights)", flush=True)
        target_config = Gemma4TextConfig(
            hidden_size=1536,
            intermediate_size=6144,
            num_hidden_layers=10,
            num_attention_heads=8,
            layer_types=TARGET_LAYER_TYPES,
            num_kv_shared_layers=5,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=256,
            vocab_size_per_layer_input=262144,
            final_logit_softcapping=30.0,
            **common,
        )
        target_config.architectures = ["Gemma4ForCausalLM"]
        Gemma4ForCausalLM(target_config).save_pretrained(target_dir)
        print("* Writing the E2B-shaped assistant", flush=True)
        assistant_config = Gemma4AssistantConfig(
            text_config=Gemma4TextConfig(
                hidden_size=256,
                intermediate_size=2048,
                num_hidden_layers=4,
                num_attention_heads=4,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                num_kv_shared_layers=4,
                hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0,
                **common,
            ),
            backbone_hidden_size=1536,
            num_centroids=2048,
            centroid_intermediate_top_k=32,
            use_ordered_embeddings=True,
        )
        assistant_config.architectures = ["Gemma4AssistantForCausalLM"]
        Gemma4AssistantForCausalLM(assistant_config).save_pretrained(assistant_dir)
    finally:
        torch.set_default_dtype(torch.float32)
    (out / "done").write_text("ok\n")
    return target_dir, assistant_dir


class StepRecorder:
    """Per engine step: wall time of the step, the target forward (and its
    rows), each target layer by kind, the target's logits and drafting."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.current: dict = defaultdict(float)
        self.enabled = False
        wrap = self._wrap
        wrap("vllm.v1.engine.core.EngineCore", "step", "step", closes_step=True)
        wrap(
            "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
            "_model_forward",
            "forward",
            rows=lambda kwargs: kwargs["positions"].shape[-1],
        )
        wrap(
            "vllm.model_executor.models.gemma4.Gemma4ForCausalLM",
            "compute_logits",
            "logits",
        )
        wrap("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_sample", "walk")
        wrap(
            "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
            "_commit_accepted_tree_kv",
            "KV commit",
        )
        wrap(
            "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
            "propose_draft_token_ids",
            "drafting",
        )
        wrap(
            "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl",
            "_tree_attention",
            "tree attention",
        )
        wrap(
            "vllm.model_executor.models.gemma4.Gemma4DecoderLayer",
            "forward",
            lambda layer: "layer " + layer_kind(layer),
        )

    def _wrap(
        self, class_path: str, name: str, label, rows=None, closes_step: bool = False
    ) -> None:
        module, class_name = class_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), class_name)
        function = getattr(cls, name)
        recorder = self

        def timed(obj, *args, **kwargs):
            if not recorder.enabled:
                return function(obj, *args, **kwargs)
            started = time.perf_counter()
            try:
                return function(obj, *args, **kwargs)
            finally:
                key = label(obj) if callable(label) else label
                recorder.current[key] += time.perf_counter() - started
                if rows is not None:
                    recorder.current["rows"] = rows(kwargs)
                if closes_step:
                    if recorder.current.get("rows"):
                        recorder.steps.append(dict(recorder.current))
                    recorder.current = defaultdict(float)

        setattr(cls, name, timed)


def layer_kind(layer) -> str:
    sharing = "shared" if layer.self_attn.is_kv_shared_layer else "own"
    window = "sliding" if layer.self_attn.is_sliding else "full"
    return f"{sharing} {window}"


def measure(target: Path, assistant: Path, recorder: StepRecorder) -> dict:
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    prompts = [
        [2] + [rng.randrange(3, 262144) for _ in range(PROMPT_TOKENS - 1)]
        for _ in range(max(BATCHES))
    ]
    sampling = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False
    )
    results = {}
    for name, (extras, rows) in CONFIGS.items():
        print(f"* {name}", flush=True)
        llm = LLM(
            model=str(target),
            dtype="bfloat16",
            max_model_len=1024,
            max_num_seqs=max(BATCHES),
            max_num_batched_tokens=8192,
            kv_cache_memory_bytes=1 << 30,
            enforce_eager=True,
            seed=0,
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            speculative_config={"method": "mtp", "model": str(assistant), **extras},
        )
        llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[0])], sampling, use_tqdm=False
        )  # warm-up
        for batch in BATCHES:
            recorder.steps.clear()
            recorder.enabled = True
            llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts[:batch]],
                sampling,
                use_tqdm=False,
            )
            recorder.enabled = False
            decode = [s for s in recorder.steps if s["rows"] == batch * rows]
            per_step = {
                key: 1000 * sum(s.get(key, 0.0) for s in decode) / len(decode)
                for key in {k for s in decode for k in s} - {"rows"}
            }
            results.setdefault(str(batch), {})[name] = {
                "rows": batch * rows,
                "decode_steps": len(decode),
                "ms": per_step,
            }
            print(
                f"  batch {batch}: {len(decode)} decode steps, verify forward "
                f"{per_step['forward'] + per_step['logits']:.1f} ms",
                flush=True,
            )
        llm.llm_engine.engine_core.shutdown()
        del llm
    return results


def project(results: dict) -> dict:
    """Per batch and config: the full model's verify forward and step (ms) and
    the projected tokens/s ratio to the chain."""
    projected = {}
    for batch, by_config in results.items():
        for name, r in by_config.items():
            ms = r["ms"]
            layers = {kind: ms[f"layer {kind[0]} {kind[1]}"] for kind in E2B_LAYERS}
            per_layer = {kind: layers[kind] / TARGET_LAYERS[kind] for kind in layers}
            outside_layers = ms["forward"] - sum(layers.values())
            verify = (
                outside_layers
                + ms["logits"]
                + sum(E2B_LAYERS[k] * per_layer[k] for k in E2B_LAYERS)
            )
            step = verify + ms["step"] - ms["forward"] - ms["logits"]
            projected.setdefault(batch, {})[name] = {
                "verify_ms_measured": ms["forward"] + ms["logits"],
                "verify_ms_e2b": verify,
                "step_ms_e2b": step,
                "tokens_per_s_e2b": int(batch) * MEASURED_EL[name] / step * 1000,
            }
        chain = projected[batch]["chain_k3"]
        for name, p in projected[batch].items():
            p["verify_over_chain"] = p["verify_ms_e2b"] / chain["verify_ms_e2b"]
            p["tree_over_chain"] = p["tokens_per_s_e2b"] / chain["tokens_per_s_e2b"]
    return projected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    target, assistant = build_e2b_like(ROOT / "build" / "fixtures")
    recorder = StepRecorder()
    results = measure(target, assistant, recorder)
    projected = project(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost_model.json").write_text(
        json.dumps({"measured": results, "projected": projected}, indent=2) + "\n"
    )
    for batch, by_config in projected.items():
        for name, p in by_config.items():
            print(
                f"batch {batch} {name}: verify {p['verify_ms_measured']:.1f} ms here, "
                f"{p['verify_ms_e2b']:.1f} ms projected ({p['verify_over_chain']:.2f}x "
                f"chain); tokens/s vs chain {p['tree_over_chain']:.2f}"
            )


if __name__ == "__main__":
    main()
