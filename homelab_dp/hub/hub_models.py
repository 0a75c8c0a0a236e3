"""A Hugging Face model id (and revision) → a local snapshot folder.

The local cache comes first (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``): files found there are used without touching the network. Missing
files are downloaded through ``huggingface_hub`` (its progress bars on stderr) unless
``HF_HUB_OFFLINE`` is set. Planning needs only ``config.json`` (``config_only``); a run, eval,
chat or serve needs the model itself: its JSON files (config, tokenizer, generation, the
weight index), safetensors weights, tokenizer files and the chat template — never a pickle, and
nothing in sub-folders. Every failure is a `ModelSpecError` naming the id, with a hint: how
to fetch it, how to log in for a gated model, where the cache is.

Nothing here imports torch; huggingface_hub itself is imported only when an id is resolved.

Is a `model.path` / `data.path` / MODEL value a Hugging Face Hub id rather than a path?

Pure: the rule only. A local path wins whenever it exists; a value that exists nowhere and
reads as ``org/name`` (Hub naming: letters, digits, ``-``, ``_``, ``.``; no leading ``.``, no
``..``) is taken as an id.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp.errors import ModelSpecError
from homelab_dp.user_files.paths import xdg_cache

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
"""What a full snapshot downloads: config, weight index and tokenizer JSON files, safetensors,
sentencepiece / BPE / tiktoken tokenizer files, the chat template, and the model's own code
(run only with model.trust_remote_code)."""
IGNORE_PATTERNS = ["*/*"]
"""Top-level files only: sub-folders hold other formats (onnx/, original/*.pth, gguf...)."""
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class ModelOrigin:
    """A model given by Hugging Face id: what the user named, shown by `status` and `runs`.
    The run itself only ever uses the local snapshot folder in ``preset.model.path``."""

    repo_id: str
    revision: str = ""
    """As asked ("" : main)."""
    commit: str = ""
    """The commit of the snapshot folder the run uses."""


@dataclass(frozen=True)
class Snapshot:
    """A model id resolved to a folder of the local Hugging Face cache."""

    repo_id: str
    revision: str
    """As asked ("" : the default branch, main)."""
    folder: Path
    """``…/models--org--name/snapshots/<commit>``: what transformers loads."""

    @property
    def commit(self) -> str:
        """The commit the folder holds (its name in the cache)."""
        return self.folder.name if _COMMIT.match(self.folder.name) else ""

    @property
    def origin(self) -> ModelOrigin:
        """What a run records of it, for display (`status`, `runs`)."""
        return ModelOrigin(self.repo_id, self.revision, self.commit)


class NotCachedError(ModelSpecError):
    """A model id whose files are not in the local cache, and that was not downloaded
    (offline, or the caller asked for the cache only)."""


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, as huggingface_hub finds it, read now (not at import)."""
    folder = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if folder:
        return Path(folder).expanduser()
    home = os.environ.get("HF_HOME")
    return (Path(home).expanduser() if home else xdg_cache() / "huggingface") / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def named(repo_id: str, revision: str) -> str:
    """``org/name`` or ``org/name@revision``, as messages name a model."""
    return f"{repo_id}@{revision}" if revision else repo_id


def missing_parts(folder: Path) -> list[str]:
    """What a full model folder lacks to be loaded: config, safetensors (every shard of the
    index), a tokenizer. [] when it is complete (a config-only snapshot lacks the rest)."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        missing += sorted(s for s in shards if not (folder / s).is_file())
    elif not any(folder.glob("*.safetensors")):
        missing.append("weights (*.safetensors)")
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer (tokenizer.json or tokenizer.model)")
    return missing


def resolve_model_id(
    repo_id: str,
    revision: str = "",
    *,
    config_only: bool = False,
    fetch: bool = True,
    refresh: bool = False,
) -> Snapshot:
    """The local snapshot of ``repo_id`` at ``revision`` ("" : main), downloading what is
    missing when ``fetch`` and online. ``config_only``: config.json is enough (planning).
    ``refresh`` (`homelab-dp pull`): online, ask the Hub for the revision's newest files even
    when a snapshot is cached. Raises `NotCachedError` (not cached, and offline or not
    ``fetch``) or `ModelSpecError` (the Hub said no, or could not be reached)."""
    cache = hub_cache()
    online = fetch and not hub_offline()
    if not (refresh and online):
        folder, missing = _cached(repo_id, revision, cache, config_only)
        if folder is not None and not missing:
            return Snapshot(repo_id, revision, folder)
        if not online:
            raise _not_cached(repo_id, revision, cache, folder, missing, fetch)
    folder = _download(repo_id, revision, cache, config_only)
    missing = [] if config_only else missing_parts(folder)
    if missing:
        raise ModelSpecError(
            f"model {named(repo_id, revision)}: the Hub has no {', '.join(missing)} for it "
            f"(downloaded to {folder})",
            hint="homelab-dp loads safetensors weights and a fast or sentencepiece tokenizer "
            "only (pickle weights are refused); choose a model that has them, or convert it "
            "on a machine you trust and give its folder",
        )
    return Snapshot(repo_id, revision, folder)


def _hub() -> Any:
    import huggingface_hub

    return huggingface_hub


def _cached(
    repo_id: str, revision: str, cache: Path, config_only: bool
) -> tuple[Path | None, list[str]]:
    """The cached snapshot folder (None: none) and what it lacks; never the network."""
    from huggingface_hub.errors import EntryNotFoundError

    hub = _hub()
    try:
        if config_only:
            path = hub.hf_hub_download(repo_id, "config.json", revision=revision or None,
                                       cache_dir=cache, local_files_only=True)  # fmt: skip
            return Path(path).parent, []
        folder = Path(hub.snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                            local_files_only=True, allow_patterns=ALLOW_PATTERNS,
                                            ignore_patterns=IGNORE_PATTERNS))  # fmt: skip
    except EntryNotFoundError:  # LocalEntryNotFoundError, IncompleteSnapshotError: not here
        return None, []
    except (OSError, ValueError) as exc:
        raise _hub_error(exc, repo_id, revision, cache) from None
    return folder, missing_parts(folder)


def _download(repo_id: str, revision: str, cache: Path, config_only: bool) -> Path:
    """Download config.json (quietly: a few hundred bytes) or the model (progress on stderr)."""
    hub = _hub()
    try:
        if config_only:
            path = hub.hf_hub_download(repo_id, "config.json", revision=revision or None,
                                       cache_dir=cache, tqdm_class=_silent_tqdm())  # fmt: skip
            return Path(path).parent
        return Path(hub.snapshot_download(repo_id, revision=revision or None, cache_dir=cache,
                                          allow_patterns=ALLOW_PATTERNS,
                                          ignore_patterns=IGNORE_PATTERNS))  # fmt: skip
    except (OSError, ValueError) as exc:
        raise _hub_error(exc, repo_id, revision, cache) from None


def _silent_tqdm() -> type:
    """A tqdm that draws nothing (a config.json needs no progress bar; the TUI none at all)."""
    from tqdm.auto import tqdm

    class Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _not_cached(
    repo_id: str,
    revision: str,
    cache: Path,
    folder: Path | None,
    missing: list[str],
    fetch: bool,
) -> NotCachedError:
    name = named(repo_id, revision)
    why = "HF_HUB_OFFLINE is set" if fetch else "it was not downloaded"
    if folder is not None:  # e.g. only config.json, fetched to plan
        what = f"only part of it is in the Hugging Face cache ({folder} lacks {', '.join(missing)})"
    else:
        what = f"not a folder, and not in the Hugging Face cache {cache}"
    rev = f" --revision {revision}" if revision else ""
    return NotCachedError(
        f"model {name}: {what}, and {why}",
        hint=f"download it with `homelab-dp pull {repo_id}{rev}` where the network is "
        f"reachable (then copy {cache} here, or point HF_HUB_CACHE at a copy)"
        + (", or unset HF_HUB_OFFLINE to download it now" if fetch else ""),
    )


def _hub_error(exc: Exception, repo_id: str, revision: str, cache: Path) -> ModelSpecError:
    """huggingface_hub's error as one `error:` line and a hint (most specific first)."""
    from huggingface_hub import errors

    name = named(repo_id, revision)
    page = f"https://huggingface.co/{repo_id}"
    login = "`hf auth login` (or set HF_TOKEN)"
    if isinstance(exc, errors.GatedRepoError):
        return ModelSpecError(
            f"model {name}: gated on the Hugging Face Hub; this account has no access to it",
            hint=f"accept its terms on {page}, then log in with {login} on this machine",
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelSpecError(
            f"model {name}: no such model on the Hugging Face Hub (or it is private), and no "
            "such folder here",
            hint=f"check the id (org/name, as on {page}); a private model needs {login}; "
            "a local model folder is given by a path that exists",
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelSpecError(
            f"model {repo_id}: no revision {revision!r} on the Hugging Face Hub",
            hint=f'model.revision (--revision) is a branch, tag or commit of {page}; "" for main',
        )
    if isinstance(exc, errors.LocalEntryNotFoundError):  # the Hub could not be reached
        return ModelSpecError(
            f"model {name}: not in the Hugging Face cache {cache}, and the Hub could not "
            f"be reached ({type(exc.__cause__ or exc).__name__})",
            hint=f"check the network (or a proxy), or `homelab-dp pull {repo_id}` on a "
            f"machine online and copy {cache} here",
        )
    if isinstance(exc, errors.EntryNotFoundError):
        return ModelSpecError(
            f"model {name}: has no config.json on the Hub: not a transformers model",
            hint="give the id of a transformers causal language model, or a local model folder",
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return ModelSpecError(
            f"model {name}: the Hugging Face Hub answered HTTP {status}",
            hint=f"{login} if the model needs an account; otherwise try again later",
        )
    if isinstance(exc, ValueError):  # HFValidationError: not a repository id
        return ModelSpecError(
            f"model {name}: not a valid Hugging Face id ({exc})",
            hint="an id is org/name (letters, digits, - _ .); a folder is a path that exists",
        )
    return ModelSpecError(
        f"model {name}: could not be fetched into {cache}: {exc}",
        hint="check the network and the space in the cache folder (HF_HUB_CACHE moves it)",
    )


_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^{_PART}/{_PART}$")


def looks_like_hub_id(value: str) -> bool:
    """True when ``value`` has the shape of a Hub repository id (``Qwen/Qwen2.5-0.5B``)."""
    return (
        bool(_HUB_ID.match(value))
        and ".." not in value
        and not value.endswith((".json", ".jsonl", ".csv", ".parquet", ".txt", ".toml"))
    )
