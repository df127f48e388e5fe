# SPDX-License-Identifier: Apache-2.0
"""pytest plugin for CI (`-p require_tests`, ci/ on PYTHONPATH): a run passes
only if some test passed and every skip was expected.

- A run in which no test passed fails, even if nothing failed, so a suite
  that was skipped or deselected entirely can never look green.
- Every skip must be listed in the expected-skips file (`--expected-skips`,
  default ci/expected_skips.txt) by test id and reason; any other skip fails
  the run, naming the test and the reason it gave.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

EXPECTED_SKIPS = Path(__file__).with_name("expected_skips.txt")
SEPARATOR = " -- "


def pytest_addoption(parser):
    parser.addoption(
        "--expected-skips", default=str(EXPECTED_SKIPS),
        help="file of the skips a run may have: one '<test id glob> -- <reason>' "
        "per line, the reason being text the skip's reason contains",
    )


def load_expected_skips(path: Path) -> list[tuple[str, str]]:
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test_id, separator, reason = line.partition(SEPARATOR)
        if not separator or not test_id.strip() or not reason.strip():
            raise ValueError(
                f"{path}:{number}: expected '<test id glob>{SEPARATOR}<reason>', "
                f"got {line!r}"
            )
        entries.append((test_id.strip(), reason.strip()))
    return entries


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        # A pytest-xdist worker: the controller sees every report.
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    expected = load_expected_skips(Path(session.config.getoption("expected_skips")))
    unexpected = [
        (report.nodeid, skip_reason(report))
        for report in reporter.stats.get("skipped", [])
        if not any(
            fnmatchcase(report.nodeid, test_id) and reason in skip_reason(report)
            for test_id, reason in expected
        )
    ]
    for test_id, reason in unexpected:
        reporter.write_line(f"error: unexpected skip: {test_id}: {reason}", red=True)
    if unexpected:
        reporter.write_line(
            f"error: {len(unexpected)} skips not listed in "
            f"{session.config.getoption('expected_skips')}",
            red=True,
        )
        session.exitstatus = 1
    if not reporter.stats.get("passed"):
        reporter.write_line("error: no test passed in this run", red=True)
        session.exitstatus = 1
