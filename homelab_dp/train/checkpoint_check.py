"""Which checkpoint may a resume trust? Checks that read files only — no torch, nothing unpickled.

A checkpoint folder ``checkpoints/step-N/`` is usable when its ``COMPLETE`` marker reads back,
``trainer.json`` reads back, every shard the marker lists is there with the size it had when it
was written, and every shard is a whole safetensors file whose header carries DCP's sharding
metadata for each of its tensors. The safetensors header is parsed by hand (8-byte length, then
JSON), so a damaged file is named without loading a tensor; pickle files are never opened.

`find_usable` walks the ``step-N`` folders newest first and says why it skipped each one, so the
worker can tell the user which file was wrong and which checkpoint it fell back to. Temporary
``.tmp-step-N`` folders (a write that never finished) are never candidates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
DCP_METADATA_KEY = "DCP_SHARDING_INFO"  # torch's key for the shard offsets in each header
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".distcp", ".metadata")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``step-N`` folders under ``root``, newest first."""
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def read_marker(path: Path) -> dict[str, Any] | None:
    """The completion marker of a checkpoint folder, or None when missing or unreadable."""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "step" in marker else None


def is_complete(path: Path) -> bool:
    """True when the folder holds a readable completion marker."""
    return read_marker(path) is not None


def shard_files(path: Path) -> dict[str, int]:
    """``{file name: size}`` of the safetensors shards in a folder (what the marker records)."""
    return {p.name: p.stat().st_size for p in sorted(path.glob("*.safetensors"))}


def check_shard(shard: Path) -> str | None:
    """Why a safetensors shard is unusable (truncated, bad header, no DCP metadata), or None."""
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if size < 8 or not 0 < length <= min(_MAX_HEADER, size - 8):
                return (
                    f"{shard}: truncated or not a safetensors file "
                    f"(header length {length}, file {size} bytes)"
                )
            header = json.loads(fh.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{shard}: unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return f"{shard}: the safetensors header is not a JSON object"
    meta = header.pop("__metadata__", None) or {}
    ends = [t.get("data_offsets", [0, 0])[1] for t in header.values() if isinstance(t, dict)]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"{shard}: truncated ({size} bytes, its header describes {expected})"
    try:
        sharding = json.loads(meta[DCP_METADATA_KEY])
    except (KeyError, TypeError, ValueError):
        return f"{shard}: missing its checkpoint metadata ({DCP_METADATA_KEY} in the header)"
    missing = [k for k in header if k not in sharding]
    if missing:
        return f"{shard}: no checkpoint metadata for {len(missing)} tensors (e.g. {missing[0]})"
    return None


def check_checkpoint(path: Path) -> str | None:
    """Why the checkpoint cannot be used (naming the file), or None when every check passes."""
    marker = read_marker(path)
    if marker is None:
        return f"{path / MARKER}: missing or unreadable completion marker"
    try:
        trainer = json.loads((path / "trainer.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path / 'trainer.json'}: missing (the checkpoint's step and schedule)"
    except (OSError, ValueError) as exc:
        return f"{path / 'trainer.json'}: unreadable ({exc})"
    if not isinstance(trainer, dict) or "step" not in trainer:
        return f"{path / 'trainer.json'}: no step recorded"
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        return f"{path / pickles[0]}: a pickle file in a checkpoint; refused, never loaded"
    found = shard_files(path)
    listed = marker.get("files")
    if not isinstance(listed, dict):  # written before the marker listed its shards
        listed = found
    missing = sorted(set(listed) - set(found))
    if missing:
        return f"{path / missing[0]}: missing (the completion marker lists it)"
    if not found:
        return f"{path}: no safetensors shards"
    for name in found:  # the most specific message first: truncated, no metadata
        problem = check_shard(path / name)
        if problem:
            return problem
    for name, size in sorted(listed.items()):
        if found[name] != size:
            return f"{path / name}: changed since it was written ({found[name]} bytes, was {size})"
    extra = sorted(set(found) - set(listed))
    return f"{path / extra[0]}: not part of the checkpoint as written" if extra else None


def find_usable(root: Path) -> tuple[Path | None, list[str]]:
    """(the newest usable checkpoint under ``root`` or None, why each newer one was skipped)."""
    skipped = []
    for _, path in step_dirs(root):
        problem = check_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append(f"skipped checkpoint {path.name}: {problem}")
    return None, skipped
