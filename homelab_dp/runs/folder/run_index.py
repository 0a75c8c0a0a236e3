"""Where runs live, and the per-user index that finds any of them from any folder.

The runs root is ``$HOMELAB_DP_RUNS`` if set, else ``$XDG_DATA_HOME/homelab-dp/runs``
(``~/.local/share/homelab-dp/runs``). Every run folder also gets one line in the per-user index
``$XDG_DATA_HOME/homelab-dp/index.jsonl`` (``{"id", "path", "created"}``), appended with
O_APPEND in a single write so concurrent runs never interleave or tear lines. `known_runs`
merges the index with the run folders under the current root and under ``./runs`` (where runs
went before the per-user root), so a run is found by id wherever it was made.

This module sits under `files` (which re-exports `runs_root`): it imports nothing of the run
folder's other modules, so `files.create_run_dir` can call `register` without an import circle.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from homelab_dp import json_safe
from homelab_dp.errors import RunNotFoundError
from homelab_dp.user_files.paths import data_home, ensure_private_dir
from homelab_dp.user_files.private_write import write_whole

RUNS_ENV = "HOMELAB_DP_RUNS"
INDEX_NAME = "index.jsonl"
LEGACY_RUNS = "runs"
"""Runs made before the per-user root went to ``./runs`` of the folder they were started in."""
_HINT = "`homelab-dp runs` lists every run it knows, with its folder"


class RunUnknownError(RunNotFoundError):
    """No known run has that id or id prefix."""


class RunAmbiguousError(RunNotFoundError):
    """An id prefix that matches several runs."""


class RunGoneError(RunNotFoundError):
    """The index knows the run, but its folder is no longer there."""


@dataclass(frozen=True)
class IndexedRun:
    """One run the index or a scan knows of."""

    id: str
    """The run id (the folder's name)."""
    path: Path
    """The run folder, resolved (symlinks followed)."""
    exists: bool
    """Whether the folder is still there; False: moved or deleted. A folder that is there but
    lacks a readable spec.json is a damaged run (its commands say what is wrong), not gone."""
    created: float | None = None
    """When it was registered (Unix time), if known."""


def runs_root() -> Path:
    """The runs folder: ``$HOMELAB_DP_RUNS``, else the per-user ``data_home()/runs``."""
    env = os.environ.get(RUNS_ENV)
    return Path(env).expanduser().absolute() if env else data_home() / "runs"


def index_path() -> Path:
    """The per-user run index file."""
    return data_home() / INDEX_NAME


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run folder (it holds spec.json)."""
    try:
        return (path / "spec.json").is_file()
    except OSError:  # e.g. a folder we may not enter
        return False


RUN_FILES = ("spec.json", "state.json", "events.jsonl")
"""A folder holding any of these is a run's (one without spec.json is a damaged run)."""


def looks_like_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run folder, whole or damaged: a visible folder that holds one of
    `RUN_FILES`. Hidden folders (``.tmp-…``, a run being made) are never runs."""
    if path.name.startswith("."):
        return False
    try:
        return path.is_dir() and any((path / name).exists() for name in RUN_FILES)
    except OSError:
        return False


def _folder_exists(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def register(run_dir: Path, created: float | None = None) -> None:
    """Record a run folder in the per-user index (one line, one O_APPEND write, file 0600)."""
    ensure_private_dir(data_home())
    path = Path(run_dir).resolve()
    line = json_safe.dumps({"id": path.name, "path": str(path), "created": created or time.time()})
    data = (line + "\n").encode("utf-8")
    while True:
        fd = os.open(index_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            # Appenders share the lock (O_APPEND alone keeps their lines whole); `forget_gone`
            # takes it alone to rewrite the file, and a file it replaced meanwhile is retried.
            fcntl.flock(fd, fcntl.LOCK_SH)
            if _same_file(fd):
                written = os.write(fd, data)
                break
        finally:
            os.close(fd)
    if written != len(data):
        raise OSError(f"{index_path()}: short write ({written} of {len(data)} bytes)")


def _same_file(fd: int) -> bool:
    """Whether ``fd`` is still the index file (not one `forget_gone` has replaced)."""
    try:
        return os.fstat(fd).st_ino == os.stat(index_path()).st_ino
    except FileNotFoundError:
        return False


def forget_gone() -> list[IndexedRun]:
    """Drop the index lines of runs whose folder has gone; return the runs forgotten."""
    try:
        fd = os.open(index_path(), os.O_RDWR)
    except FileNotFoundError:
        return []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # no append in flight, none until the file is replaced
        with open(fd, "rb", closefd=False) as fh:
            lines = fh.read().splitlines()
        keep, gone = [], []
        for line, run in zip(lines, map(_parse, lines), strict=True):
            if run is not None and not _folder_exists(run.path):
                gone.append(run)
            else:  # lines it cannot read are kept as they are: forgetting is for gone runs only
                keep.append(line)
        if gone:
            write_whole(index_path(), b"".join(line + b"\n" for line in keep), mode=0o600)
    finally:
        os.close(fd)
    return list({run.path: run for run in gone}.values())  # a run indexed twice: once


def _parse(line: bytes) -> IndexedRun | None:
    """One index line, or None for a line a crash left unfinished or that is not UTF-8 JSON.
    The id is the folder's name: the folder, not the line, says which run it is (a line whose
    "id" names another run never opens this folder under that id)."""
    try:
        doc = json.loads(line.decode("utf-8"))
        created = doc.get("created")
        path = Path(doc["path"])
        if not path.name or not path.is_absolute():
            return None
        return IndexedRun(path.name, path, False, float(created or 0) or None)
    except (ValueError, KeyError, TypeError, AttributeError):  # UnicodeDecodeError included
        return None


def _indexed() -> list[IndexedRun]:
    """The index's lines, in order; unreadable lines (a crash mid-write) are skipped."""
    try:
        data = index_path().read_bytes()  # bytes: one line that is not UTF-8 spoils only itself
    except OSError:  # none yet, or unreadable: the scans still find what is in reach
        return []
    return [run for run in map(_parse, data.splitlines()) if run is not None]


def _scan(folder: Path) -> list[Path]:
    """The run folders directly under ``folder``, damaged ones included (`looks_like_run_dir`);
    none if it is missing or unreadable."""
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    return [p for p in children if looks_like_run_dir(p)]


def _legacy_root() -> Path | None:
    try:
        return Path.cwd() / LEGACY_RUNS
    except OSError:  # the current folder was deleted
        return None


def known_runs(root: Path | None = None) -> list[IndexedRun]:
    """Every run the index knows, plus every run folder under ``root`` (default `runs_root()`)
    and under ``./runs``, one entry per resolved folder, oldest first.

    Runs found by the scan but missing from the index are added to it (best effort), so a run
    made before the index existed is found from anywhere once it has been seen.
    """
    root = (root or runs_root()).absolute()
    found: dict[Path, IndexedRun] = {}
    for run in _indexed():
        try:
            path = run.path.resolve()
        except (OSError, RuntimeError):  # a symlink loop or an unreadable path: not a run
            continue
        found[path] = IndexedRun(path.name, path, _folder_exists(path), run.created)
    new = []
    for folder in (root, _legacy_root()):
        for run_dir in _scan(folder) if folder else []:
            path = run_dir.resolve()
            if path not in found:
                created = _mtime(path / "spec.json") or _mtime(path)
                found[path] = IndexedRun(path.name, path, True, created)
                new.append(found[path])
    for run in new:
        try:
            register(run.path, run.created)
        except OSError:
            break  # a read-only data folder: listing still works, it is just not remembered
    return sorted(found.values(), key=lambda r: (r.created or 0.0, r.id))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def find_run(ref: str, root: Path | None = None) -> Path:
    """The folder of the run whose id is ``ref`` or starts with it (unique), or a run folder's
    path. Raises RunUnknownError, RunAmbiguousError or RunGoneError (HomelabErrors with hints)."""
    root = (root or runs_root()).absolute()
    if not ref.strip():
        raise RunUnknownError("run id: empty", hint=_HINT)
    if os.sep in ref or "/" in ref:  # a path to a run folder
        folder = Path(os.path.expanduser(ref))  # ~nobody: as typed, no error
        if is_run_dir(folder) or looks_like_run_dir(folder):  # a damaged one says what is wrong
            return folder.absolute()
        gone = _gone_at(folder, root)
        if gone is not None:
            raise _gone_error(gone)
        raise RunUnknownError(f"run {ref!r}: not a run folder (no spec.json)", hint=_HINT)
    runs = known_runs(root)
    exact = [r for r in runs if r.id == ref]
    matches = exact or [r for r in runs if r.id.startswith(ref)]
    present = [r for r in matches if r.exists]
    if not matches:
        raise RunUnknownError(
            f"run {ref!r}: no such run under {root}, ./{LEGACY_RUNS} or in the run index "
            f"{index_path()}",
            hint=_HINT + "; a run kept elsewhere: pass its folder with --runs DIR",
        )
    if len(present) == 1 and (exact or len(matches) == 1):
        return present[0].path
    here = [r for r in present if r.path.parent == root.resolve()]
    if exact and len(present) > 1 and len(here) == 1:  # the same id elsewhere: this root's
        return here[0].path
    if len(matches) == 1 or (exact and not present):
        raise _gone_error(matches[-1])
    names = ", ".join(
        (r.id if not exact else str(r.path)) + ("" if r.exists else " (gone)") for r in matches[:3]
    )
    more = "…" if len(matches) > 3 else ""
    raise RunAmbiguousError(
        f"run id prefix {ref!r} matches {len(matches)} runs ({names}{more})",
        hint="give more of the id (" + _HINT + ")",
    )


def _gone_error(run: IndexedRun) -> RunGoneError:
    """The error for a run the index knows whose folder is no longer there."""
    return RunGoneError(
        f"run {run.id} was at {run.path}; that folder is gone",
        hint="it was moved or deleted; if it was moved, give its new path "
        "(or its runs folder with --runs DIR); `homelab-dp runs --forget-gone` forgets it",
    )


def _gone_at(folder: Path, root: Path) -> IndexedRun | None:
    """The known run whose folder was at the path ``folder`` and is gone, or None."""
    try:
        path = folder.absolute()
        if path.exists():
            return None
        wanted = {path, path.parent.resolve() / path.name}
    except (OSError, RuntimeError, ValueError):  # a name too long, a loop, a NUL: no run
        return None
    return next((r for r in known_runs(root) if not r.exists and r.path in wanted), None)
