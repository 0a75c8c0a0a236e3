"""The worker's event writer (``events.jsonl``).

Rank 0 appends one JSON object a line — a typed event of `homelab_dp.runs.run_events` (start, micro,
step, straggler, warning, checkpoint, memory, end), its names and fields listed there — and
flushes every line because the controller tails the file. Any rank may write ``error``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from homelab_dp import json_safe
from homelab_dp.runs.run_events import Event


class EventLog:
    """Appends events to ``events.jsonl``; a no-op on ranks other than 0 unless ``force``.

    ``sink`` (rank 0: `train.loop.reporting.Reporting`, the run's loggers) also gets every event
    written, so TensorBoard & co. show exactly the figures of the file."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self.sink: Any = None

    def write(self, event: Event, force: bool = False) -> dict[str, Any]:
        """Write one event line (flushed at once) and return its object; ``force`` writes on any
        rank (an error: a single O_APPEND write, so lines of several ranks never interleave)."""
        doc = event.to_json()
        if self.enabled or force:
            line = (json_safe.dumps(doc, default=_jsonable) + "\n").encode("utf-8")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one write per line: atomic with O_APPEND
            finally:
                os.close(fd)
        if self.enabled and self.sink is not None:
            self.sink.event(event)
        return doc

    def close(self) -> None:
        """Flush and close the loggers (after the end, a failure or a stop)."""
        if self.sink is not None:
            self.sink.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
