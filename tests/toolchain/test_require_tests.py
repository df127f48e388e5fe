# SPDX-License-Identifier: Apache-2.0
"""ci/require_tests.py: a pytest run in which no test passed must fail."""

import subprocess
import sys
from pathlib import Path

import pytest

CI_DIR = Path(__file__).resolve().parents[2] / "ci"


def run_pytest(tmp_path: Path, body: str, *args: str) -> int:
    (tmp_path / "test_sample.py").write_text(body)
    env = {"PYTHONPATH": str(CI_DIR)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "require_tests", "-p", "no:cacheprovider",
               "--rootdir", str(tmp_path), str(tmp_path), *args]
    return subprocess.run(command, env=env, capture_output=True, cwd=tmp_path).returncode


@pytest.mark.parametrize("body, args, expected", [
    ("def test_ok():\n    assert True\n", (), 0),
    ("def test_bad():\n    assert False\n", (), 1),
    ("import pytest\n\n@pytest.mark.skip\ndef test_skipped():\n    pass\n", (), 1),
    ("def test_ok():\n    assert True\n", ("-k", "nothing_matches"), 5),
    ("", (), 5),
])
def test_a_run_without_a_passing_test_fails(tmp_path, body, args, expected):
    assert run_pytest(tmp_path, body, *args) == expected
