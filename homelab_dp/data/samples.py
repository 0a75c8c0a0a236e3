"""The data pipeline: a data set's tokenized samples or pairs, from the token cache or made
once and cached (no torch).

`load_examples` (SFT) and `load_pairs` (preference data) take the same path, each step one
module, in order:

1. find the source: ``data.path`` or ``data.eval_path`` (`homelab_dp.data.sources`);
2. look it up in the token cache (`homelab_dp.data.token_cache`): on a hit, done;
3. read each file's records (`homelab_dp.data.reading`);
4. rename their columns as ``data.columns`` says (`homelab_dp.data.columns`);
5. check them against their format (`homelab_dp.data.records`);
6. tokenize them (`homelab_dp.data.tokenize`);
7. store them in the token cache.

Blocks are cut from what this returns (`homelab_dp.data.blocks`,
`homelab_dp.data.preference_blocks`; both with their eval data, `homelab_dp.data.eval_split`).
The preflight misses first and writes the entry; every rank then hits. Each process logs which
it was and notes it in the entry's ``uses.jsonl``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homelab_dp.data import columns as data_columns
from homelab_dp.data import reading, records, token_cache
from homelab_dp.data.sources import Source, source_of
from homelab_dp.data.tokenize import Example, PairExample, eos_id, tokenize_pairs, tokenize_records
from homelab_dp.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("homelab_dp.data")


@dataclass
class Loaded:
    """A data set's samples (one per record, in data order) and how they were had."""

    examples: list[Example]
    fmt: str
    """The format they were tokenized in (``auto`` resolved; ShareGPT is ``chat``)."""
    pad_id: int
    label: str
    """What errors call the data (the file, or ``FOLDER (split NAME)``)."""
    cache: str
    """``hit`` (read from the token cache) or ``built`` (tokenized here, then cached)."""
    key: str


@dataclass
class LoadedPairs:
    """A data set's tokenized pairs (one per record, in data order) and how they were had."""

    pairs: list[PairExample]
    fmt: str
    """``preference`` or ``kto``."""
    pad_id: int
    label: str
    """What errors call the data (the file, or ``FOLDER (split NAME)``)."""
    cache: str
    """``hit`` (read from the token cache) or ``built`` (tokenized here, then cached)."""
    key: str


def check_seq_len(data_cfg: Any, seq_len_limit: int | None) -> None:
    """data.seq_len against the model's positions."""
    seq_len = int(data_cfg.seq_len)
    if seq_len_limit is not None and seq_len > seq_len_limit:
        raise DataError(
            f"data.seq_len: {seq_len} is beyond the model's {seq_len_limit} positions "
            "(max_position_embeddings)",
            hint=f"set data.seq_len to at most {seq_len_limit}",
        )


def load_examples(
    data_cfg: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len_limit: int | None,
    eval_data: bool = False,
    field: str = "data.path",
) -> Loaded:
    """The tokenized samples of data.path (or data.eval_path), from the token cache when it
    has them (``tokenizer`` may be a `TokenizerRef`: loaded only on a miss); checks data.seq_len
    against the model's positions first. Raises DataError naming the file and line or row of
    any bad record."""
    got = _load(data_cfg, tokenizer, None, seq_len_limit, eval_data, field)
    return Loaded(*got)


def load_pairs(data_cfg: Any, tokenizer: PreTrainedTokenizerBase, *, objective: str,
               seq_len_limit: int | None, eval_data: bool = False,
               field: str = "data.path") -> LoadedPairs:  # fmt: skip
    """The tokenized pairs of data.path (or data.eval_path) for ``objective``, as
    `load_examples` has samples. The data's format must be the one the objective trains on
    (`homelab_dp.data.records.check_objective_format`), checked before anything is tokenized.
    Raises DataError naming the file and line or row of any bad record."""
    got = _load(data_cfg, tokenizer, objective, seq_len_limit, eval_data, field)
    return LoadedPairs(*got)


def _load(
    data_cfg: Any, tokenizer: Any, objective: str | None, seq_len_limit: int | None,
    eval_data: bool, field: str,
) -> tuple[list[Any], str, int, str, str, str]:  # fmt: skip
    """The pipeline of the module docstring: samples (``objective`` None) or pairs for a
    preference ``objective``; their format, padding id, label, ``hit``/``built`` and key."""
    check_seq_len(data_cfg, seq_len_limit)
    fmt = str(getattr(data_cfg, "format", "auto"))
    records.check_format_name(fmt)
    renames = data_columns.check_columns(getattr(data_cfg, "columns", None) or {})
    source = source_of(data_cfg, eval_data=eval_data, field=field)
    pairs = objective is not None
    if objective is not None and fmt != "auto":  # a named format is checked before any file is read
        records.check_objective_format(objective, fmt, f"data.format {fmt}")
    what = "pairs" if pairs else "samples"
    key, cached = token_cache.lookup(tokenizer, source.identity(), kind=what, format=fmt,
                                     columns=renames, split=source.split)  # fmt: skip
    if cached is not None:
        if objective is not None:
            records.check_objective_format(objective, cached.fmt, source.label)
        items = cached.pairs if isinstance(cached, token_cache.CachedPairs) else cached.examples
        token_cache.note_use(cached.folder, "hit")
        log.info("data: %d %s of %s from the token cache %s", len(items), what, source.label,
                 cached.folder)  # fmt: skip
        return items, cached.fmt, cached.pad_id, source.label, "hit", key
    started = time.perf_counter()
    checked, wheres, resolved = _read(source, fmt, renames)
    if objective is not None:
        records.check_objective_format(objective, resolved, source.label)
    tokenizer = token_cache.loaded(tokenizer)  # a miss: only now is a `TokenizerRef` loaded
    pad = tokenizer.pad_token_id
    pad_id = int(pad) if pad is not None else eos_id(tokenizer)  # padding is masked out
    tokenized: list[Any] = (
        tokenize_pairs(checked, resolved, tokenizer, where=wheres)
        if pairs
        else tokenize_records(checked, resolved, tokenizer, where=wheres)
    )
    folder = token_cache.store(key, tokenized, kind=what, fmt=resolved, about=source.label,
                               pad_id=pad_id)  # fmt: skip
    log.info("data: tokenized %d %s of %s in %.2f s into the token cache %s", len(tokenized),
             what, source.label, time.perf_counter() - started, folder)  # fmt: skip
    return tokenized, resolved, pad_id, source.label, "built", key


def read_source(
    source: Source, fmt: str, columns: dict[str, str] | None = None
) -> tuple[list[dict], list[str], str]:
    """The checked records of a source (steps 3 to 5 of the module docstring, file by file),
    where each is (``file:line`` or ``file row N``), and the format they are tokenized in
    (``auto`` resolved by the first file's first record; ShareGPT read as ``chat``)."""
    records.check_format_name(fmt)
    return _read(source, fmt, data_columns.check_columns(columns or {}))


def _read(source: Source, fmt: str, renames: dict[str, str]) -> tuple[list[dict], list[str], str]:
    """`read_source` of a checked data.format and data.columns."""
    out: list[dict] = []
    wheres: list[str] = []
    final = fmt
    for f in source.files():
        raw = data_columns.rename(reading.read_file(f), renames)
        got, where, fmt, final = records.check_file(raw, fmt)
        out += got
        wheres += where
    return out, wheres, final


def read_with_lines(
    path: Path, fmt: str, columns: dict[str, str] | None = None
) -> tuple[list[dict], list[int], str]:
    """The checked records of one JSON lines (or ``.txt``) file, the line each starts on, and
    the format (``auto`` resolved; ShareGPT records come back as chat records, format
    ``chat``). ``columns``: data.columns."""
    records.check_format_name(fmt)
    raw = data_columns.rename(reading.read_file(Path(path), columnar=False), columns or {})
    got, _, _, final = records.check_file(raw, fmt)
    lines = [e.line for e in raw.entries if e.value is not None]
    return got, lines, final


def read_records(path: Path, fmt: str) -> list[dict]:
    """Checked records of a JSON lines (or ``.txt``) file (``fmt`` may be ``auto``)."""
    return read_with_lines(Path(path), fmt)[0]


def detect_format(path: Path, columns: dict[str, str] | None = None) -> str:
    """The format of a JSON lines (or ``.txt``) file from its first record's keys, after
    ``columns`` (data.columns): a DataError for a missing or empty file, a bad first line, or
    keys that fit no format (naming the keys found and the accepted ones)."""
    raw = reading.read_file(Path(path), columnar=False, first_only=True)
    return records.first_format(data_columns.rename(raw, columns or {}))
