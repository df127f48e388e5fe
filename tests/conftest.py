# SPDX-License-Identifier: Apache-2.0
"""Session-wide: the engines run on vLLM's Model Runner V2 with async
scheduling, as CUDA users run it (tests/engine/model_runner_v2.py); and a
report of every tie-aware identity check of the run, with its tie flips
(tests/engine/identity.py), so a CI log shows them even when green.
"""

from tests.engine import model_runner_v2


def pytest_configure(config):
    # Before any test module imports vLLM.
    model_runner_v2.install()


def pytest_report_header(config):
    return "model runner: V2 (Triton interpreter, async scheduling)"


def pytest_terminal_summary(terminalreporter):
    from tests.engine.identity import IDENTITY_REPORTS

    if not IDENTITY_REPORTS:
        return
    terminalreporter.section("greedy identity (tie-aware), Model Runner V2")
    for report in IDENTITY_REPORTS:
        terminalreporter.write_line(report.summary())
        for flip in report.tie_flips:
            terminalreporter.write_line(f"  tie flip: {flip}")
    total = sum(len(r.tie_flips) for r in IDENTITY_REPORTS)
    terminalreporter.write_line(
        f"{len(IDENTITY_REPORTS)} identity checks, {total} tie flips in all"
    )
