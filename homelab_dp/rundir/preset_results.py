"""Where the results of completed runs are kept: the run's ``results.json`` and the per-user
store ``$XDG_DATA_HOME/homelab-dp/preset_results.jsonl`` (one JSON line per run).

Each line is one `homelab_dp.core.preset_results.result_record`, appended like the run index
(`homelab_dp.rundir.index.register`): one ``O_APPEND`` write of a whole line into a file private
to the user, so runs that end at the same moment never tear each other's lines. A run is
recorded once: its ``results.json`` is written first, and a run folder that has one is not
appended again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from homelab_dp.core import json_safe
from homelab_dp.rundir.index import data_home, ensure_private_dir

STORE_NAME = "preset_results.jsonl"
RUN_RESULTS = "results.json"


def results_path() -> Path:
    """The per-user store of run results."""
    return data_home() / STORE_NAME


def run_results_path(run_dir: Path) -> Path:
    """A run's own record of its results."""
    return run_dir / RUN_RESULTS


def save_results(run_dir: Path, record: dict[str, Any]) -> bool:
    """Write ``run_dir/results.json`` and append ``record`` to the store; False (nothing
    written) when the run was recorded before."""
    own = run_results_path(run_dir)
    try:
        fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json_safe.dump(record, fh, indent=1)
        fh.write("\n")
    append_result(record)
    return True


def append_result(record: dict[str, Any]) -> None:
    """One line in the per-user store (one O_APPEND write, file 0600)."""
    ensure_private_dir(data_home())
    data = (json_safe.dumps(record) + "\n").encode("utf-8")
    fd = os.open(results_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(f"{results_path()}: short write ({written} of {len(data)} bytes)")


def read_results(preset: str | None = None) -> list[dict[str, Any]]:
    """The stored records, oldest first (only preset ``preset``'s when given); a torn line (a
    crash mid-write) or an unreadable file is skipped, never an error."""
    try:
        text = results_path().read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and (preset is None or doc.get("preset") == preset):
            out.append(doc)
    return out
