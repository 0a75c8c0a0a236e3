"""Where a data set comes from, and its records: files, folders and Hub ids (no torch).

``data.path`` (or ``data.eval_path``) names one of:

- a **file**: ``.jsonl`` (and any other name) is JSON lines and ``.txt`` plain text, read by
  `homelab_dp.data.records` (problems name ``file:line``); ``.json`` (a list of objects or JSON
  lines), ``.csv`` (a header row; every cell read as a string, an empty cell as "") and
  ``.parquet`` are read through the ``datasets`` library (problems name ``file row N``, the
  N-th record of the file from 1);
- a **folder** of such files (searched recursively): ``data.split`` names the split, as the
  folder's dataset card declares its splits (README.md's YAML ``configs``, default config),
  else by file name with the ``datasets`` library's own rules (``train*``, ``test*``,
  ``validation*``, ``data/train-0000…``; every file is ``train`` when no name says a split);
- a **Hub dataset id** (``org/name``, found nowhere on disk): its snapshot in the local
  Hugging Face cache (``$HF_HUB_CACHE``), offline, read as a folder. Nothing is downloaded.

``data.columns`` renames columns before the format is detected; a mapped column a file lacks
is named with the file. Each file's records are checked by `records.check_records`, so a
folder's problems name the file they are in.

`Source.identity` lists every data file with its size and modification time without importing
``datasets``: the token cache (`homelab_dp.data.token_cache`) is keyed by it, so a cache hit
reads no data file at all.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp import safe_files
from homelab_dp.data.records import (
    check_columns,
    check_format_name,
    check_records,
    detect_format,
    format_of,
    missing_columns,
    read_with_lines,
    rename_row,
)
from homelab_dp.errors import DataError
from homelab_dp.hub.hub_models import looks_like_hub_id

BUILDERS = {".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""Files read through ``datasets`` (its packaged builder for each suffix)."""
DATA_SUFFIXES = (".jsonl", ".txt", *BUILDERS)
"""The files a folder is made of (anything else in it is ignored)."""
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

    @property
    def label(self) -> str:
        """What errors call the data: the file, or ``NAME (split SPLIT)``."""
        return self.name if self.split is None else f"{self.name} (split {self.split})"

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


def read_source(
    source: Source, fmt: str, columns: dict[str, str] | None = None
) -> tuple[list[dict], list[str], str]:
    """The validated records of a source, where each is (``file:line`` or ``file row N``), and
    the format they are tokenized in (``auto`` resolved; ShareGPT read as ``chat``)."""
    check_format_name(fmt)
    columns = check_columns(columns or {})
    files = source.files()
    records: list[dict] = []
    wheres: list[str] = []
    final = fmt
    for f in files:  # the first file's first record tells an auto format
        if f.suffix.lower() in BUILDERS:
            rows, where = _rows(f, columns)
            fmt = format_of(list(rows[0]), where[0]) if fmt == "auto" else fmt
            got, final = check_records(rows, where, fmt, label="the file")
        else:
            fmt = detect_format(f, columns) if fmt == "auto" else fmt
            got, lines, final = read_with_lines(f, fmt, columns)
            where = [f"{f}:{n}" for n in lines]
        records += got
        wheres += where
    return records, wheres, final


def _rows(path: Path, columns: dict[str, str]) -> tuple[list[dict], list[str]]:
    """A columnar file's rows (null cells left out, columns renamed) and ``file row N`` each.

    The whole file is read, never a part: a stream left half-read can leave the reader's
    threads running into the interpreter's exit (an abort instead of exit code 2)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    kind = BUILDERS[path.suffix.lower()]
    if kind == "json":
        check_json_depth(path)  # before the library's parsers, which crash on deep nesting
    extra: dict[str, Any] = {}
    if kind == "csv":  # every cell a string: a number-like answer stays text, "" stays ""
        header = _csv_header(path)
        extra = {
            "features": datasets.Features({c: datasets.Value("string") for c in header}),
            "keep_default_na": False,
        }
    try:
        stream = datasets.load_dataset(
            kind, data_files=str(path), split="train", streaming=True, **extra
        )
        rows = [{k: v for k, v in row.items() if v is not None} for row in stream]
    except DataError:
        raise
    except Exception as exc:  # a damaged file: the library's own words, one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"{path}: cannot read it as {kind}: {first}",
            hint=f"check that the file is valid {kind}",
        ) from None
    if not rows:
        raise DataError(f"{path}: the file is empty", hint="a dataset needs at least one record")
    names = list(stream.features or {}) or list(dict.fromkeys(k for r in rows for k in r))
    missing_columns(names, columns, str(path))
    wheres = [f"{path} row {i}" for i in range(1, len(rows) + 1)]
    return [rename_row(r, columns) for r in rows], wheres


def check_json_depth(path: Path) -> None:
    """A DataError naming ``file:line`` when a ``.json`` file holds JSON nested too deeply or an
    integer too long to read (`homelab_dp.safe_files.parse`): the ``datasets`` library's JSON
    readers are not asked to, since one of them (pandas' ujson) ends the process with a
    segmentation fault on an array nested 100,000 deep. Each line is parsed (JSON lines, or
    one line of a document); the document whole only when it spreads over several lines."""
    try:
        text = safe_files.read_regular(path, MAX_JSON_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason})", hint="save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc})", hint="name a regular file") from None
    lines_parse = True
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            safe_files.parse(line)
        except safe_files.BadJson as exc:
            if exc.reason.startswith(_UNREADABLE):
                raise DataError(
                    f"{path}:{number}: not valid JSON ({exc.reason})", hint=_JSON_HINT
                ) from None
            lines_parse = False
    if lines_parse:
        return
    try:
        safe_files.parse(text)
    except safe_files.BadJson as exc:
        if exc.reason.startswith(_UNREADABLE):
            raise DataError(f"{path}: not valid JSON ({exc.reason})", hint=_JSON_HINT) from None


MAX_JSON_FILE_BYTES = 2**34
"""The largest ``.json`` file read (16 GiB: the ``datasets`` library holds it whole anyway)."""
_UNREADABLE = ("nested too deeply", "an integer of")
"""`homelab_dp.safe_files.BadJson` reasons no JSON reader should be asked to read."""
_JSON_HINT = "a record is a flat JSON object of strings (or chat messages): write it plainly"


def _csv_header(path: Path) -> list[str]:
    """The header row of a CSV file (the file must be UTF-8 text with one)."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as fh:  # a BOM is no part of a name
            header = next(csv.reader(fh), [])
    except UnicodeDecodeError:
        raise DataError(f"{path}:1: not UTF-8 text", hint="save the dataset as UTF-8") from None
    if not header:
        raise DataError(f"{path}:1: no header row", hint="the first row names the columns")
    return header
