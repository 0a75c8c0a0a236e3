"""Following a run: what the CLI's `attach` and the TUI read from its folder, never touching it.

The CLI's loop (`homelab_dp.cli.follow`) reads a `RunFollower`: the history folded into a
`RunView`, then each poll's new events, each folded in as it is handed out, and the run's state.
The TUI follows one run at a time, the one in `Following`: the app's
worker thread calls `RunPoller.poll` in a loop: each poll reads what the run's files gained
(tailing, `homelab_dp.runs.folder.jsonl_tail`), folds it into a `RunView` and, when anything changed,
returns a `Snapshot` — a private copy, so the UI thread can read it while polling goes on.

No Textual here. A snapshot is a whole state, never a delta: any number of them may be dropped
in favour of the newest one (that is what makes the TUI's update messages safe to coalesce).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp.app.runs import RunController
from homelab_dp.runs.folder.jsonl_tail import file_size
from homelab_dp.runs.folder.rollouts import Rollouts, latest_rollouts
from homelab_dp.runs.folder.run_state import LIVE, current_state, read_state
from homelab_dp.runs.run_view import RunView

__all__ = ["RunView"]  # the view a follower hands out, for the front ends' annotations

LOG_LINES = 200


def is_live(status: str | None) -> bool:
    """Whether a run in ``status`` has not ended yet: active, or waiting in the queue."""
    return status in LIVE


def events_end(run_dir: Path) -> int:
    """Where the run's events.jsonl ends now: what a follower started later counts as history."""
    return file_size(run_dir / "events.jsonl")


def resumed_from(run_dir: Path) -> int | None:
    """The step a resumed run continues from, as its state says (0: from the start)."""
    return read_state(run_dir).get("resume_from")


class RunFollower:
    """A run followed from the CLI (`attach`, `run`, `resume`): its view and what is new."""

    def __init__(
        self, controller: RunController, run_id: str, history_until: int | None = None
    ) -> None:
        """Events before byte ``history_until`` of events.jsonl (default: all there are now) are
        history: folded into `view` at once, never handed out."""
        self.run_dir = controller.run_dir(run_id)
        self.view = controller.new_view(self.run_dir)
        self._tail = controller.tail(run_id)
        until = events_end(self.run_dir) if history_until is None else history_until
        for event in self._tail.events.read(until):
            self.view.apply(event)

    def state(self) -> dict[str, Any]:
        """The run's state now (state.json, a dead keeper's last word settled)."""
        return current_state(self.run_dir)

    def events(self) -> Iterator[dict[str, Any]]:
        """The events written since the last call, each folded into `view` as it is handed out
        (a printer reading the view sees it as of that event)."""
        for event in self._tail.read():
            self.view.apply(event)
            yield event


@dataclass(frozen=True)
class Snapshot:
    """The state of one followed run at one moment: its id, its view (a copy that shares
    nothing with the poller's), the tail of its logs and, for GRPO, its latest rollouts."""

    run_id: str
    view: RunView
    log_lines: tuple[str, ...]
    """The last LOG_LINES lines of the run's logs."""
    log_seq: int
    """How many log lines were read in all, so a reader can tell which lines are new."""
    log_files: tuple[str, ...]
    rollouts: Rollouts | None = None
    """GRPO: the latest generating step's completions and rewards (``rollouts/``)."""


def copy_view(view: RunView) -> RunView:
    """A copy that shares nothing mutable with ``view``."""
    return view.copy()


def log_label(path: Path) -> str:
    """A short name for a log file: torchrun's ``attempt_0/1/stderr.log`` is ``rank1``."""
    parent = path.parent.name
    if parent.isdigit() and path.parent.parent.name.startswith("attempt_"):
        return f"rank{parent}" + ("" if path.stem == "stderr" else f" {path.stem}")
    return path.stem


class LogTail:
    """New lines of every ``*.log`` under a run's ``logs/`` folder (files may appear later)."""

    def __init__(self, folder: Path, keep: int = LOG_LINES) -> None:
        self.folder = folder
        self.lines: deque[str] = deque(maxlen=keep)
        self.seq = 0
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    @property
    def files(self) -> tuple[str, ...]:
        """The labels of the log files read so far."""
        return tuple(dict.fromkeys(log_label(p) for p in self._offsets))

    def read(self) -> int:
        """Read what was appended since the last call; return the number of new lines."""
        if not self.folder.is_dir():
            return 0
        paths = sorted(self.folder.rglob("*.log"))
        if (self.folder / "launcher.log") in paths:
            # torchrun tees every rank's output into launcher.log ("[default0]:…"): its
            # per-rank copies under attempt_N/ would show each line twice.
            paths = [p for p in paths if not p.parent.parent.name.startswith("attempt_")]
        several = len(paths) > 1
        before = self.seq
        for path in paths:
            offset = self._offsets.setdefault(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except OSError:
                continue  # rotated or removed between listing and reading
            self._offsets[path] = offset + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            *whole, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
            prefix = f"{log_label(path)}: " if several else ""
            for raw in whole:
                # A progress bar redraws with \r: only its last state is worth a line.
                parts = raw.decode("utf-8", errors="replace").split("\r")
                line = next((p for p in reversed(parts) if p.strip()), "")
                if line:
                    self.lines.append(prefix + line)
                    self.seq += 1
        return self.seq - before


@dataclass
class Following:
    """The run the TUI follows: its id once chosen, its newest snapshot once polled.

    The app writes it; the Monitor, handed the same object, reads it.
    """

    run_id: str | None = None
    snapshot: Snapshot | None = None


class RunPoller:
    """Polls one run's events, device samples, state and logs (call `poll` from one thread)."""

    def __init__(self, controller: RunController, run_id: str) -> None:
        self.run_dir = controller.run_dir(run_id)
        self.run_id = self.run_dir.name
        self.view = controller.new_view(self.run_dir)
        self._tail = controller.tail(self.run_id)
        self._logs = LogTail(self.run_dir / "logs")
        self._status: tuple[str | None, str | None] | None = None
        self.events_read = 0
        self.rollouts: Rollouts | None = None
        """The latest rollouts read (read again after a step event)."""

    def poll(self) -> Snapshot | None:
        """Fold what is new; a snapshot when anything changed, else None."""
        events = self._tail.read()
        for event in events:
            self.view.apply(event)
        self.events_read += len(events)
        if self.events_read == len(events) or any(e.get("type") == "step" for e in events):
            self.rollouts = latest_rollouts(self.run_dir)  # a new step may have written one
        new_lines = self._logs.read()
        state = current_state(self.run_dir)
        status = (state.get("status"), state.get("reason"))
        changed = bool(events or new_lines) or status != self._status
        self._status = status
        self.view.apply_state(state)
        if not changed:
            return None
        return self.snapshot()

    def snapshot(self) -> Snapshot:
        """The current state as a snapshot."""
        return Snapshot(
            run_id=self.run_id,
            view=copy_view(self.view),
            log_lines=tuple(self._logs.lines),
            log_seq=self._logs.seq,
            log_files=self._logs.files,
            rollouts=self.rollouts,
        )
