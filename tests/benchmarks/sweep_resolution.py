# SPDX-License-Identifier: Apache-2.0
"""What a load sweep (serve_bench.py) can resolve (a benchmark tool, not a
test): how often an adaptive server exactly as fast as the best fixed
configuration would read at least GOAL of it at every concurrency, given the
run-to-run noise the sweep's own control measured.

The control (`serve_bench.py --control NAME`) is a second server identical to
NAME's; the spread of their per-run ratios about 1 (every round at every
concurrency, pooled) is two runs' noise, so one run's is that over sqrt(2).
The simulation draws every configuration's runs with that noise around its
measured median (the fixed configurations' medians taken as their true
tokens/s, each adaptive configuration's true tokens/s the best of them),
takes each one's median run as the sweep does, and counts the sittings in
which every adaptive configuration reads at least GOAL of the best fixed
median at every concurrency.

    python tests/benchmarks/sweep_resolution.py docs/benchmarks/serve_sweep.json \
        [docs/benchmarks/serve_sweep_cost_scaled.json] [--rounds 3 6 20]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

GOAL = 0.97
# `serve_bench.py --control NAME` serves NAME a second time under NAME + this
# suffix.
CONTROL_SUFFIX = "_control"
SITTINGS = 20000


def runs(result: dict) -> list[float]:
    """A configuration's tokens/s run by run (a sweep of one round keeps
    only its run)."""
    return result.get("output_throughput_runs", [result["output_throughput"]])


def run_noise(sweep: dict) -> tuple[float, int] | None:
    """One run's log tokens/s noise from the sweep's control, and the number
    of control/twin run pairs it rests on; None without a control."""
    twin = sweep.get("setup", {}).get("control")
    if not twin:
        return None
    logs = [math.log(a / b)
            for c in sweep if c.isdigit()
            for a, b in zip(runs(sweep[c][twin + CONTROL_SUFFIX]), runs(sweep[c][twin]))]
    # About 1, not about the pairs' mean: an offset between two identical
    # servers is noise for any two servers compared.
    return math.sqrt(sum(x * x for x in logs) / len(logs) / 2), len(logs)


def median_runs(rng: np.random.Generator, true: np.ndarray, noise: float,
                rounds: int) -> np.ndarray:
    """[SITTINGS, len(true)] the median of `rounds` runs of configurations
    whose true tokens/s are `true`, each run off by log-normal `noise`."""
    draws = rng.standard_normal((SITTINGS, len(true), rounds))
    return np.median(true[:, None] * np.exp(noise * draws), axis=-1)


def goal_probability(sweep: dict, noise: float, rounds: int,
                     seed: int = 0) -> tuple[float, list[float]]:
    """The share of simulated sittings (`rounds` runs per configuration) in
    which every adaptive configuration reads at least GOAL of the best fixed
    configuration at every concurrency, and that share per concurrency."""
    rng = np.random.default_rng(seed)
    concurrencies = [c for c in sweep if c.isdigit()]
    passed = np.ones(SITTINGS, dtype=bool)
    per_concurrency = []
    for c in concurrencies:
        results = {n: r for n, r in sweep[c].items()
                   if isinstance(r, dict) and "output_throughput" in r
                   and not n.endswith(CONTROL_SUFFIX)}
        fixed = np.array([r["output_throughput"] for n, r in results.items()
                          if not n.startswith("adaptive")])
        num_adaptive = sum(n.startswith("adaptive") for n in results)
        best_fixed = median_runs(rng, fixed, noise, rounds).max(axis=1)
        adaptive = median_runs(rng, np.full(num_adaptive, fixed.max()), noise, rounds)
        here = (adaptive >= GOAL * best_fixed[:, None]).all(axis=1)
        per_concurrency.append(float(here.mean()))
        passed &= here
    return float(passed.mean()), per_concurrency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="serve_bench.py JSON")
    parser.add_argument("--rounds", type=int, nargs="+",
                        help="also simulate sittings of these many rounds")
    args = parser.parse_args()
    for path in args.sweeps:
        if not path.is_file():
            parser.error(f"no sweep JSON at {path}")
    if any(r < 1 for r in args.rounds or []):
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    together = 1.0
    for path in args.sweeps:
        sweep = json.loads(path.read_text())
        measured = run_noise(sweep)
        if measured is None:
            print(f"{path.name}: no control, nothing to estimate the noise from")
            continue
        noise, pairs = measured
        rounds = sweep["setup"]["rounds"]
        print(f"{path.name}: one run's noise {100 * noise:.1f} % "
              f"(log sd, from {pairs} control/twin pairs)")
        for r in [rounds, *(args.rounds or [])]:
            probability, per_concurrency = goal_probability(sweep, noise, r)
            print(f"  {r} rounds: every adaptive configuration at least {GOAL}x the "
                  f"best fixed at every concurrency in {100 * probability:.1f} % of "
                  "sittings (per concurrency "
                  + ", ".join(f"{100 * p:.0f} %" for p in per_concurrency) + ")")
            if r == rounds:
                together *= probability
    if len(args.sweeps) > 1:
        print(f"all these sweeps as run: {100 * together:.2f} % of sittings")


if __name__ == "__main__":
    main()
