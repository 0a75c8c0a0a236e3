"""A data set's tokenized samples, from the token cache or made once and cached (no torch).

`load_examples` resolves ``data.path`` (or ``data.eval_path``) to its source
(`homelab_dp.data.sources`), looks its samples up in the token cache
(`homelab_dp.data.token_cache`) and only on a miss reads, checks and tokenizes the records and
writes the entry. The preflight misses first and writes it; every rank then hits. Each process
logs which it was and notes it in the entry's ``uses.jsonl``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from homelab_dp.data import token_cache
from homelab_dp.data.records import check_columns, check_format_name
from homelab_dp.data.sources import Source, read_source, resolve_source, split_files
from homelab_dp.data.token_cache import loaded
from homelab_dp.data.tokenize import Example, eos_id, tokenize_records
from homelab_dp.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("homelab_dp.data")

EVAL_SPLITS = ("validation", "test")
"""The split data.eval_path takes from a folder or a Hub id (the first there is)."""


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


def check_seq_len(data_cfg: Any, seq_len_limit: int | None) -> None:
    """data.seq_len against the model's positions."""
    seq_len = int(data_cfg.seq_len)
    if seq_len_limit is not None and seq_len > seq_len_limit:
        raise DataError(
            f"data.seq_len: {seq_len} is beyond the model's {seq_len_limit} positions "
            "(max_position_embeddings)",
            hint=f"set data.seq_len to at most {seq_len_limit}",
        )


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


def load_examples(
    data_cfg: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len_limit: int | None,
    eval_data: bool = False,
    field: str = "data.path",
) -> Loaded:
    """The tokenized samples of data.path (or data.eval_path), from the token cache when it
    has them (``tokenizer`` may be a `TokenizerRef`: loaded only on a miss); checks data.seq_len against the model's positions first. Raises DataError
    naming the file and line or row of any bad record."""
    check_seq_len(data_cfg, seq_len_limit)
    fmt = str(getattr(data_cfg, "format", "auto"))
    check_format_name(fmt)
    columns = check_columns(getattr(data_cfg, "columns", None) or {})
    source = source_of(data_cfg, eval_data=eval_data, field=field)
    key = token_cache.cache_key(
        tokenizer, source.identity(), format=fmt, columns=columns, split=source.split
    )
    cached = token_cache.read(key)
    if cached is not None:
        token_cache.note_use(cached.folder, "hit")
        log.info("data: %d samples of %s from the token cache %s", len(cached.examples),
                 source.label, cached.folder)  # fmt: skip
        return Loaded(cached.examples, cached.fmt, cached.pad_id, source.label, "hit", key)
    started = time.perf_counter()
    records, wheres, resolved = read_source(source, fmt, columns)
    tokenizer = loaded(tokenizer)  # a miss: only now is a `TokenizerRef` loaded
    pad = tokenizer.pad_token_id
    pad_id = int(pad) if pad is not None else eos_id(tokenizer)  # padding is masked out
    examples = tokenize_records(records, resolved, tokenizer, where=wheres)
    folder = token_cache.write(key, examples, resolved, about=source.label, pad_id=pad_id)
    token_cache.note_use(folder, "built")
    log.info("data: tokenized %d samples of %s in %.2f s into the token cache %s",
             len(examples), source.label, time.perf_counter() - started, folder)  # fmt: skip
    return Loaded(examples, resolved, pad_id, source.label, "built", key)
