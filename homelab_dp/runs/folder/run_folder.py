"""The run folder: `runs/<id>/` with spec.json, state.json, events.jsonl, logs/, checkpoints/, final/."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from homelab_dp import json_safe
from homelab_dp.errors import HomelabError, RunStateError
from homelab_dp.runs.folder.run_index import RUNS_ENV, index_path, register, runs_root
from homelab_dp.runs.run_events import Event
from homelab_dp.runs.run_spec import RunSpec
from homelab_dp.user_files.paths import ensure_private_dir
from homelab_dp.user_files.private_write import write_whole


def open_runs_root(folder: str | Path, source: str = "--runs") -> Path:
    """``folder`` as a runs root, created 0700 if missing; a HomelabError naming ``source``
    (the option or variable that gave it) when it cannot be."""
    path = Path(folder).expanduser().absolute()
    try:
        return ensure_private_dir(path)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if isinstance(exc, (FileExistsError, NotADirectoryError)) and exc.filename:
            why = f"{exc.filename} is a file, not a folder"
        raise HomelabError(
            f"{source} {folder}: cannot create the runs folder ({why})",
            hint="give a folder you can write to, or leave it out: runs then go to "
            "$XDG_DATA_HOME/homelab-dp/runs (~/.local/share/homelab-dp/runs)",
        ) from None


def new_run_id(name: str) -> str:
    """A sortable, unique id: <yyyymmdd-hhmmss>-<preset name>-<4 hex>."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:40] or "run"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(2)}"


class RunDamagedError(RunStateError):
    """A run folder whose spec.json is missing or cannot be read: that run's commands fail
    with this (exit 2); every other run works."""


def create_run_dir(
    spec: RunSpec, root: Path | None = None, fill: Callable[[Path], None] | None = None
) -> Path:
    """Create ``root/<spec.run_id>`` private to the user (0700), write spec.json into it (and
    whatever ``fill`` writes: the first state and event) and record it in the per-user run
    index (so it is found by id from any folder).

    The folder is made whole under a hidden name (``.tmp-<id>``, never listed as a run) and
    renamed into place: a write that fails (a full disk, a read-only folder) removes it and
    raises a HomelabError naming the runs folder — no half-made run is ever left behind."""
    root = open_runs_root(root or runs_root(), "runs folder" if root else _root_source())
    run_dir = root / spec.run_id
    tmp = root / f".tmp-{spec.run_id}"
    try:
        if run_dir.exists():
            raise FileExistsError(errno.EEXIST, "a run folder of that id exists", str(run_dir))
        tmp.mkdir(mode=0o700)
        os.chmod(tmp, 0o700)  # mkdir's mode is masked by the umask
        for sub in ("logs", "checkpoints"):
            (tmp / sub).mkdir(mode=0o700)
        write_run_spec(tmp, spec)
        if fill is not None:
            fill(tmp)
        os.rename(tmp, run_dir)  # never over an existing run: rename fails on a non-empty one
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing started: leave nothing behind
        raise _creation_error(root, exc) from None
    try:
        register(run_dir)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing started: leave nothing behind
        raise HomelabError(
            f"run index {index_path()}: cannot write it ({exc.strerror or exc})",
            hint="make $XDG_DATA_HOME/homelab-dp writable (or point XDG_DATA_HOME elsewhere)",
        ) from None
    return run_dir


def _creation_error(root: Path, exc: OSError) -> HomelabError:
    """A run folder that could not be made under ``root``, in words, with what to do."""
    why = exc.strerror or str(exc)
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return HomelabError(
        f"runs folder {root}: cannot create the run folder ({why})",
        hint="free space on its disk (df -h), then start the run again"
        if full
        else "give a runs folder you can write to with --runs DIR (or $HOMELAB_DP_RUNS)",
    )


def _root_source() -> str:
    return RUNS_ENV if os.environ.get(RUNS_ENV) else "runs folder"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file
    (`homelab_dp.user_files.private_write.write_whole`, flushed to the disk first). A write that
    fails (a full disk) leaves the old file as it was and no temporary behind, and raises its
    OSError (naming ``path``)."""
    write_whole(path, json_safe.dumps(data, indent=2) + "\n", fsync=True)


def read_run_spec(run_dir: Path) -> RunSpec:
    """Read a run's spec.json (any format version). A missing, empty, corrupt or foreign
    spec.json raises `RunDamagedError` naming the run and the file."""
    path = run_dir / "spec.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(doc, dict):
            raise TypeError(f"a JSON {type(doc).__name__}, not a run spec")
        return RunSpec.from_json(doc)
    except FileNotFoundError:
        why = "missing"
    except UnicodeDecodeError:
        why = "not UTF-8 text"
    except json.JSONDecodeError as exc:
        why = "empty" if not exc.doc.strip() else f"not valid JSON ({exc.msg}, line {exc.lineno})"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror or exc})"
    except (KeyError, TypeError, ValueError, AttributeError, HomelabError) as exc:
        why = f"not a run spec ({exc})"
    raise RunDamagedError(
        f"run {run_dir.name}: {path} is {why}; the run folder is damaged",
        hint="restore spec.json from a backup, or move the folder away; "
        "`homelab-dp runs` lists the other runs",
    )


def write_run_spec(run_dir: Path, spec: RunSpec) -> None:
    """Write a run's spec.json whole (readers never see half of it)."""
    write_json_atomic(run_dir / "spec.json", spec.to_json())


def append_event(run_dir: Path, event: Event) -> None:
    """Append one controller or keeper event to events.jsonl (one line, one write)."""
    line = json_safe.dumps(event.to_json())
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
