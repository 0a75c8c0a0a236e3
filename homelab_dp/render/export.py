"""What an export wrote, in words (the CLI prints these lines; the TUI notifies the first)."""

from __future__ import annotations

from typing import Any


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def export_lines(doc: dict[str, Any]) -> list[str]:
    """An export's `--json` document as lines for people: where, how much, how to use it."""
    dtype = f" ({doc['dtype']})" if doc.get("dtype") and doc["dtype"] != "as saved" else ""
    lines = [f"exported {doc['format']}{dtype} to {doc['out']}: {len(doc['files'])} files, "
             f"{_size(int(doc['bytes']))}"]  # fmt: skip
    lines += [f"note: {n}" for n in doc.get("notes", [])]
    if "Modelfile" in doc["files"]:
        lines.append(f"import it: ollama create NAME -f {doc['out']}/Modelfile")
    return lines
