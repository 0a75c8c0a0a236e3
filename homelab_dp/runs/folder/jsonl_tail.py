"""Tailing a run's JSON-lines files (events and device samples) — for the CLI and the TUI.

Readers never block writers: they poll the files, remember their offsets and only ever hand
out complete lines, so a line being written is picked up on the next poll.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class JsonlTail:
    """New complete JSON lines of one file since the last call."""

    def __init__(self, path: Path, start: int = 0) -> None:
        self.path = path
        self.offset = start
        self._partial = b""

    def read(self, until: int | None = None) -> list[dict[str, Any]]:
        """New complete lines; with ``until``, only what lies before that byte offset."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read() if until is None else fh.read(max(until - self.offset, 0))
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # "" when the chunk ended on a newline
        return json_objects(lines)


def json_objects(lines: Iterable[bytes | str]) -> list[dict[str, Any]]:
    """The lines that are JSON objects, in order; blank lines, other JSON values and lines that
    are not JSON (or not UTF-8: a torn line from a crash mid-write, or damage such as nesting
    too deep) are left out."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


class RunTail:
    """Events and device samples of one run, merged in arrival order."""

    def __init__(self, run_dir: Path, *, devices: bool = True) -> None:
        self.events = JsonlTail(run_dir / "events.jsonl")
        self.devices = JsonlTail(run_dir / "devices.jsonl") if devices else None

    def read(self) -> list[dict[str, Any]]:
        """New events and samples since the last call."""
        out = self.events.read()
        if self.devices is not None:
            out += self.devices.read()
        return out


def read_all(path: Path) -> Iterator[dict[str, Any]]:
    """Every JSON line of a file (for `status` and replays)."""
    yield from JsonlTail(path).read()


def file_size(path: Path) -> int:
    """Bytes in a file so far (0 when it does not exist yet or cannot be read)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
