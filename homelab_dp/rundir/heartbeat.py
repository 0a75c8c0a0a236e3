"""Per-rank heartbeats: ``logs/heartbeats/rank-R.json``, written by every rank, read by the keeper.

Each holds ``{rank, pid, step, micro, phase, time}`` and is replaced whole (temporary file and a
rename), so a reader never sees half of one. Stdlib only: both the worker and the keeper use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

HEARTBEATS = Path("logs") / "heartbeats"
"""The heartbeat folder, relative to the run folder."""


def heartbeat_dir(run_dir: Path) -> Path:
    return Path(run_dir) / HEARTBEATS


def write_heartbeat(path: Path, beat: dict[str, Any]) -> None:
    """Write one heartbeat through a temporary file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(beat))
    os.replace(tmp, path)


def read_heartbeats(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Each rank's latest heartbeat, by global rank (unreadable files are skipped)."""
    beats: dict[int, dict[str, Any]] = {}
    folder = heartbeat_dir(run_dir)
    for path in folder.glob("rank-*.json") if folder.is_dir() else []:
        try:
            beat = json.loads(path.read_text(encoding="utf-8"))
            beats[int(beat["rank"])] = beat
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced right now; the next poll reads it
    return beats
