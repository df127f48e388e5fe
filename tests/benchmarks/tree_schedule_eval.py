# SPDX-License-Identifier: Apache-2.0
"""How well num_speculative_tokens_per_batch_size "auto" chooses, on quantities
this machine can resolve (issue 50): one engine in one process per target.

1. The engine starts with "auto" (its 10-s start-up profile fixes and logs a
   schedule), then runs that same profile PROFILES - 1 more times in the same
   process: one profile is one draw of the machine's noise, so each batch
   size's efficiency is reported as the median and the worst of PROFILES
   schedules.
2. A careful step-time table t(B, n) is measured in the same process, with
   the engine's own profile run longer: batch sizes 1 to 32, every nested
   node count every round, ROUNDS rounds of interleaved node counts (each
   round in another order), STEPS timed steps per cell; each cell's lower
   quartile (as the engine's profile takes it) and the spread of its rounds
   (max / min) are reported.
3. E[L](n) is measured on held-apart prompts (not those the tests use):
   greedy decoding with the whole tree, each node's accepted count over the
   drafts: E[L](n) = 1 + the accepted share of the n nodes of nested tree n
   (a path's acceptance does not depend on which other nodes are drafted).
4. Decision efficiency at each B: the rate B * E[L](n) / t(B, n) of the node
   count each profile's schedule drafts, over the best node count's, both from
   the careful table and the measured E[L].
5. The careful table's own resolution: its rounds split into two halves
   (even and odd), each half's best node count at each B scored against the
   other half, as a decision efficiency. Where a table of 5 or 6 rounds of 6
   steps per cell does not reach an efficiency against an independent twin,
   a 10-s profile cannot be shown to reach it either: the machine does not
   resolve that difference.

    build/test-venv/bin/python tests/benchmarks/tree_schedule_eval.py \\
        --target trained --calibrate --out docs/benchmarks/tree_schedule_eval_trained.json
    build/test-venv/bin/python tests/benchmarks/tree_schedule_eval.py \\
        --target trained --out docs/benchmarks/tree_schedule_eval_trained_prior.json

and the same with --target cost_scaled (tree_schedule_eval_cost_scaled*.json).
With --worker-process (and `_worker_process` before `.json`), the model
worker runs in a process of its own, bound by vLLM as `vllm serve` binds it:
the profiles a server on this machine runs.
Each run records its profiles' samples, so that a change to the chooser
(tree_sizing.tree_schedule) can be tried on the same data, running nothing:

    build/test-venv/bin/python tests/benchmarks/tree_schedule_eval.py \
        --replay docs/benchmarks/tree_schedule_eval_*.json

Run it on an otherwise idle machine: anything else running lands in the
tables.

A benchmark, not a test: it prints ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
ROUNDS = 11
STEPS = 6
PROFILES = 5
NUM_EL_PROMPTS = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=["trained", "cost_scaled"], default="trained")
    parser.add_argument("--tree-width", type=int, default=4)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--calibrate", action="store_true",
        help="start the 'auto' engine from the acceptance measured on the "
        "held-apart prompts (speculative_token_tree_acceptance)")
    parser.add_argument(
        "--worker-process", action="store_true",
        help="run the 'auto' engine's model worker in a process of its own "
        "(distributed_executor_backend 'mp'), as `vllm serve` runs it on CPU: "
        "vLLM binds the worker to all cores but one, so on a 2-core machine "
        "each step takes about twice as long and a 10-s profile fits what a "
        "served one fits")
    parser.add_argument(
        "--starts", action="store_true",
        help="only start 'auto' from the prior and from the acceptance measured "
        "on held-apart prompts, and print the profile's log lines and schedule "
        "of each start (no careful table)",
    )
    parser.add_argument(
        "--replay", type=Path, nargs="+", metavar="JSON",
        help="run nothing: fix each recorded profile's schedule again from its "
        "samples with the installed vLLM's chooser, and print its efficiency "
        "beside the recorded one (a chooser change tried on the same data)")
    args = parser.parse_args()
    if args.replay:
        for path in args.replay:
            replay(path)
        return

    import numpy as np

    # Model Runner V2 on this CPU, as the tests run it (Triton's interpreter).
    from tests.engine.model_runner_v2 import install

    install()
    from tests.engine.conftest import make_llm, shutdown
    from tests.engine.trained_pair import trained_pair
    from vllm import SamplingParams
    from vllm.v1.spec_decode import tree_sizing

    target, assistant = trained_pair()
    if args.target == "cost_scaled":
        from tests.benchmarks.cost_scaled_target import build

        target = build()
    # 3. E[L](n) on held-apart prompts, the whole tree drafted every step.
    llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                            "num_speculative_tokens": args.depth,
                            "tree_width": args.tree_width},
                   max_num_seqs=max(BATCH_SIZES), max_model_len=2048)
    try:
        prompts = held_apart_prompts(NUM_EL_PROMPTS)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64,
                                             ignore_eos=True), use_tqdm=False)
        accepted, drafts = per_node_counts(llm)
    finally:
        shutdown(llm)
    print(f"E[L] run: {drafts:.0f} drafts, {sum(accepted.values())} accepted")
    if args.starts:
        starts(target, assistant, args, accepted, drafts)
        return
    calibration = {}
    if args.calibrate:
        from vllm.config.speculative import leaf_sibling_token_tree

        tree = leaf_sibling_token_tree(args.depth, args.tree_width)
        calibration = {"speculative_token_tree_acceptance":
                       [round(accepted.get(path, 0) / drafts, 4) for path in tree]}

    # What the engine core logs (vLLM's logging setup may replace handlers).
    import vllm.v1.engine.core as core_module

    logged: list[str] = []
    log_info = core_module.logger.info

    def info(msg, *log_args, **kwargs):
        logged.append(msg % log_args if log_args else msg)
        return log_info(msg, *log_args, **kwargs)

    core_module.logger.info = info
    # Every profile's samples and timed node counts, as StepTimeTable.finish
    # gets them (so that other ways to read them can be tried offline).
    finished: list[dict] = []
    finish = tree_sizing.StepTimeTable.finish

    def keep_samples(table, timed_node_counts=None):
        finished.append({"samples": {k: list(v) for k, v in table.samples.items()},
                         "timed_node_counts": timed_node_counts})
        return finish(table, timed_node_counts)

    tree_sizing.StepTimeTable.finish = keep_samples
    llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                            "num_speculative_tokens": args.depth,
                            "tree_width": args.tree_width,
                            "num_speculative_tokens_per_batch_size": "auto",
                            **calibration},
                   max_num_seqs=max(BATCH_SIZES), max_model_len=2048,
                   kv_cache_memory_bytes=2 << 30,
                   **({"distributed_executor_backend": "mp"}
                      if args.worker_process else {}))
    try:
        engine_core = llm.llm_engine.engine_core.engine_core
        scheduler = engine_core.scheduler

        def profile_run() -> dict:
            """The schedule the last profile fixed, as its log lines gave it."""
            line = next(line for line in reversed(logged)
                        if line.startswith("num_speculative_tokens_per_batch_size: "))
            seconds = next(float(line.split()[4]) for line in reversed(logged)
                           if line.startswith("Tree schedule profile took"))
            return {"seconds": seconds, "schedule": line.split(": ", 1)[1],
                    "chosen": list(scheduler.tree_sizes.num_nodes_by_batch_size),
                    "samples_ms": {f"{b},{n}": [round(1000 * x, 3) for x in v]
                                   for (b, n), v in finished[-1]["samples"].items()},
                    "timed_node_counts": finished[-1]["timed_node_counts"]}

        profiles = [profile_run()]
        print(f"engine: profile {profiles[0]['seconds']:.1f} s, "
              f"{profiles[0]['schedule']}", flush=True)
        for _ in range(PROFILES - 1):
            engine_core._profile_tree_schedule()
            profiles.append(profile_run())
            print(f"again: profile {profiles[-1]['seconds']:.1f} s, "
                  f"{profiles[-1]['schedule']}", flush=True)

        # 2. The careful table: the engine's profile, longer and at every
        # batch size, its samples kept.
        core_module.PROFILE_MAX_ROUNDS = ROUNDS
        tree_sizing.PROFILE_PRUNE_MARGIN = 1.0  # every cell, every round
        tree_sizing.PROFILE_CONTENDER_MARGIN = 1.0
        core_module.PROFILE_CELL_SECONDS = 3600.0
        core_module.PROFILE_MAX_CELL_STEPS = STEPS
        core_module.PROFILE_SECONDS = 1e9
        core_module.profile_batch_sizes = lambda max_num_seqs: list(BATCH_SIZES)
        engine_core._profile_tree_schedule()
        tree_sizing.StepTimeTable.finish = finish
        samples = finished[-1]["samples"]
        node_counts = tree_sizing.profile_node_counts(
            scheduler.tree_sizes.nested.max_num_nodes)
        medians = careful_table(samples, node_counts)
        spreads = np.array([[max(samples[(b, n)]) / min(samples[(b, n)])
                             for n in node_counts] for b in BATCH_SIZES])

        nested = scheduler.tree_sizes.nested
        spec = llm.llm_engine.vllm_config.speculative_config
        token_budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        engine_expected = tree_sizing.expected_acceptance_lengths(
            nested, dict(zip(spec.token_tree, spec.speculative_token_tree_acceptance))
            if spec.speculative_token_tree_acceptance else None)
    finally:
        shutdown(llm)

    rates = [accepted[path] / drafts for path in nested.ranked_paths]
    expected = np.concatenate([[1.0], 1.0 + np.cumsum(rates)])

    report = {"target": args.target, "calibrated": args.calibrate,
              "worker_process": args.worker_process,
              "profiles": [{k: v for k, v in p.items() if k != "chosen"}
                           for p in profiles],
              "node_counts": node_counts, "batch_sizes": list(BATCH_SIZES),
              "step_ms": (1000 * medians).round(3).tolist(),
              "spread": spreads.round(3).tolist(),
              "expected_length": expected[node_counts].round(4).tolist(),
              "engine_expected_length": engine_expected[node_counts].round(4).tolist(),
              "max_num_batched_tokens": token_budget,
              "careful_samples_ms": {f"{b},{n}": [round(1000 * x, 3) for x in v]
                                     for (b, n), v in samples.items()},
              "efficiency": {}}
    print("E[L](n): " + ", ".join(f"{n}: {expected[n]:.3f}" for n in node_counts))
    print("t(B, n) ms (lower quartile of rounds, as the engine takes it; "
          "spread max/min):")
    for b, row, spread in zip(BATCH_SIZES, medians, spreads):
        print(f"  B {b:>2}: " + " ".join(
            f"{n}:{1000 * t:.2f}({s:.2f})" for n, t, s in zip(node_counts, row, spread)))
    for b, row in zip(BATCH_SIZES, medians):
        rate = b * expected[node_counts] / row
        best = int(np.argmax(rate))
        chosen = [p["chosen"][b] for p in profiles]
        efficiencies = [float(rate[node_counts.index(n)] / rate[best]) for n in chosen]
        report["efficiency"][b] = {
            "best": node_counts[best], "chosen": chosen,
            "efficiencies": [round(e, 4) for e in efficiencies],
            "median": round(float(np.median(efficiencies)), 4),
            "worst": round(min(efficiencies), 4)}
        print(f"  B {b:>2}: best {node_counts[best]}, profiles draft {chosen}: "
              f"efficiency median {np.median(efficiencies):.3f}, "
              f"worst {min(efficiencies):.3f}")
    report["samples_per_cell"] = sorted({len(v) for v in samples.values()})
    report["split_half"] = split_half_efficiency(samples, node_counts, expected)
    report["profile_step_over_careful"] = profile_step_ratios(
        profiles, node_counts, medians)
    print("a profile's timed step over its careful cell: "
          + ", ".join(f"{k} {v:.3f}"
                      for k, v in report["profile_step_over_careful"].items()))
    print("the careful table's halves (even and odd rounds), each half's best "
          "node count scored against the other half:")
    for b, halves in report["split_half"].items():
        print(f"  B {b:>2}: best {halves['best']}, efficiency "
              f"{halves['efficiency'][0]:.3f} and {halves['efficiency'][1]:.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def starts(target, assistant, args, accepted: dict, drafts: float) -> None:
    """'auto' started from the prior, then from the acceptance measured on
    held-apart prompts: each start's profile lines (context, sampling, the
    step-time table) and the schedule it fixed, one engine at a time."""
    import logging

    from tests.engine.conftest import make_llm, shutdown
    from vllm.config.speculative import leaf_sibling_token_tree

    tree = leaf_sibling_token_tree(args.depth, args.tree_width)
    measured = [round(accepted.get(path, 0) / drafts, 4) for path in tree]
    results = {"target": args.target, "measured_acceptance": measured}
    for start, calibration in (
        ("prior", {}),
        ("measured", {"speculative_token_tree_acceptance": measured}),
    ):
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logger = logging.getLogger("vllm.v1.engine.core")
        logger.addHandler(handler)
        try:
            llm = make_llm(target, {"method": "mtp", "model": str(assistant),
                                    "num_speculative_tokens": args.depth,
                                    "tree_width": args.tree_width,
                                    "num_speculative_tokens_per_batch_size": "auto",
                                    **calibration},
                           max_num_seqs=max(BATCH_SIZES), max_model_len=2048,
                           kv_cache_memory_bytes=2 << 30)
            shutdown(llm)
        finally:
            logger.removeHandler(handler)
        results[start] = [line for line in lines
                          if line.startswith(("Timing decode steps", "Tree schedule profile",
                                              "num_speculative_tokens_per_batch_size"))]
        print(f"* {args.target}, from the {start}:", *results[start], sep="\n", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def careful_table(samples: dict, node_counts, half: int | None = None):
    """[batch sizes, node counts] seconds: each cell the lower quartile of the
    careful profile's samples, or of one half of its rounds (`half` 0: the
    even rounds, 1: the odd ones; a round is STEPS samples of the cell)."""
    import numpy as np

    from vllm.v1.spec_decode import tree_sizing

    def kept(cell):
        if half is None:
            return samples[cell]
        rounds = [samples[cell][k : k + STEPS]
                  for k in range(0, len(samples[cell]), STEPS)]
        if len(rounds) < 2:  # one round: alternate samples instead
            return samples[cell][half::2]
        return [x for r in rounds[half::2] for x in r]

    return np.array([[tree_sizing.cell_seconds(kept((b, n))) for n in node_counts]
                     for b in BATCH_SIZES])


def profile_step_ratios(profiles, node_counts, careful) -> dict:
    """Every timed step of the profiles over the careful table's cell: the
    quartiles of that ratio (its spread is the noise one profile decides on)."""
    import numpy as np

    ratios = [sample / 1000 / careful[BATCH_SIZES.index(b), node_counts.index(n)]
              for p in profiles for cell, cell_samples in p["samples_ms"].items()
              for b, n in [map(int, cell.split(","))] if b in BATCH_SIZES
              for sample in cell_samples]
    q25, median, q75 = np.percentile(ratios, [25, 50, 75])
    return {"steps": len(ratios), "q25": round(float(q25), 3),
            "median": round(float(median), 3), "q75": round(float(q75), 3)}


def split_half_efficiency(samples: dict, node_counts, expected) -> dict:
    """At each B: the best node count of the careful table's even rounds and
    of its odd rounds, and each one's decision efficiency in the other half."""
    import numpy as np

    halves = [careful_table(samples, node_counts, half) for half in (0, 1)]
    gains = np.asarray(expected)[node_counts]
    result = {}
    for i, b in enumerate(BATCH_SIZES):
        rates = [gains / half[i] for half in halves]
        best = [int(np.argmax(rate)) for rate in rates]
        result[b] = {
            "best": [node_counts[k] for k in best],
            "efficiency": [round(float(rates[1 - h][best[h]] / rates[1 - h].max()), 4)
                           for h in (0, 1)]}
    return result


def replay(path: Path) -> None:
    """A recorded run's profiles (their samples and timed node counts), their
    schedules fixed again by tree_sizing.tree_schedule as installed, and
    each batch size's efficiency, median and worst, against the recorded
    careful table: recorded -> replayed."""
    import numpy as np

    from vllm.v1.spec_decode import tree_sizing
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    r = json.loads(path.read_text())
    node_counts, batch_sizes = r["node_counts"], r["batch_sizes"]
    engine_expected = np.zeros(max(node_counts) + 1)
    engine_expected[node_counts] = r["engine_expected_length"]
    expected = np.array(r["expected_length"])
    step_ms = np.array(r["step_ms"])
    print(f"{path.name}: {r['target']}, "
          + ("calibrated" if r["calibrated"] else "prior"))
    replayed = []
    for profile in r["profiles"]:
        table = tree_sizing.StepTimeTable(node_counts, batch_sizes)
        for cell, samples in profile["samples_ms"].items():
            batch_size, num_nodes = map(int, cell.split(","))
            for sample in samples:
                table.add(batch_size, num_nodes, sample / 1000)
        timed = profile["timed_node_counts"]
        table.finish({int(b): n for b, n in timed.items()} if timed else None)
        schedule = tree_sizing.tree_schedule(
            table.predict, node_counts, engine_expected, max(batch_sizes),
            r.get("max_num_batched_tokens", sys.maxsize))
        print(f"  {profile['schedule']} -> {tree_sizing.format_schedule(schedule)}")
        replayed.append(build_dynamic_sd_schedule_lookup(
            schedule, max(batch_sizes), max(node_counts)))
    for i, b in enumerate(batch_sizes):
        rate = b * expected / step_ms[i]
        efficiency = [rate[node_counts.index(lookup[b])] / rate.max()
                      for lookup in replayed]
        recorded = r["efficiency"][str(b)]
        print(f"  B {b:>2}: efficiency median {recorded['median']:.3f} -> "
              f"{np.median(efficiency):.3f}, worst {recorded['worst']:.3f} -> "
              f"{min(efficiency):.3f}")


def held_apart_prompts(count: int, length: int = 240) -> list[str]:
    """Standard-library snippets from files the tests' prompts
    (tests/engine/trained_pair.text_prompts: every third file from the
    first) do not use."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for path in sorted(stdlib.glob("*.py"))[1::3]:
        text = path.read_text(errors="ignore")
        if len(text) > 4 * length:
            prompts.append(text[len(text) // 3 : len(text) // 3 + length])
        if len(prompts) == count:
            break
    return prompts


def per_node_counts(llm) -> tuple[dict, float]:
    """Accepted tokens per node path, and drafts, so far."""
    from tests.engine.conftest import accepted_tokens_per_node, spec_decode_counters

    return accepted_tokens_per_node(llm), float(spec_decode_counters(llm)["num_drafts"])


if __name__ == "__main__":
    main()
