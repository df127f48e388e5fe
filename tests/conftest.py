# SPDX-License-Identifier: Apache-2.0
"""Session-wide report: every tie-aware identity check of the run, with its
tie flips (tests/engine/identity.py), so a CI log shows them even when green."""


def pytest_terminal_summary(terminalreporter):
    from tests.engine.identity import IDENTITY_REPORTS

    if not IDENTITY_REPORTS:
        return
    terminalreporter.section("greedy identity (tie-aware)")
    for report in IDENTITY_REPORTS:
        terminalreporter.write_line(report.summary())
        for flip in report.tie_flips:
            terminalreporter.write_line(f"  tie flip: {flip}")
    total = sum(len(r.tie_flips) for r in IDENTITY_REPORTS)
    terminalreporter.write_line(
        f"{len(IDENTITY_REPORTS)} identity checks, {total} tie flips in all"
    )
