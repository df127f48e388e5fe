# SPDX-License-Identifier: Apache-2.0
"""ci/require_tests.py: a pytest run in which no test passed, or in which a
test was skipped without being listed as an expected skip, must fail."""

import subprocess
import sys
from pathlib import Path

import pytest

CI_DIR = Path(__file__).resolve().parents[2] / "ci"

PASSING = "def test_ok():\n    assert True\n"
SKIPPED = (
    "import pytest\n\n"
    "def test_skipped():\n    pytest.skip('needs a GPU')\n"
)


def run_pytest(tmp_path: Path, body: str, *args: str, expected_skips: str = "") -> int:
    (tmp_path / "test_sample.py").write_text(body)
    (tmp_path / "expected_skips.txt").write_text(expected_skips)
    env = {"PYTHONPATH": str(CI_DIR)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "require_tests", "-p", "no:cacheprovider",
               "--expected-skips", str(tmp_path / "expected_skips.txt"),
               "--rootdir", str(tmp_path), str(tmp_path), *args]
    return subprocess.run(command, env=env, capture_output=True, cwd=tmp_path).returncode


@pytest.mark.parametrize("body, args, expected", [
    (PASSING, (), 0),
    ("def test_bad():\n    assert False\n", (), 1),
    ("import pytest\n\n@pytest.mark.skip\ndef test_skipped():\n    pass\n", (), 1),
    (PASSING, ("-k", "nothing_matches"), 5),
    ("", (), 5),
])
def test_a_run_without_a_passing_test_fails(tmp_path, body, args, expected):
    assert run_pytest(tmp_path, body, *args) == expected


@pytest.mark.parametrize("expected_skips, expected", [
    ("", 1),
    ("test_sample.py::test_skipped -- needs a GPU\n", 0),
    ("# a comment\ntest_sample.py::* -- needs a GPU\n", 0),
    ("test_sample.py::test_skipped -- needs a network\n", 1),
    ("test_sample.py::test_other -- needs a GPU\n", 1),
])
def test_only_listed_skips_pass(tmp_path, expected_skips, expected):
    assert run_pytest(tmp_path, PASSING + SKIPPED, expected_skips=expected_skips) == expected


def test_a_malformed_expected_skip_fails(tmp_path):
    assert run_pytest(tmp_path, PASSING + SKIPPED,
                      expected_skips="test_sample.py::test_skipped needs a GPU\n") != 0


def test_the_project_list_is_well_formed():
    sys.path.insert(0, str(CI_DIR))
    try:
        from require_tests import EXPECTED_SKIPS, load_expected_skips
    finally:
        sys.path.remove(str(CI_DIR))
    assert all(reason for _, reason in load_expected_skips(EXPECTED_SKIPS))
