# SPDX-License-Identifier: Apache-2.0
"""What tree mode's position-keyed sampling noise costs per step (a benchmark,
not a test).

    ops     The noise and argmax of one K=3 W=4 verify step, all requests
            sampled (T 0.8, seeded): 12 tree rows and 1 bonus row per request,
            at batch 1 and 16, at the trained pair's vocabulary (512) and at
            Gemma 4's (262,144). Before: the previous stack's code, Exp(1)
            noise from each request's generator for every tree row
            (probs / q) and the CPU sampler's fused kernel, with a seed drawn
            from the generator, for the bonus row. After: the position keys
            built on the host as the runner builds them, then the fused kernel
            for every row.
    engine  Per engine step of the installed wheel: `GPUModelRunner._sample`
            (the walk and all sampling) and `EngineCore.step`, trained pair,
            MTP K=3 W=4, seeded T 0.8 / top-p 0.9, batch 1 and 16, 64 tokens,
            best of 3. Run once with the previous wheel installed
            (--label before) and once with this one (--label after).

    build/test-venv/bin/python tests/benchmarks/noise_cost.py ops
    build/test-venv/bin/python tests/benchmarks/noise_cost.py engine --label after

Both merge their figures into docs/benchmarks/noise_cost.json;
`el_harness.py --render-only` puts them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Imported first: it sets the in-process engine's environment before vllm loads.
from tests.benchmarks.el_harness import PAIR, humaneval_prompts, tokenize  # noqa: E402
from tests.engine.conftest import make_llm, shutdown  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "noise_cost.json"
BATCHES = (1, 16)
VOCABS = (512, 262144)
TREE_ROWS = 12  # K=3 W=4: the root and 11 of its 12 nodes; node 12's row is the bonus
MAX_TOKENS = 64
TREE = {"method": "mtp", "model": str(PAIR / "assistant"), "num_speculative_tokens": 3,
        "tree_width": 4}


def timed_ms(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def ops_benchmark() -> dict:
    import numpy as np
    import torch

    import vllm._C  # noqa: F401
    from vllm.v1.sample.ops.position_keyed import position_keys, request_noise_seed
    from vllm.v1.spec_decode.tree import SpecTokenTree

    tree = SpecTokenTree([(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (0, 3),
                          (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)])
    results = {}
    for vocab_size in VOCABS:
        for batch in BATCHES:
            torch.manual_seed(0)
            tree_logits = torch.randn(batch * TREE_ROWS, vocab_size)
            bonus_logits = torch.randn(batch, vocab_size)
            generators = [torch.Generator().manual_seed(i) for i in range(batch)]
            num_draft_tokens = np.full(batch, TREE_ROWS)
            noise_seeds = np.array([request_noise_seed(i) for i in range(batch)],
                                   dtype=np.uint64)
            output_positions = np.full(batch, 100)
            logits = torch.cat([tree_logits.view(batch, TREE_ROWS, -1),
                                bonus_logits.unsqueeze(1)], dim=1).view(-1, vocab_size)

            def before():
                probs = tree_logits.softmax(dim=-1, dtype=torch.float32)
                q = torch.empty_like(probs)
                for i, generator in enumerate(generators):
                    rows = slice(i * TREE_ROWS, (i + 1) * TREE_ROWS)
                    q[rows].exponential_(generator=generator)
                probs.div_(q).argmax(dim=-1)
                seeds = torch.tensor([int(torch.randint(0, 2**31, (1,), generator=g))
                                      for g in generators])
                torch.ops._C.fused_gumbel_argmax(bonus_logits, seeds)

            def after():
                keys = position_keys(
                    np.repeat(noise_seeds, num_draft_tokens + 1),
                    np.repeat(output_positions, num_draft_tokens + 1)
                    + tree.sampled_row_depths(num_draft_tokens),
                )
                torch.ops._C.fused_gumbel_argmax(logits, torch.from_numpy(keys))

            repeats = 20 if vocab_size * batch < 1 << 20 else 5
            results[f"{vocab_size}/{batch}"] = {
                "vocab_size": vocab_size, "batch": batch,
                "before_ms": timed_ms(before, repeats), "after_ms": timed_ms(after, repeats),
            }
            print(results[f"{vocab_size}/{batch}"], flush=True)
    return results


def engine_benchmark() -> dict:
    from vllm import SamplingParams

    from tests.benchmarks.throughput import StepTimers

    timers = StepTimers()
    prompts = tokenize(humaneval_prompts())
    results = {}
    for batch in BATCHES:
        llm = make_llm(PAIR / "target", TREE, max_num_seqs=batch, max_model_len=1024,
                       max_num_batched_tokens=8192)
        try:
            batch_prompts = prompts[: max(2 * batch, 16)]
            params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                                     max_tokens=MAX_TOKENS) for i in range(len(batch_prompts))]
            from vllm.inputs import TokensPrompt

            inputs = [TokensPrompt(prompt_token_ids=p) for p in batch_prompts]
            llm.generate(inputs[:batch], params[:batch], use_tqdm=False)  # warm-up
            best = None
            for _ in range(3):
                with timers.recording():
                    llm.generate(inputs, params, use_tqdm=False)
                per_step = timers.per_step_ms()
                if best is None or per_step["step"] < best["step_ms"]:
                    best = {"step_ms": per_step["step"], "sample_ms": per_step["walk"],
                            "steps": timers.steps}
            results[str(batch)] = best
            print(batch, best, flush=True)
        finally:
            shutdown(llm)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("ops", "engine"))
    parser.add_argument("--label", choices=("before", "after"), default="after")
    args = parser.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    if args.part == "ops":
        results["ops"] = ops_benchmark()
    else:
        from importlib.metadata import distributions

        wheel = next(f"{d.name} {d.version}" for d in distributions()
                     if d.name.startswith("vllm"))
        results.setdefault("engine", {})[args.label] = {"wheel": wheel, **engine_benchmark()}
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"Wrote {OUT}")


if __name__ == "__main__":
    main()
