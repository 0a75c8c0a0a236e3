"""Per-rank heartbeats: ``logs/heartbeats/rank-R.json``, written by every rank, read by the keeper.

Each holds ``{rank, pid, step, micro, phase, time}`` and is replaced whole (temporary file and a
rename), so a reader never sees half of one. Stdlib only: both the worker and the keeper use it.

Phases (the watchdog, `homelab_dp.supervise.watchdog`, judges progress by them):

- ``train``: written at the start of every micro-step; progress is a new step or micro-step.
- a long phase (`LONG_PHASES`: ``checkpoint``, ``saving-result``, ``merging``,
  ``evaluating``): work that can take minutes in one call (writing a large checkpoint or
  result, merging an adapter into its base on the CPU, evaluating a large eval set). The rank
  beats every few seconds while it lasts, so each new beat is progress: a rank in a long phase
  that still beats is working, one that stops beating is not.
- ``waiting`` (`WAITING`): the rank waits for another rank's long phase; its beats show it is
  alive but are nobody's progress, and it is never the stalled one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from homelab_dp import json_safe
from homelab_dp.user_files.private_write import write_whole

HEARTBEATS = Path("logs") / "heartbeats"
"""The heartbeat folder, relative to the run folder."""


TRAIN = "train"
"""The phase of a micro-step."""
CHECKPOINT = "checkpoint"
SAVING_RESULT = "saving-result"
MERGING = "merging"
EVALUATING = "evaluating"
"""Every rank evaluating the eval data (validation while training): beats on a timer."""
LONG_PHASES = frozenset({CHECKPOINT, SAVING_RESULT, MERGING, EVALUATING})
"""Phases whose every beat is progress (the rank beats on a timer while one lasts)."""
WAITING = "waiting"
"""A rank waiting for another rank's long phase: alive, but not the one making progress."""
BEAT_EVERY_S = 1.0
"""How often a rank beats during a long phase or a wait (well below any sensible watchdog)."""


def heartbeat_dir(run_dir: Path) -> Path:
    return Path(run_dir) / HEARTBEATS


def write_heartbeat(path: Path, beat: dict[str, Any]) -> None:
    """Write one heartbeat through a temporary file and a rename (readers never see half)."""
    write_whole(path, json_safe.dumps(beat))


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
