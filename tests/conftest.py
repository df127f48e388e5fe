# SPDX-License-Identifier: Apache-2.0
"""Session-wide: the engines run on vLLM's Model Runner V2 with async
scheduling, as CUDA users run it (tests/engine/model_runner_v2.py); and a
report of every tie-aware identity check of the run, with its tie flips
(tests/engine/identity.py), so a CI log shows them even when green, also
when pytest-xdist runs the tests in worker processes.
"""

import pytest

from tests.engine import model_runner_v2

# The longest modules (CI's --durations), started first: pytest-xdist hands
# whole modules (--dist loadfile) to its workers in collection order, and a
# long one handed out last runs alone at the end.
LONGEST_FIRST = (
    "tests/engine/test_triton_tree_engine.py",
    "tests/engine/test_serve.py",
    "tests/engine/test_sampled_tree_walk.py",
    "tests/engine/test_request_kinds.py",
    "tests/engine/test_nested_trees.py",
)

# Report lines the xdist workers sent back (the controller runs no checks).
WORKER_REPORT_LINES: list[list[str]] = []


def pytest_configure(config):
    # Before any test module imports vLLM.
    model_runner_v2.install()


def pytest_collection_modifyitems(config, items):
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


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
