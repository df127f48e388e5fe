# SPDX-License-Identifier: Apache-2.0
"""`apply.py build` on the real pinned artifacts: both targets, checked member
by member against the replayed stack and the official binary wheel."""

from __future__ import annotations

import csv
import io
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import apply  # noqa: E402


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_build_overlays_the_stack_on_the_pinned_wheel(target, tmp_path, capsys):
    assert apply.main(["build", "--target", target, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Built " in out

    pin = apply.load_pin()
    patches = apply.read_series(apply.PATCH_DIR)
    repo = apply.open_repo(apply.DEFAULT_SRC)
    base = repo.commit(pin.tag).hexsha
    tip = apply.replay_stack(repo, base, patches)
    version = apply.stack_version(pin, patches)

    (wheel,) = tmp_path.glob("*.whl")
    binary = apply.DEFAULT_CACHE / pin.artifacts[target].filename
    layout = apply.release_layout(repo, base, pin, pin.artifacts[target], binary,
                                  apply.DEFAULT_CACHE, pin.index_url)
    changes = {**layout, **apply.wheel_changes(repo, base, tip, binary, layout)}
    dist = binary.name.split("-")[0]
    # The CPU binary is the compiled_from release's: its version, not the pin's.
    binary_version = binary.name.split("-")[1]
    assert wheel.name == binary.name.replace(f"-{binary_version}-", f"-{version}-")
    assert "+tree." in version

    with zipfile.ZipFile(wheel) as built, zipfile.ZipFile(binary) as official:
        assert built.testzip() is None
        info = f"{dist}-{version}.dist-info"
        rows = list(csv.reader(io.StringIO(built.read(f"{info}/RECORD").decode())))
        assert sorted(r[0] for r in rows) == sorted(built.namelist())
        official_names = {n for n in official.namelist() if ".dist-info/" not in n}
        built_names = {n for n in built.namelist() if ".dist-info/" not in n}
        assert built_names == (official_names | {p for p, d in changes.items() if d is not None}) - {
            p for p, d in changes.items() if d is None
        }
        for path, data in changes.items():
            if data is not None:
                assert built.read(path) == data, path
        by_name = {r[0]: r for r in rows}
        for path in list(changes)[:50] + [f"{info}/METADATA"]:
            if path in by_name:
                data = built.read(path)
                assert by_name[path][1] == apply.record_hash(data), path
        assert f"Version: {version}" in built.read(f"{info}/METADATA").decode()


def test_the_stack_checks_on_the_pinned_release(capsys):
    """Every patch applies exactly, re-exports byte for byte, leaves the files
    it changes clean under vLLM's own ruff, and leaves every module the series
    has changed so far importable from the CPU wheel (`apply.py check
    --target cpu`): the series bisects."""
    assert apply.main(["check", "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "pass vLLM's lint" in out
    assert "modules it changed import from the cpu wheel" in out
