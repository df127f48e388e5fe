# SPDX-License-Identifier: Apache-2.0
"""The device script stays runnable where no GPU is: its --smoke mode under
Triton's interpreter, on the patched tree ci/test.sh lays out."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHED_OPS = ROOT / "build" / "vllm-patched" / "vllm" / "v1" / "attention" / "ops"
SCRIPT = ROOT / "tests" / "gpu" / "run_device_checks.py"


def test_device_checks_smoke_under_the_triton_interpreter(tmp_path):
    pytest.importorskip("triton")
    if not (PATCHED_OPS / "triton_unified_attention.py").exists():
        pytest.skip(
            "no patched tree in build/vllm-patched (bash ci/test.sh lays it out)"
        )
    out = tmp_path / "device.json"
    result = subprocess.run(
        # No time limit: which timings run must not depend on this machine's
        # clock (the subprocess timeout stays, against a hang).
        [sys.executable, str(SCRIPT), "--smoke", "--time-limit-s", "inf", "--out", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all correctness checks passed" in result.stdout
    summary = json.loads(out.read_text())
    # The dropped mask must change rows, for each shape.
    assert all(
        r["negative_control_bad_rows"] > 0 for r in summary["correctness"].values()
    )

    replays = summary["graph_replay"]
    cases = {n: r for n, r in replays.items() if isinstance(r, dict)}
    assert len(cases) == 4 and all(r["passed"] for r in cases.values()), replays
    assert replays["negative_control_bad_rows"] > 0

    # Trees that fit 32 rows are timed with int32 and int64 masks.
    for point in summary["timings"].values():
        if isinstance(point, dict):
            assert "model_ms_int64_masks" in point["tree_12"]
            assert "model_ms_int64_masks" not in point["tree_32"]

    # The walk, rows and KV commit kernels: every case equal to the
    # interpreter's run in a subprocess, the control caught, all timed.
    kernels = summary["tree_kernels"]
    for name in ("walk", "rows", "kv_commit"):
        assert kernels[name]["passed"] and kernels[name]["cases"] > 0, kernels[name]
    assert kernels["walk"]["negative_control_mismatched_cases"] > 0
    assert kernels["timings"]["kv_commit"]["word_bytes"] == 8
    assert kernels["timings"]["walk_us"] > 0 and kernels["timings"]["rows_us"] > 0

    # The captured tree draft step: replays equal the eager drafts and the
    # drafter before capture, stale roots caught, every mode timed.
    drafts = summary["draft_step"]
    assert drafts["check"]["passed"], drafts["check"]
    assert drafts["check"]["nodes_compared"] > 0
    assert drafts["check"]["negative_control_requests_changed"] > 0
    for point in drafts["by_tree"]["smoke"].values():
        assert set(point) == {"before", "eager", "graph"}
        assert all(t["host_us"] > 0 and t["step_ms"] > 0 for t in point.values())

    step = summary["verify_step"]
    assert step["consistency"]["passed"], step["consistency"]
    assert not step["skipped_past_time_limit"]
    for batch in (1, 2):
        point = step[f"ctx 40 batch {batch}"]
        assert set(point["verify_ms_by_num_nodes"]) == {"0", "3", "12"}
        by_config = point["projected"]["by_config"]
        # Every configuration of at most 12 nodes is projected, plain's step
        # being its verify forward alone.
        assert {"plain", "chain K=3", "tree K=3 W=4", "planned 12"} <= by_config.keys()
        assert (
            by_config["plain"]["step_ms"] == point["verify_ms_by_num_nodes"]["0"]["ms"]
        )
        assert point["projected"]["schedule_num_nodes"] in (0, 3, 12)


def test_figures_in_the_doc_are_the_committed_json_s():
    """docs/benchmarks-gpu.md shows what docs/benchmarks-gpu.json holds (empty
    tables while no GPU has run the script)."""
    sys.path.insert(0, str(ROOT))
    from tests.gpu.run_device_checks import FIGURES_BEGIN, FIGURES_END, render

    figures = ROOT / "docs" / "benchmarks-gpu.json"
    summary = json.loads(figures.read_text()) if figures.exists() else None
    doc = (ROOT / "docs" / "benchmarks-gpu.md").read_text()
    shown = doc.split(FIGURES_BEGIN + "\n")[1].split(FIGURES_END)[0]
    assert shown == render(summary)
