# SPDX-License-Identifier: Apache-2.0
"""`apply.py drift`: the series replayed on another release's sdist, on
fixture releases (no vLLM, no network)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import git
import pytest

from tests.toolchain.test_apply import HEADER, ROOT, commit_all, make_sdist, run

sys.path.insert(0, str(ROOT))
import apply  # noqa: E402

VERSION, COMMIT, NEXT = "9.9.0", "gabc1234", "10.0.0"


def numbered(name: str, count: int = 20) -> str:
    return "".join(f"{name}_{i} = {i}\n" for i in range(count))


BASE_FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": f"__version__ = version = '{VERSION}'\n__commit_id__ = commit_id = '{COMMIT}'\n",
    **{f"vllm/{name}.py": numbered(name) for name in ("a", "b", "c", "d", "gone")},
}


def edit(text: str, line: str, new: str) -> str:
    assert line in text
    return text.replace(line, new)


# The next release: b.py gains lines on top (the patch's hunk moves), c.py
# changes a line in the patch's context (two lines from its change), d.py
# changes the very line a patch changes, gone.py is deleted.
NEXT_FILES = {
    **BASE_FILES,
    "vllm/_version.py": BASE_FILES["vllm/_version.py"].replace(VERSION, NEXT),
    "vllm/b.py": "# new\n# lines\n# on top\n" + BASE_FILES["vllm/b.py"],
    "vllm/c.py": edit(BASE_FILES["vllm/c.py"], "c_8 = 8\n", "c_8 = 'next'\n"),
    "vllm/d.py": edit(BASE_FILES["vllm/d.py"], "d_3 = 3\n", "d_3 = 'next'\n"),
}
del NEXT_FILES["vllm/gone.py"]

# (subject, {file: [(line, replacement)]}): each commit is one patch.
SERIES = [
    ("Exact", {"vllm/a.py": [("a_10 = 10", "a_10 = 'tree'")]}),
    ("Offset", {"vllm/b.py": [("b_10 = 10", "b_10 = 'tree'")]}),
    ("Three way", {"vllm/c.py": [("c_10 = 10", "c_10 = 'tree'")]}),
    ("Conflict", {"vllm/d.py": [("d_3 = 3", "d_3 = 'tree'"), ("d_17 = 17", "d_17 = 'tree'")]}),
    ("Gone", {"vllm/gone.py": [("gone_5 = 5", "gone_5 = 'tree'")]}),
    ("Partly gone", {"vllm/a.py": [("a_16 = 16", "a_16 = 'tree'")],
                     "vllm/gone.py": [("gone_15 = 15", "gone_15 = 'tree'")]}),
    # Lands only on what the conflicting patch landed (its second hunk).
    ("After the conflict", {"vllm/d.py": [("d_17 = 'tree'", "d_17 = 'tree again'")]}),
]


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture
def releases(tmp_path: Path) -> dict:
    pristine = tmp_path / "pristine"
    write_files(pristine, BASE_FILES)
    repo = git.Repo.init(pristine, initial_branch="main")
    commit_all(repo, "pristine")
    repo.create_tag(f"v{VERSION}")

    work = tmp_path / "work"
    work_repo = git.Repo.clone_from(pristine, work)
    for subject, edits in SERIES:
        for name, changes in edits.items():
            text = (work / name).read_text()
            for line, new in changes:
                text = edit(text, line + "\n", new + "\n")
            (work / name).write_text(text)
        commit_all(work_repo, f"[Spec Decode] {subject}\n\n" + HEADER.format(why=subject))

    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps({"version": VERSION, "commit": COMMIT,
                               "index_url": "http://127.0.0.1:9/simple", "artifacts": {}}))
    patches = tmp_path / "patches"
    common = ["--pin", str(pin), "--patches", str(patches), "--vllm-src", str(pristine)]
    assert apply.main(["export", "--vllm-src", str(work), "--pin", str(pin),
                       "--patches", str(patches)]) == 0

    sdist = tmp_path / f"vllm-{NEXT}.tar.gz"
    make_sdist(sdist, NEXT_FILES)
    return {"tmp": tmp_path, "pristine": pristine, "common": common, "sdist": sdist}


def report_lines(out: str) -> dict[str, str]:
    return {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
            for line in out.splitlines() if line.startswith("  0")}


def test_drift_names_how_each_patch_lands(releases, capsys):
    pristine = git.Repo(releases["pristine"])
    head, refs = pristine.head.commit.hexsha, sorted(str(r) for r in pristine.refs)
    code, out = run(capsys, "drift", str(releases["sdist"]), *releases["common"])
    assert code == 0, out
    assert f"Drift of 7 patches ({VERSION}) on vLLM {NEXT}:" in out
    assert report_lines(out) == {
        "0001-Spec-Decode-Exact.patch": "applies exactly",
        "0002-Spec-Decode-Offset.patch": "applies at an offset",
        "0003-Spec-Decode-Three-way.patch": "applies by a clean three-way merge",
        "0004-Spec-Decode-Conflict.patch": "conflicts: 1 of 2 hunks (vllm/d.py 1)",
        "0005-Spec-Decode-Gone.patch": "every file it changes is gone (1 hunk: vllm/gone.py 1)",
        "0006-Spec-Decode-Partly-gone.patch":
            "applies exactly; gone files (1 hunk: vllm/gone.py 1)",
        "0007-Spec-Decode-After-the-conflict.patch": "applies exactly",
    }
    assert (f"On vLLM {NEXT}: 3 exact, 1 at an offset, 1 by a clean three-way merge, "
            "1 with conflicts (1 of 7 hunks, in 1 file), 1 only on gone files; "
            "2 hunks on gone files in all") in out
    # The pinned checkout is only read.
    assert pristine.head.commit.hexsha == head
    assert sorted(str(r) for r in pristine.refs) == refs
    assert not pristine.is_dirty(untracked_files=True)


def test_drift_keeps_what_landed_for_the_rebase(releases, capsys):
    keep = releases["tmp"] / "rebase"
    code, out = run(capsys, "drift", str(releases["sdist"]), "--keep", str(keep),
                    *releases["common"])
    assert code == 0, out
    assert f"what landed is committed in {keep}" in out
    repo = git.Repo(keep)
    assert not (keep / ".git" / "objects" / "info" / "alternates").exists()
    repo.git.fsck("--full")
    subjects = [c.summary for c in repo.iter_commits()][::-1]
    # Patch 0005 landed nothing: it has no commit.
    assert subjects == [
        f"vLLM {NEXT}, official sdist",
        "[Spec Decode] Exact (exact)",
        "[Spec Decode] Offset (offset)",
        "[Spec Decode] Three way (three-way)",
        "[Spec Decode] Conflict (conflict)",
        "[Spec Decode] Partly gone (exact)",
        "[Spec Decode] After the conflict (exact)",
    ]
    d = (keep / "vllm/d.py").read_text()
    assert "d_3 = 'next'\n" in d and "d_17 = 'tree again'\n" in d
    assert "c_8 = 'next'\n" in (keep / "vllm/c.py").read_text()
    assert "c_10 = 'tree'\n" in (keep / "vllm/c.py").read_text()
    assert not list(keep.rglob("*.rej"))
    assert not repo.is_dirty(untracked_files=True)

    code, out = run(capsys, "drift", str(releases["sdist"]), "--keep", str(keep),
                    *releases["common"])
    assert code == 1 and f"{keep} exists" in out


@pytest.mark.parametrize("release, message", [
    ("next", "next is neither an sdist file nor a vLLM version"),
    ("README.md", "README.md is not a vLLM sdist"),
])
def test_drift_refuses_what_is_not_a_release(releases, capsys, release, message, monkeypatch):
    monkeypatch.chdir(releases["pristine"].parent)
    (releases["pristine"].parent / "README.md").write_text("not a tarball\n")
    code, out = run(capsys, "drift", release, *releases["common"])
    assert code == 1 and message in out
