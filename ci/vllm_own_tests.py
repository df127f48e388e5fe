# SPDX-License-Identifier: Apache-2.0
"""pytest plugin (`-p vllm_own_tests`, ci/ on PYTHONPATH): vLLM's own tests,
from the pinned release's tree, against the installed CPU wheel, offline.

- The tree holds `vllm.egg-info` (version without "+cpu"): once pytest puts
  the tree on sys.path, vLLM no longer detects its CPU build and resolves no
  platform (SIGILL in `vllm._C`, "no accelerator" in vLLM's cleanup
  fixture). VLLM_TARGET_DEVICE=cpu, set before vLLM's tests/conftest.py
  imports vllm, is the override vLLM itself honours.
- vLLM 0.34.0 runs x86 CPUs only with triton-cpu, which no registry serves:
  Triton's interpreter stands in, as in the project's engine tests
  (tests/engine/model_runner_v2.py, loaded by path: vLLM's tree has its own
  `tests` package).
- Tests that build a `ModelConfig` of a hub model need its config.json:
  tests/fixtures/hf_hub holds them (SOURCES.md there), laid out as a
  Hugging Face cache in build/hf-hub, with the hub itself offline.
- `--vllm-test-timeout`: seconds per test, setup to teardown (SIGALRM), so
  a hung test fails by name instead of stalling CI.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HUB_FIXTURES = ROOT / "tests" / "fixtures" / "hf_hub"
HUB_CACHE = ROOT / "build" / "hf-hub"


def git_blob_sha1(data: bytes) -> str:
    """What the hub names a non-LFS file's blob by."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out_hub_cache(fixtures: Path, cache: Path) -> None:
    """fixtures/ORG--NAME/<files> as a Hugging Face hub cache: blobs, one
    snapshot (the hub's commit in COMMIT, else one derived from the files)
    and refs/main."""
    shutil.rmtree(cache, ignore_errors=True)
    for model in sorted(p for p in fixtures.iterdir() if p.is_dir()):
        files = sorted(p for p in model.iterdir() if p.name != "COMMIT")
        commit_file = model / "COMMIT"
        if commit_file.exists():
            commit = commit_file.read_text().strip()
        else:
            digest = hashlib.sha1()
            for path in files:
                digest.update(path.name.encode() + path.read_bytes())
            commit = digest.hexdigest()
        repo = cache / f"models--{model.name}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (repo / "blobs").mkdir()
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        for path in files:
            data = path.read_bytes()
            blob = git_blob_sha1(data)
            (repo / "blobs" / blob).write_bytes(data)
            (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))


def use_triton_interpreter() -> None:
    spec = importlib.util.spec_from_file_location(
        "_tree_model_runner_v2", ROOT / "tests" / "engine" / "model_runner_v2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.use_triton_interpreter()


# At plugin import: before vLLM's tests/conftest.py imports vllm.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(HUB_CACHE)
if os.environ.get("PYTEST_XDIST_WORKER") is None:
    lay_out_hub_cache(HUB_FIXTURES, HUB_CACHE)
use_triton_interpreter()


def pytest_addoption(parser):
    parser.addoption("--vllm-test-timeout", type=float, default=0.0,
                     help="seconds per test, setup to teardown; 0: no limit")


def pytest_configure(config):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise pytest.UsageError(
            f"vllm_own_tests: vLLM resolved {type(current_platform).__name__}, "
            "not its CPU platform")


def pytest_report_header(config):
    return "vLLM's own tests: CPU platform, Triton's interpreter, offline hub cache"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = item.config.getoption("--vllm-test-timeout")
    if not seconds:
        yield
        return

    def timed_out(signum, frame):
        raise TimeoutError(f"{item.nodeid} ran over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
