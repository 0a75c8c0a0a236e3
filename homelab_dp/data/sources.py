"""Where a data set comes from: files, folders and Hub ids (no torch).

The first step of the data pipeline (`homelab_dp.data.samples`): ``data.path`` (or
``data.eval_path``, `source_of`) is resolved to a `Source`, whose files are then read by
`homelab_dp.data.reading`. It names one of:

- a **file**: ``.jsonl`` (and any other name) is JSON lines and ``.txt`` plain text
  (problems name ``file:line``); ``.json`` (a list of objects or JSON lines), ``.csv`` (a
  header row) and ``.parquet`` are read through the ``datasets`` library (problems name
  ``file row N``, the N-th record of the file from 1);
- a **folder** of such files (searched recursively): ``data.split`` names the split, as the
  folder's dataset card declares its splits (README.md's YAML ``configs``, default config),
  else by file name with the ``datasets`` library's own rules (``train*``, ``test*``,
  ``validation*``, ``data/train-0000…``; every file is ``train`` when no name says a split);
  ``data.eval_path`` takes a folder's validation split, else its test split;
- a **Hub dataset id** (``org/name``, found nowhere on disk): its snapshot in the local
  Hugging Face cache (``$HF_HUB_CACHE``), offline, read as a folder. Nothing is downloaded.

`Source.identity` lists every data file with its size and modification time without importing
``datasets``: the token cache (`homelab_dp.data.token_cache`) is keyed by it, so a cache hit
reads no data file at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from homelab_dp.errors import DataError
from homelab_dp.hub.hub_models import looks_like_hub_id

BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""Files read through ``datasets`` (its packaged builder for each suffix)."""
DATA_SUFFIXES = (".jsonl", ".txt", *BUILDERS)
"""The files a folder is made of (anything else in it is ignored)."""
EVAL_SPLITS = ("validation", "test")
"""The split data.eval_path takes from a folder or a Hub id (the first there is)."""
_WHAT = (
    "a local .jsonl, .json, .csv, .parquet or .txt file, a folder of them, "
    "or a dataset id (org/name) in the Hugging Face cache"
)


@dataclass(frozen=True)
class Source:
    """A resolved data.path: one file, or a folder (a Hub snapshot is one) and its split."""

    root: Path
    name: str
    """The file, the folder or the Hub id."""
    split: str | None = None
    """The split of a folder; None for a single file."""
    label: str = field(init=False)
    """What errors call the data: the file, or ``NAME (split SPLIT)``."""

    def __post_init__(self) -> None:
        label = self.name if self.split is None else f"{self.name} (split {self.split})"
        object.__setattr__(self, "label", label)

    def identity(self) -> list[tuple[str, int, int]]:
        """Every data file's absolute path, size and modification time (ns): what the data *is* for
        the token cache (a folder lists all its files, whatever the split)."""
        files = [self.root] if self.split is None else _data_files(self.root)
        out = []
        for f in files:
            st = f.stat()  # follows a Hub snapshot's links to the blobs
            out.append((str(f.absolute()), st.st_size, st.st_mtime_ns))
        return out

    def files(self) -> list[Path]:
        """The files of the split, in order (one for a file source)."""
        if self.split is None:
            return [self.root]
        splits = split_files(self.root)
        if self.split not in splits:
            raise DataError(
                f"data.split: no split {self.split!r} in {self.root} "
                f"(splits found: {', '.join(splits) or 'none'})",
                hint="set data.split to one of them; split names come from the dataset card "
                "(README.md configs) or the file names (train*, test*, validation*)",
            )
        return splits[self.split]


def resolve_source(value: str, split: str, *, field: str = "data.path") -> Source:
    """The source ``value`` names (see the module docstring); ``split`` is used for folders.

    Raises DataError naming ``field`` for a path that does not exist, a folder without data
    files, or a Hub id missing from the local cache (with the command that fetches it).
    """
    path = Path(value).expanduser()
    if path.is_file():
        return Source(path, str(path))
    if path.is_dir():
        folder, name = path, str(path)
    elif looks_like_hub_id(value):
        folder, name = _hub_snapshot(value, field), value
    else:
        raise DataError(f"{field}: {value} does not exist", hint=f"{field} must be {_WHAT}")
    if not _data_files(folder):
        raise DataError(
            f"{field}: {folder} holds no data files ({', '.join(DATA_SUFFIXES)})",
            hint=f"{field} must be {_WHAT}",
        )
    return Source(folder, name, split)


def source_of(data_cfg: Any, *, eval_data: bool = False, field: str = "data.path") -> Source:
    """The source of data.path, or of data.eval_path (a folder's or Hub id's validation split,
    else its test split); DataError naming the field (``field`` for data.path: `eval` says
    --data) when it does not exist."""
    if not eval_data:
        split = str(getattr(data_cfg, "split", "train"))
        return resolve_source(str(data_cfg.path), split, field=field)
    value = str(data_cfg.eval_path)
    source = resolve_source(value, EVAL_SPLITS[0], field="data.eval_path")
    if source.split is None:
        return source
    found = split_files(source.root)
    for name in EVAL_SPLITS:
        if name in found:
            return replace(source, split=name)
    raise DataError(
        f"data.eval_path: {value} has no validation or test split "
        f"(splits found: {', '.join(found) or 'none'})",
        hint="name an eval file, or hold out training samples with data.eval_fraction",
    )


def _hub_snapshot(repo_id: str, field: str) -> Path:
    """The cached snapshot folder of a Hub dataset, offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except LocalEntryNotFoundError:
        raise DataError(
            f"{field}: the dataset {repo_id} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and nothing is downloaded here",
            hint=f"fetch it once: hf download {repo_id} --repo-type dataset "
            "(or point HF_HUB_CACHE at the cache that holds it)",
        ) from None


def _data_files(folder: Path) -> list[Path]:
    """The data files under ``folder``, sorted (hidden folders and files skipped)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [
            Path(dirpath, f)
            for f in filenames
            if not f.startswith(".") and f.lower().endswith(DATA_SUFFIXES)
        ]
    return sorted(out)


def split_files(folder: Path) -> dict[str, list[Path]]:
    """Each split's data files, by the ``datasets`` library's naming rules."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    files = _data_files(folder)
    try:
        patterns = _card_patterns(folder) or get_data_patterns(str(folder))
        found = DataFilesDict.from_patterns(patterns, str(folder))
    except Exception:  # the library found no data file it knows: every file is train
        return {"train": files}
    out = {}
    for name, matched in found.items():
        # The library resolves links; keep the folder's own paths (a Hub snapshot's names).
        chosen = {str(Path(f).resolve()) for f in matched}
        kept = [f for f in files if str(f.resolve()) in chosen]
        if kept:
            out[str(name)] = kept
    return out


def _card_patterns(folder: Path) -> dict[str, list[str]] | None:
    """The splits a dataset card (README.md's YAML ``configs``) declares for its default
    configuration, as the Hub shows them (``train_sft: data/train_sft-*``); None without."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    from datasets.data_files import sanitize_patterns
    from huggingface_hub.repocard import metadata_load

    try:
        configs = (metadata_load(card) or {}).get("configs") or []
    except Exception:  # a card whose YAML does not parse says nothing about splits
        return None
    configs = [c for c in configs if isinstance(c, dict) and c.get("data_files")]
    if not configs:
        return None
    default = [c for c in configs if c.get("default") or c.get("config_name") == "default"]
    return sanitize_patterns((default or configs)[0]["data_files"])
