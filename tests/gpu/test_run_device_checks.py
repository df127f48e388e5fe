# SPDX-License-Identifier: Apache-2.0
"""The device script stays runnable where no GPU is: its --smoke mode under
Triton's interpreter, on the patched tree ci/test.sh lays out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHED_OPS = ROOT / "build" / "vllm-patched" / "vllm" / "v1" / "attention" / "ops"


def test_device_checks_smoke_under_the_triton_interpreter():
    pytest.importorskip("triton")
    if not (PATCHED_OPS / "triton_unified_attention.py").exists():
        pytest.skip("no patched tree in build/vllm-patched (bash ci/test.sh lays it out)")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "run_device_checks.py"), "--smoke"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all correctness checks passed" in result.stdout
    # The dropped mask must change rows, for each shape.
    assert "mask dropped: 0 rows" not in result.stdout
