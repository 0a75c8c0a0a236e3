"""The ModelSpec of any model folder: the hand-written families from config.json, every other
decoder from transformers' module tree in a child process, remembered by config hash.

The front ends never import torch: the census (`train/model/model_census.py`) runs as
``python -m homelab_dp.train.model.model_census DIR`` and its JSON answer is cached in
``<data home>/model-specs/<sha256>.json`` (private, written atomically), keyed by the bytes of
config.json, the installed transformers version and the flags, so a second `plan` reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_config import read_config_bytes, read_regular_file
from homelab_dp.planning.model_spec import ModelSpec, hand_written_spec, spec_to_dict
from homelab_dp.planning.spec_document import spec_from_dict
from homelab_dp.user_files.paths import data_home
from homelab_dp.user_files.private_write import write_private

CACHE_FOLDER = "model-specs"
CACHE_FORMAT = 3
"""Bumped when the spec's fields change (2: layer groups, 3: `ModelSpec.outer_quantized`), so an
older entry is derived again."""
CENSUS_TIMEOUT_S = 180
"""A meta-device build takes seconds even for 100B-class models (a cold start of torch and
transformers included, on a busy machine under a minute); this ends a hung child."""
CENSUS_MEMORY_BYTES = 8 * 1024**3
"""The census child's address-space cap (RLIMIT_AS): it holds no tensor data (the meta device),
its peak is under 1 GiB of address space on the CPU build of torch; a model whose module tree
alone would outgrow this is refused instead of growing until the machine swaps."""
CACHE_MAX_BYTES = 4 * 1024 * 1024
"""The largest cached spec read (a spec of a few hundred layer groups is under 100 KB)."""


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
    return (
        data_home()
        / CACHE_FOLDER
        / f"{cache_key(folder, trust_remote_code=trust_remote_code, text_only=text_only)}.json"
    )


def cache_key(folder: Path, *, trust_remote_code: bool, text_only: bool) -> str:
    """What a cached census was made from: config.json's bytes (read as `read_config_bytes`
    reads them: a regular file, bounded), transformers' version and the flags."""
    try:
        tf_version = version("transformers")
    except PackageNotFoundError:
        tf_version = "none"
    _, data = read_config_bytes(folder)
    key = hashlib.sha256(data)
    key.update(f"\0{tf_version}\0{int(trust_remote_code)}{int(text_only)}\0{CACHE_FORMAT}".encode())
    return key.hexdigest()


def _derived(folder: Path, *, trust_remote_code: bool, text_only: bool) -> ModelSpec:
    """The cached census, else a fresh one from a child process (then cached)."""
    key = cache_key(folder, trust_remote_code=trust_remote_code, text_only=text_only)
    path = data_home() / CACHE_FOLDER / f"{key}.json"
    spec = read_cached(path, key)
    if spec is not None:
        return spec
    data = run_census(folder, trust_remote_code=trust_remote_code, text_only=text_only)
    spec = spec_from_dict(data)
    with contextlib.suppress(OSError):  # not written: the next plan only runs another census
        write_private(path, json.dumps({"key": key, "spec": spec_to_dict(spec)}))
    return spec


def read_cached(path: Path, key: str) -> ModelSpec | None:
    """The cached spec at ``path`` if it passes every check: a regular file (a symlink to
    /dev/zero or a FIFO is not read), at most `CACHE_MAX_BYTES`, JSON naming ``key`` (what it
    was made from), a spec whose every field has its type and range and whose counts are
    positive (`spec_from_dict`). Anything else is removed (it is derived again) and None."""
    try:
        data = read_regular_file(path, CACHE_MAX_BYTES, "cached model spec")
    except FileNotFoundError:
        return None
    except (ModelSpecError, OSError):
        _discard(path)
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("key") != key:
            raise ModelSpecError("the cached spec was made from another config", hint="")
        return spec_from_dict(doc.get("spec"))
    except (ModelSpecError, ValueError, RecursionError, UnicodeDecodeError):
        _discard(path)
        return None


def _discard(path: Path) -> None:
    """Remove a cache entry that failed its checks (a link is removed, not its target)."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
    except OSError:
        pass


def run_census(folder: Path, *, trust_remote_code: bool, text_only: bool) -> dict[str, Any]:
    """``python -m homelab_dp.train.model.model_census`` on ``folder``: its JSON answer, or its refusal
    as ModelSpecError. Offline: the child never reaches the Hub."""
    argv = [sys.executable, "-m", "homelab_dp.train.model.model_census", str(folder)]
    argv += ["--trust-remote-code"] * trust_remote_code + ["--text-only"] * text_only
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CENSUS_TIMEOUT_S, env=env, check=False,
            preexec_fn=_cap_memory, start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ModelSpecError(
            f"{folder / 'config.json'}: building the model on the meta device took over "
            f"{CENSUS_TIMEOUT_S} s",
            hint="use a hand-written family (homelab-dp plan names them) or report the model",
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except (ValueError, RecursionError):
        answer = {}
    if not isinstance(answer, dict):
        answer = {}
    if done.returncode < 0 or "MemoryError" in done.stderr:
        raise ModelSpecError(
            f"{folder / 'config.json'}: building the model on the meta device outgrew "
            f"{CENSUS_MEMORY_BYTES // 1024**3} GiB of address space",
            hint="check config.json's sizes (layers, experts) against the model's published one",
        )
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


def _cap_memory() -> None:
    """In the census child, before it starts: cap its address space (`CENSUS_MEMORY_BYTES`)."""
    with contextlib.suppress(ValueError, OSError):  # a lower hard limit already applies
        resource.setrlimit(resource.RLIMIT_AS, (CENSUS_MEMORY_BYTES, CENSUS_MEMORY_BYTES))
