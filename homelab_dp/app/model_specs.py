"""The ModelSpec of any model folder: the hand-written families from config.json, every other
decoder from transformers' module tree in a child process, remembered by config hash.

The front ends never import torch: the census (`train/model_census.py`) runs as
``python -m homelab_dp.train.model_census DIR`` and its JSON answer is cached in
``<data home>/model-specs/<sha256>.json`` (private, written atomically), keyed by the bytes of
config.json, the installed transformers version and the flags, so a second `plan` reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_spec import (
    ModelSpec,
    hand_written_spec,
    spec_from_dict,
    spec_to_dict,
)
from homelab_dp.runs.folder.run_index import data_home, ensure_private_dir

CACHE_FOLDER = "model-specs"
CENSUS_TIMEOUT_S = 600
"""A meta-device build takes seconds even for 100B-class models; this only ends a hung child."""


def model_spec(
    folder: str | Path, *, trust_remote_code: bool = False, text_only: bool = False
) -> ModelSpec:
    """The ModelSpec of the model in ``folder`` (its config.json), or ModelSpecError naming
    the file and the ``model_type`` for a model that cannot be planned.

    ``text_only``: a multimodal wrapper's language model alone (the vision tower not loaded).
    """
    spec = hand_written_spec(folder, trust_remote_code=trust_remote_code, text_only=text_only)
    if spec is not None:
        return spec
    return _derived(Path(folder), trust_remote_code=trust_remote_code, text_only=text_only)


def cache_path(folder: Path, *, trust_remote_code: bool, text_only: bool) -> Path:
    """Where the census of ``folder`` is kept: config bytes, transformers version and flags."""
    try:
        tf_version = version("transformers")
    except PackageNotFoundError:
        tf_version = "none"
    key = hashlib.sha256((folder / "config.json").read_bytes())
    key.update(f"\0{tf_version}\0{int(trust_remote_code)}{int(text_only)}".encode())
    return data_home() / CACHE_FOLDER / f"{key.hexdigest()}.json"


def _derived(folder: Path, *, trust_remote_code: bool, text_only: bool) -> ModelSpec:
    """The cached census, else a fresh one from a child process (then cached)."""
    path = cache_path(folder, trust_remote_code=trust_remote_code, text_only=text_only)
    try:
        return spec_from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        pass
    except (ModelSpecError, json.JSONDecodeError, UnicodeDecodeError):
        path.unlink(missing_ok=True)  # a damaged cache entry is derived again
    data = run_census(folder, trust_remote_code=trust_remote_code, text_only=text_only)
    spec = spec_from_dict(data)
    _write_private(path, spec_to_dict(spec))
    return spec


def run_census(folder: Path, *, trust_remote_code: bool, text_only: bool) -> dict[str, Any]:
    """``python -m homelab_dp.train.model_census`` on ``folder``: its JSON answer, or its refusal
    as ModelSpecError. Offline: the child never reaches the Hub."""
    argv = [sys.executable, "-m", "homelab_dp.train.model_census", str(folder)]
    argv += ["--trust-remote-code"] * trust_remote_code + ["--text-only"] * text_only
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CENSUS_TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        raise ModelSpecError(
            f"{folder / 'config.json'}: building the model on the meta device took over "
            f"{CENSUS_TIMEOUT_S} s",
            hint="use a hand-written family (homelab-dp plan names them) or report the model",
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if done.returncode != 0 or "error" in answer:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelSpecError(
            answer.get("error") or f"{folder / 'config.json'}: the model census failed ({tail})",
            hint=answer.get("hint")
            or "check config.json against the model's published one; transformers must know "
            "its model_type (or set model.trust_remote_code for a folder that ships its code)",
        )
    answer.pop("transformers", None)
    return answer


def _write_private(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON readable by the user alone (0600 in a 0700 folder), atomically."""
    try:
        ensure_private_dir(path.parent)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        return  # a cache that cannot be written only costs the next plan another census
