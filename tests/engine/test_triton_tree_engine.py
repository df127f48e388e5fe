# SPDX-License-Identifier: Apache-2.0
"""Tree verify through the TRITON_ATTN backend in the real engine, on CPU:
its kernels under Triton's interpreter (triton_interpreter_engine.py, in a
subprocess). Every tree the CPU_ATTN tests prove (Gemma 4 MTP K=3 W=4, a
continuation tree, the planned 32-node tree, draft_model K=3 W=4) must match
plain greedy decoding through the same backend, with accepted and rescued
tokens, and the first must stop matching when the kernel's ancestor mask is
dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).with_name("triton_interpreter_engine.py")


def test_trees_through_triton_attn_match_plain_greedy():
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=1800
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    report = json.loads(lines[-1].removeprefix("RESULT "))
    control = report.pop("mtp_k3_w4_without_mask")
    assert report.pop("plain_backends") == ["TRITON_ATTN"]
    for name, tree in report.items():
        print(f"{name}: {tree['summary']}, drafts {tree['num_drafts']}, accepted per depth "
              f"{tree['num_accepted_tokens_per_pos']}, rescued per depth "
              f"{tree['num_rescued_tokens_per_pos']}")
    print(f"negative control: {control['summary']}")

    assert set(report) == {"mtp_k3_w4", "mtp_continuation_12", "mtp_planned_32",
                           "draft_model_k3_w4"}
    for name, tree in report.items():
        assert tree["backends"] == ["TRITON_ATTN"], name
        assert tree["identical"] and tree["mismatches"] == 0, name
        assert tree["num_accepted_tokens"] > 0, name
        assert sum(tree["num_rescued_tokens_per_pos"]) > 0, name
    assert control["backends"] == ["TRITON_ATTN"]
    assert control["mismatches"] > 0
