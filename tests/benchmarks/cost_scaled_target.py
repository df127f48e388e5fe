# SPDX-License-Identifier: Apache-2.0
"""A copy of the trained tiny Gemma 4 target whose decode step costs what
arithmetic costs, not what per-step overhead does: every layer's MLP is
widened with zero-valued channels (384 -> 49,152 by default), so each row
through the model does ~130x the MLP work while the outputs stay those of the
trained target (up to float rounding: gate and up rows of zeros give
gelu(0) * 0 = 0, and their down-projection columns are zeros too). The MTP
assistant is unchanged and drafts for it as for the original.

On this CPU the trained target's step is mostly per-step overhead, so
speculation never pays; on this copy it pays at low batch and not at high
batch, as on a GPU with a large model: the second sweep of issue 20
(`serve_bench.py --target cost_scaled`).

    build/test-venv/bin/python tests/benchmarks/cost_scaled_target.py

writes build/fixtures/cost_scaled_target/ (303 MB at the default width) and
prints its size; serve_bench.py builds it itself when it is missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINED_TARGET = ROOT / "tests" / "fixtures" / "tiny_gemma4_trained" / "target"
DEFAULT_OUT = ROOT / "build" / "fixtures" / "cost_scaled_target"
DEFAULT_WIDTH = 49_152


def build(out: Path = DEFAULT_OUT, width: int = DEFAULT_WIDTH) -> Path:
    """Writes the widened target to `out` (unless it is there already, at
    this width) and returns `out`."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((TRAINED_TARGET / "config.json").read_text())
    if (out / "config.json").exists():
        if json.loads((out / "config.json").read_text())["intermediate_size"] == width:
            return out
    if width < config["intermediate_size"]:
        raise SystemExit(f"--width {width} is below the trained target's "
                         f"intermediate_size {config['intermediate_size']}")
    print(f"Writing the cost-scaled target (MLP {config['intermediate_size']} -> "
          f"{width}) to {out}", flush=True)
    tensors = load_file(TRAINED_TARGET / "model.safetensors")
    for name, weight in list(tensors.items()):
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            widened = torch.zeros(width, weight.shape[1], dtype=weight.dtype)
            widened[: weight.shape[0]] = weight
            tensors[name] = widened
        elif name.endswith("mlp.down_proj.weight"):
            widened = torch.zeros(weight.shape[0], width, dtype=weight.dtype)
            widened[:, : weight.shape[1]] = weight
            tensors[name] = widened
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(TRAINED_TARGET, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config["intermediate_size"] = width
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH,
                        help="the widened MLP's intermediate size")
    args = parser.parse_args()
    out = build(args.out, args.width)
    size = (out / "model.safetensors").stat().st_size
    print(f"{out}: {size / 1e6:.0f} MB of weights", flush=True)


if __name__ == "__main__":
    sys.exit(main())
