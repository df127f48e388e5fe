# SPDX-License-Identifier: Apache-2.0
"""Session-wide: the engines run on vLLM's Model Runner V2 with async
scheduling, as CUDA users run it (tests/engine/model_runner_v2.py); and a
report of every tie-aware identity check of the run, with its tie flips
(tests/engine/identity.py), so a CI log shows them even when green, also
when pytest-xdist runs the tests in worker processes.
"""

import pytest

from tests.engine import model_runner_v2

# Report lines the xdist workers sent back (the controller runs no checks).
WORKER_REPORT_LINES: list[list[str]] = []


def pytest_configure(config):
    # Before any test module imports vLLM.
    model_runner_v2.install()


def pytest_report_header(config):
    return "model runner: V2 (Triton interpreter, async scheduling)"


def report_lines() -> list[str]:
    from tests.engine.identity import IDENTITY_REPORTS

    lines = []
    for report in IDENTITY_REPORTS:
        lines.append(report.summary())
        lines += [f"  tie flip: {flip}" for flip in report.tie_flips]
    return lines


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["identity_report_lines"] = report_lines()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    WORKER_REPORT_LINES.append(node.workeroutput.get("identity_report_lines", []))


def pytest_terminal_summary(terminalreporter):
    lines = report_lines() + [line for lines in WORKER_REPORT_LINES for line in lines]
    checks = [line for line in lines if not line.startswith("  ")]
    if not checks:
        return
    terminalreporter.section("greedy identity (tie-aware), Model Runner V2")
    for line in lines:
        terminalreporter.write_line(line)
    num_flips = len(lines) - len(checks)
    terminalreporter.write_line(
        f"{len(checks)} identity checks, {num_flips} tie flips in all"
    )
