"""The run folder: `runs/<id>/` with spec.json, state.json, events.jsonl, logs/, checkpoints/, final/."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from homelab_dp.core import json_safe
from homelab_dp.core.events import Event
from homelab_dp.core.runspec import RunSpec
from homelab_dp.errors import HomelabError
from homelab_dp.rundir.index import RUNS_ENV, ensure_private_dir, index_path, register, runs_root


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


def create_run_dir(spec: RunSpec, root: Path | None = None) -> Path:
    """Create ``root/<spec.run_id>`` private to the user (0700), write spec.json into it and
    record it in the per-user run index (so it is found by id from any folder)."""
    root = open_runs_root(root or runs_root(), "runs folder" if root else _root_source())
    run_dir = root / spec.run_id
    run_dir.mkdir(mode=0o700)  # fails if it exists: never overwrite a run
    os.chmod(run_dir, 0o700)  # mkdir's mode is masked by the umask
    for sub in ("logs", "checkpoints"):
        (run_dir / sub).mkdir(mode=0o700)
    write_run_spec(run_dir, spec)
    try:
        register(run_dir)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing started: leave nothing behind
        raise HomelabError(
            f"run index {index_path()}: cannot write it ({exc.strerror or exc})",
            hint="make $XDG_DATA_HOME/homelab-dp writable (or point XDG_DATA_HOME elsewhere)",
        ) from None
    return run_dir


def _root_source() -> str:
    return RUNS_ENV if os.environ.get(RUNS_ENV) else "runs folder"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json_safe.dump(data, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_run_spec(run_dir: Path) -> RunSpec:
    """Read a run's spec.json (any format version)."""
    return RunSpec.from_json(json.loads((run_dir / "spec.json").read_text(encoding="utf-8")))


def write_run_spec(run_dir: Path, spec: RunSpec) -> None:
    """Write a run's spec.json whole (readers never see half of it)."""
    write_json_atomic(run_dir / "spec.json", spec.to_json())


def append_event(run_dir: Path, event: Event) -> None:
    """Append one controller or keeper event to events.jsonl (one line, one write)."""
    line = json_safe.dumps(event.to_json())
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
