# SPDX-License-Identifier: Apache-2.0
"""Session-wide: which model runner the engines run on, and a report of every
tie-aware identity check of the run, with its tie flips
(tests/engine/identity.py), so a CI log shows them even when green.

`TREE_TEST_MODEL_RUNNER=v2 pytest` runs the tests marked `model_runner_v2`
(runner-independent proofs, and proofs about V2 marked `only=True`) on vLLM's
Model Runner V2 with async scheduling, as CUDA users run it
(tests/engine/model_runner_v2.py); without it every other test runs on the
V1 runner, the CPU build's default.
"""

from tests.engine import model_runner_v2

RUNNER_V2_MARKER = "model_runner_v2"


def pytest_configure(config):
    if model_runner_v2.requested():
        # Before any test module imports vLLM.
        model_runner_v2.install()


def runs_on_this_runner(item) -> bool:
    """Every test runs on V1 but those marked `model_runner_v2(only=True)`
    (proofs about V2 itself); on V2 the tests marked `model_runner_v2`."""
    marker = item.get_closest_marker(RUNNER_V2_MARKER)
    if model_runner_v2.requested():
        return marker is not None
    return marker is None or not marker.kwargs.get("only", False)


def pytest_collection_modifyitems(config, items):
    deselected = [item for item in items if not runs_on_this_runner(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if runs_on_this_runner(item)]


def pytest_report_header(config):
    if model_runner_v2.requested():
        return "model runner: V2 (Triton interpreter, async scheduling)"
    return "model runner: V1"


def pytest_terminal_summary(terminalreporter):
    from tests.engine.identity import IDENTITY_REPORTS

    if not IDENTITY_REPORTS:
        return
    runner = "Model Runner V2" if model_runner_v2.requested() else "Model Runner V1"
    terminalreporter.section(f"greedy identity (tie-aware), {runner}")
    for report in IDENTITY_REPORTS:
        terminalreporter.write_line(report.summary())
        for flip in report.tie_flips:
            terminalreporter.write_line(f"  tie flip: {flip}")
    total = sum(len(r.tie_flips) for r in IDENTITY_REPORTS)
    terminalreporter.write_line(
        f"{len(IDENTITY_REPORTS)} identity checks, {total} tie flips in all"
    )
