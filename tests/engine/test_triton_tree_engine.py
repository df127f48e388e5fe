# SPDX-License-Identifier: Apache-2.0
"""Tree verify through the TRITON_ATTN backend in the real engine, on CPU:
its kernels under Triton's interpreter (triton_interpreter_engine.py, in a
subprocess). The Gemma 4 MTP tree must match plain greedy decoding through
the same backend, with accepted and rescued tokens, and must stop matching
when the kernel's ancestor mask is dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).with_name("triton_interpreter_engine.py")


def test_tree_through_triton_attn_matches_plain_greedy():
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    report = json.loads(lines[-1].removeprefix("RESULT "))
    tree, control = report["tree"], report["tree_without_mask"]
    print(
        tree["summary"],
        f"drafts {tree['num_drafts']}, accepted "
        f"{tree['num_accepted_tokens']}, rescued per depth "
        f"{tree['num_rescued_tokens_per_pos']}",
    )
    print(control["summary"])

    for run in ("plain", "tree", "tree_without_mask"):
        assert report[f"{run}_backends"] == ["TRITON_ATTN"]
    assert tree["identical"] and tree["mismatches"] == 0
    assert tree["num_accepted_tokens"] > 0
    assert sum(tree["num_rescued_tokens_per_pos"]) > 0
    assert control["mismatches"] > 0
