"""The token cache: a data set's tokenized samples, made once and read by every process.

The preflight tokenizes a data set and writes its samples here; every rank of the run then
reads them instead of tokenizing again (a rank that finds them missing makes and writes them
itself). A later run of the same data and tokenizer reads them too.

Layout: ``$XDG_CACHE_HOME/homelab-dp/tokens/<key>/`` (``~/.cache`` by default):

- ``samples.arrow``: an Arrow IPC file of two ``list<int32>`` columns, ``input_ids`` and
  ``labels`` (one row per sample, in data order), memory-mapped when read; its schema metadata
  holds the format the samples were tokenized in, their count and what the data was.
  Written to a temporary name and renamed, so no reader ever sees half a file.
- ``pairs.arrow`` (preference data instead of samples): one row per pair or KTO record, its
  prompt's and responses' tokens and the record's file:line (`write_pairs`); keyed apart from
  SFT samples of the same file (``kind="pairs"`` in the key).
- ``uses.jsonl``: one line per process that used the entry, ``{"pid", "time", "use"}`` with
  use ``built`` (it tokenized) or ``hit`` (it read the file): the record of who tokenized.

An entry is not trusted when read: only a regular file is mapped (a FIFO or a device at its
path is no entry), and it is used only when its columns are the types written (``list<int32>``
without nulls: the values are read straight from the buffers), each sample's ``input_ids`` and
``labels`` are as long as each other, token ids are not negative and labels are ids or -100,
KTO's ``desirable`` is 0 or 1 (a pair's -1), the format is one this code writes and the
padding id a non-negative integer, and the sha256 of its columns matches the ``digest`` it was
written with (an edited token is seen). An entry that does not pass is no entry: the samples
are tokenized again and written over it.

The key is the sha256 of everything the samples depend on: the tokenizer (`tokenizer_digest`:
the content of its folder's files, which decide its class, vocabulary, special tokens and chat
template, so no tokenizer is loaded to look an entry up), the data's identity
(each file's path, size and modification time), data.format, data.columns and data.split, the
tokenizer libraries' versions, and this code (`CACHE_VERSION` and the tokenizing module's own
source). The samples do not depend on data.seq_len or data.pack (blocks are cut from them each
time, which is cheap), so those are left out: a new seq_len reuses the samples.

Clearing it is deleting the folder (``rm -rf ~/.cache/homelab-dp/tokens``); nothing else refers
to it.

A model's tokenizer named by its folder, loaded only when samples must be tokenized.

The token cache's key needs only the tokenizer's files (`homelab_dp.data.token_cache`), so a
process that finds its samples cached never loads a tokenizer, and never imports transformers
for it: the preflight of a run whose data was tokenized before skips seconds of imports.
"""

from __future__ import annotations

import array
import hashlib
import json
import mmap
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homelab_dp import json_safe, safe_files
from homelab_dp.data import tokenize
from homelab_dp.data.records import LAYOUTS
from homelab_dp.data.tokenize import Example, PairExample
from homelab_dp.user_files.paths import cache_home
from homelab_dp.user_files.private_write import replacing

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class TokenizerRef:
    """The tokenizer of ``folder``; ``load()`` makes it, the first time it is needed."""

    folder: Path
    load: Callable[[], Any]
    _loaded: Any = field(default=None, repr=False)

    def get(self) -> Any:
        """The tokenizer, loaded once."""
        if self._loaded is None:
            self._loaded = self.load()
        return self._loaded


def tokenizer_folder(tokenizer: PreTrainedTokenizerBase) -> Path | None:
    """The folder a tokenizer (or a `TokenizerRef`) was loaded from, when it is one."""
    if isinstance(tokenizer, TokenizerRef):
        return tokenizer.folder if tokenizer.folder.is_dir() else None
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    return folder if str(folder) and folder.is_dir() else None


def loaded(tokenizer: PreTrainedTokenizerBase) -> Any:
    """A tokenizer object: a `TokenizerRef` loads its own, anything else is one already."""
    return tokenizer.get() if isinstance(tokenizer, TokenizerRef) else tokenizer


CACHE_VERSION = 4  # 4: a digest of the columns in the metadata, checked when read
"""Raise it when the cache file's layout or the meaning of a sample changes."""
FILE = "samples.arrow"
USES = "uses.jsonl"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/homelab-dp/tokens`` (``~/.cache/homelab-dp/tokens`` by default)."""
    return cache_home() / "tokens"


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what makes a tokenizer tokenize as it does: the content of its folder's files
    (all but weights; a `TokenizerRef` is never loaded for it), or, for a tokenizer with no
    folder, its class, special tokens, chat template and serialized state."""
    h = hashlib.sha256()
    folder = tokenizer_folder(tokenizer)
    if folder is not None:
        for f in sorted(folder.iterdir()):
            if f.is_file() and not f.name.endswith(_WEIGHTS):
                h.update(f.name.encode())
                h.update(hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()
    h.update(type(tokenizer).__name__.encode())
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template"):
        h.update(repr(getattr(tokenizer, attr, None)).encode())
    h.update(repr(sorted(getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else b"")
    return h.hexdigest()


def _versions() -> dict[str, str]:
    out = {}
    for lib in ("tokenizers", "transformers"):
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = ""
    return out


def cache_key(tokenizer: PreTrainedTokenizerBase, identity: Any, **data: Any) -> str:
    """The entry's key: sha256 of the tokenizer, the data's ``identity`` and the ``data``
    settings that change the samples (format, columns, split), the libraries and this code."""
    parts = {
        "version": CACHE_VERSION,
        "code": hashlib.sha256(Path(tokenize.__file__).read_bytes()).hexdigest(),
        "libraries": _versions(),
        "tokenizer": tokenizer_digest(tokenizer),
        "data": identity,
        **data,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Cached:
    """An entry read back: the samples, the format they were tokenized in, and its folder."""

    examples: list[Example]
    fmt: str
    pad_id: int
    """The id blocks are padded with (masked out), as the tokenizer gave it."""
    folder: Path


def read(key: str) -> Cached | None:
    """The entry of ``key``, memory-mapped, or None when there is none (or it does not pass the
    checks of the module docstring: it is then made again)."""
    table, meta = _open_table(cache_root() / key / FILE, ("input_ids", "labels"))
    if table is None:
        return None
    ids, labels = (_lists(table.column(c)) for c in ("input_ids", "labels"))
    examples = [Example(i, lab) for i, lab in zip(ids, labels, strict=True)]
    return Cached(examples, meta["format"], int(meta["pad_id"]), cache_root() / key)


def _open_table(path: Path, lists: tuple[str, ...], others: dict[str, str] | None = None) -> Any:
    """The Arrow table of ``path`` and its metadata when it passes the file's checks: a
    regular file, an Arrow IPC file whose ``lists`` columns are ``list<int32>`` of tokens in
    range (`_tokens_ok`; samples' ids and labels as long as each other) and ``others`` of the
    named types, none with nulls, its ``count`` rows, a known format, an integer padding id,
    and its ``digest``; else (None, {})."""
    import pyarrow as pa

    others = others or {}
    try:
        fd = safe_files.open_regular(path)
    except OSError:  # missing, or a FIFO, a device, a folder: no entry
        return None, {}
    try:
        # Python's own mapping, read as a buffer: pyarrow's file readers start I/O threads,
        # and a rank or CLI that exits with those alive has been seen to abort ("terminate
        # called without an active exception") after its work was done.
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        options = pa.ipc.IpcReadOptions(use_threads=False)
        table = pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapped)), options=options).read_all()
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        ints = pa.list_(pa.int32())
        wanted = {**dict.fromkeys(lists, ints), **{k: getattr(pa, t)() for k, t in others.items()}}
        lengths = []
        for name, kind in wanted.items():
            column = table.column(name).combine_chunks()
            if column.type != kind or column.null_count:
                return None, {}
            if kind == ints:
                values = column.flatten()
                if values.null_count or not _tokens_ok(name, values.to_numpy()):
                    return None, {}
                offsets = column.offsets.to_numpy()
                lengths.append(offsets[1:] - offsets[:-1])
        if _lengths_differ(lists, lengths):
            return None, {}
    except (OSError, ValueError, pa.ArrowInvalid, KeyError, UnicodeDecodeError):
        return None, {}  # ValueError: an empty file
    finally:
        os.close(fd)
    if (meta.get("count") != str(table.num_rows) or meta.get("format") not in LAYOUTS
            or not re.fullmatch(r"[0-9]{1,12}", meta.get("pad_id", ""))
            or meta.get("digest") != _digest(table, (*lists, *others))):  # fmt: skip
        return None, {}
    return table, meta


def _digest(table: Any, names: tuple[str, ...]) -> str:
    """sha256 of ``table``'s columns ``names``: each list column's row lengths and int32
    values, each other column's values; what `write` and `write_pairs` store as ``digest``."""
    h = hashlib.sha256()
    for name in names:
        column = table.column(name).combine_chunks()
        h.update(f"{name}|{column.type}|{len(column)}|".encode())
        if hasattr(column, "flatten"):
            offsets = column.offsets.to_numpy(zero_copy_only=False)
            h.update((offsets - offsets[0]).astype("<i8").tobytes())
            values = column.flatten()
            values = values.fill_null(0) if values.null_count else values  # refused anyway
            h.update(values.to_numpy(zero_copy_only=False).astype("<i4").tobytes())
        else:
            h.update(repr(column.to_pylist()).encode())
    return h.hexdigest()


def _tokens_ok(name: str, values: Any) -> bool:
    """A list column's token values (a numpy array): ids are not negative, and a ``labels``
    column holds ids or -100 (no loss)."""
    if name == "labels":
        values = values[values != -100]
    return not values.size or int(values.min()) >= 0


def _lengths_differ(names: tuple[str, ...], lengths: list[Any]) -> bool:
    """Whether a samples entry's ``input_ids`` and ``labels`` rows differ in length (a pairs
    entry's columns may)."""
    if names != ("input_ids", "labels"):
        return False
    return bool((lengths[0] != lengths[1]).any())


def _lists(column: Any) -> list[list[int]]:
    """A ``list<int32>`` column as Python lists: the values and offsets read straight from the
    mapped buffers (no per-row conversion, no numpy or pandas), then sliced per row."""
    arr = column.combine_chunks()
    values = arr.flatten()
    flat = _ints(values.buffers()[1], values.offset, len(values))
    offsets = _ints(arr.buffers()[1], arr.offset, len(arr) + 1)
    return [
        flat[a - offsets[0] : b - offsets[0]]
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def _ints(buffer: Any, offset: int, count: int) -> list[int]:
    """``count`` int32 values of an Arrow buffer (little-endian) from element ``offset``."""
    out = array.array("i")
    if buffer is not None and count:
        out.frombytes(memoryview(buffer).cast("B")[offset * 4 : (offset + count) * 4])
        if sys.byteorder == "big":
            out.byteswap()
    return out.tolist()


def write(key: str, examples: Sequence[Example], fmt: str, about: str, pad_id: int) -> Path:
    """Store the samples under ``key`` atomically (a temporary file renamed into place); a
    cache folder that cannot be written leaves the samples uncached. Returns the folder."""
    import pyarrow as pa

    ints = pa.list_(pa.int32())
    schema = pa.schema([("input_ids", ints), ("labels", ints)])
    table = pa.table(
        [
            pa.array([e.input_ids for e in examples], type=ints),
            pa.array([e.labels for e in examples], type=ints),
        ],
        schema=schema,
    )
    return _write_table(key, FILE, table, ("input_ids", "labels"), fmt, about, pad_id)


def _write_table(
    key: str, name: str, table: Any, columns: tuple[str, ...], fmt: str, about: str, pad_id: int
) -> Path:
    """``table`` stored as the entry's file ``name`` with its metadata (the format, the row
    count, what the data was, the cache version, the padding id and the digest of
    ``columns``): written to a temporary name and renamed into place; a folder that cannot be
    written leaves it uncached. Returns the folder."""
    import pyarrow as pa

    folder = cache_root() / key
    meta = {"format": fmt, "count": str(table.num_rows), "data": about,
            "version": str(CACHE_VERSION), "pad_id": str(pad_id)}  # fmt: skip
    meta["digest"] = _digest(table, columns)
    table = table.replace_schema_metadata(meta)
    schema = table.schema
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with replacing(folder / name) as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_table(table, max_chunksize=4096)
    except OSError:
        pass  # not cached: tokenized again next time
    return folder


PAIRS_FILE = "pairs.arrow"
"""A preference entry's file: one row per pair (or KTO record)."""


@dataclass
class CachedPairs:
    """A preference entry read back: the pairs, their format and padding id, and its folder."""

    pairs: list[PairExample]
    fmt: str
    pad_id: int
    folder: Path


def write_pairs(key: str, pairs: Sequence[PairExample], fmt: str, about: str, pad_id: int) -> Path:
    """Store tokenized preference pairs (or KTO records) under ``key`` as `write` stores
    samples: an Arrow IPC file of ``prompt``, ``chosen``, ``rejected`` (``list<int32>``),
    ``where`` (the record's file:line, for errors found when blocks are cut) and
    ``desirable`` (int8), renamed into place. Returns the folder."""
    import pyarrow as pa

    ints = pa.list_(pa.int32())
    schema = pa.schema(
        [("prompt", ints), ("chosen", ints), ("rejected", ints), ("where", pa.string()),
         ("desirable", pa.int8())],
    )  # fmt: skip
    table = pa.table(
        [
            pa.array([p.prompt for p in pairs], type=ints),
            pa.array([p.chosen for p in pairs], type=ints),
            pa.array([p.rejected for p in pairs], type=ints),
            pa.array([p.where for p in pairs], type=pa.string()),
            pa.array([p.desirable for p in pairs], type=pa.int8()),
        ],
        schema=schema,
    )
    return _write_table(key, PAIRS_FILE, table, PAIR_COLUMNS, fmt, about, pad_id)


PAIR_COLUMNS = ("prompt", "chosen", "rejected", "where", "desirable")
DESIRABLE = {True: {0, 1}, False: {-1}}
"""``desirable`` values of a KTO entry (True) and of a pairs entry (False)."""


def read_pairs(key: str) -> CachedPairs | None:
    """The preference entry of ``key``, or None when there is none (or it does not pass the
    checks of the module docstring: it is then made again)."""
    lists = ("prompt", "chosen", "rejected")
    table, meta = _open_table(cache_root() / key / PAIRS_FILE, lists,
                              {"where": "string", "desirable": "int8"})  # fmt: skip
    if table is None:
        return None
    prompt, chosen, rejected = (_lists(table.column(c)) for c in lists)
    where = [str(w) for w in table.column("where").to_pylist()]
    desirable = [int(d) for d in table.column("desirable").to_pylist()]
    if not set(desirable) <= DESIRABLE[meta["format"] == "kto"]:
        return None
    pairs = [
        PairExample(*row) for row in zip(prompt, chosen, rejected, where, desirable, strict=True)
    ]
    return CachedPairs(pairs, meta["format"], int(meta["pad_id"]), cache_root() / key)


def lookup(tokenizer: PreTrainedTokenizerBase, identity: Any, *, kind: str,
           **data: Any) -> tuple[str, Cached | CachedPairs | None]:  # fmt: skip
    """The key of a data set's entry (`cache_key`; preference data, ``kind="pairs"``, keyed
    apart) and the entry when there is one (`read`, `read_pairs`)."""
    if kind == "pairs":
        key = cache_key(tokenizer, identity, **data, kind="pairs")
        return key, read_pairs(key)
    key = cache_key(tokenizer, identity, **data)
    return key, read(key)


def store(key: str, items: Sequence[Any], *, kind: str, fmt: str, about: str,
          pad_id: int) -> Path:  # fmt: skip
    """Write a data set's samples (`write`) or pairs (``kind="pairs"``, `write_pairs`) under
    ``key`` and note that this process built them. Returns the folder."""
    save = write_pairs if kind == "pairs" else write
    folder = save(key, items, fmt, about=about, pad_id=pad_id)
    note_use(folder, "built")
    return folder


def note_use(folder: Path, use: str) -> None:
    """Append this process's use (``built`` or ``hit``) to the entry's ``uses.jsonl`` in one
    ``O_APPEND`` write (lines of concurrent processes never interleave); best effort."""
    line = json_safe.dumps({"pid": os.getpid(), "time": round(time.time(), 3), "use": use}) + "\n"
    try:
        fd = os.open(folder / USES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def uses(folder: Path) -> list[dict[str, Any]]:
    """The entry's recorded uses, oldest first."""
    try:  # a regular file of at most 64 MiB; a line that is not a JSON object is skipped
        text = safe_files.read_regular(folder / USES, 64 * 2**20).decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            doc = safe_files.parse(line) if line.strip() else None
        except safe_files.BadJson:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out
