"""The run folder: `runs/<id>/` with spec.json, state.json, events.jsonl, logs/, checkpoints/, final/."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from homelab_dp.core.events import Event
from homelab_dp.core.runspec import RunSpec

RUNS_ENV = "HOMELAB_DP_RUNS"


def runs_root() -> Path:
    """The runs folder: $HOMELAB_DP_RUNS or ./runs."""
    return Path(os.environ.get(RUNS_ENV) or "runs").absolute()


def new_run_id(name: str) -> str:
    """A sortable, unique id: <yyyymmdd-hhmmss>-<preset name>-<4 hex>."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:40] or "run"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-{secrets.token_hex(2)}"


def create_run_dir(spec: RunSpec, root: Path | None = None) -> Path:
    """Create ``root/<spec.run_id>`` private to the user (0700) and write spec.json into it."""
    root = root or runs_root()
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / spec.run_id
    run_dir.mkdir(mode=0o700)  # fails if it exists: never overwrite a run
    os.chmod(run_dir, 0o700)  # mkdir's mode is masked by the umask
    for sub in ("logs", "checkpoints"):
        (run_dir / sub).mkdir(mode=0o700)
    write_run_spec(run_dir, spec)
    return run_dir


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
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
    line = json.dumps(event.to_json())
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
