"""The presets as the front ends use them: listed, shown with their runs' results, opened with
overrides, saved, and what each field means.

`homelab-dp presets list|show|save` and the TUI's Plan and Launch screens read presets through
these functions (`presets.preset_store` finds and writes them, `runs.preset_results` holds what
their completed runs measured), so both front ends find, check and save a preset the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from homelab_dp.presets import preset_store
from homelab_dp.presets.preset import Preset, field_docs, load_preset
from homelab_dp.runs.preset_results import expected_runs, preset_name, read_results

__all__ = ["Preset", "expected_runs", "field_docs"]
"""Kept here for the front ends: the preset type they hold, what a plan may expect from the
preset's recorded runs (`plan`'s expected duration and energy), the fields' help texts."""


def preset_rows() -> list[tuple[str, Path, str]]:
    """Every preset found: its name, its file and the first line of its header comment ("" for
    none)."""
    rows = []
    for name, path in preset_store.list_presets():
        first = preset_store.header_comment(path).splitlines()
        rows.append((name, path, first[0] if first else ""))
    return rows


def preset_names() -> list[str]:
    """Every preset found, by name."""
    return [name for name, _ in preset_store.list_presets()]


def load_named(name: str) -> Preset:
    """A preset as its file says (paths not yet resolved). Raises PresetError."""
    return load_preset(preset_store.find_preset(name))


def open_preset(name: str, overrides: list[str] | None = None) -> Preset:
    """A preset by name or path with ``--set`` overrides applied and its paths resolved.
    Raises HomelabError."""
    return preset_store.open_preset(name, overrides)


def save_preset(name: str, preset: Preset, *, force: bool = False) -> Path:
    """Save ``preset`` as the user's preset ``name``; its file. Raises HomelabError (an existing
    preset without ``force``)."""
    return preset_store.save_preset(name, preset, force=force)


def preset_document(name: str) -> dict[str, Any]:
    """`presets show`: the preset checked, its text, and the recorded results of its completed
    runs (every run of a preset of this name). Raises HomelabError."""
    path = preset_store.find_preset(name)
    load_preset(path)  # validate before showing
    text = path.read_text(encoding="utf-8")
    return {"name": preset_name(path), "path": path, "text": text,
            "results": read_results(preset_name(path))}  # fmt: skip
