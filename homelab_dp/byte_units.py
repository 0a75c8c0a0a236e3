"""Byte sizes in binary units, read and written as people do: ``24GiB`` in, ``1.50 GiB`` out.

Every part that shows or reads a size uses these (the bottom layer: it imports nothing).
"""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*$", re.IGNORECASE)
_UNIT = {
    None: GiB,
    "g": GiB,
    "gib": GiB,
    "gb": GiB,
    "m": MiB,
    "mib": MiB,
    "mb": MiB,
    "t": TiB,
    "tib": TiB,
    "tb": TiB,
}


def parse_size(text: str) -> int:
    """Parse "24GiB", "24", "11.5G", "512MiB" into bytes (binary units; a bare number is GiB)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(text)
    unit = m.group(2).lower() if m.group(2) else None
    value = float(m.group(1)) * _UNIT[unit]
    if value <= 0:
        raise ValueError(text)
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1.5 GiB, 300 MiB, 12 KiB."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if abs(n) < 10 * size else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
