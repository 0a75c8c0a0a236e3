"""Training and eval data for validation while training (no torch).

The eval data is either its own data set (``data.eval_path``, read and checked exactly like
the training data, in any supported format; of a folder or Hub id, its validation or test
split) or a held-out share of the training samples (``data.eval_fraction``). The held-out samples are chosen from the *samples* — one per record
of the file, before any packing or text splitting — by ``train.seed`` alone (`split_indices`),
so the eval set is the same on any world size and micro-batch, and no piece of a held-out
sample is ever trained on. The training blocks are then built from the remaining samples and
the eval blocks from the held-out ones, with the same ``seq_len`` and ``pack``.

Used by the preflight (`homelab_dp.app.runs.check_data`: the training blocks it counts are
those left after the split) and by every rank of the worker (`homelab_dp.train.loop.rank_setup`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from homelab_dp.data.blocks import Block, blocks_of
from homelab_dp.data.samples import load_examples
from homelab_dp.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` samples a fraction holds out: rounded, at least one when the fraction
    is above 0 (0 when it is 0)."""
    return max(1, round(n * fraction)) if fraction > 0 and n else 0


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices, each ascending: `held_out_count` of ``range(n)``
    drawn by ``seed`` (a `random.Random` of its own: the same on every rank and run)."""
    k = held_out_count(n, fraction)
    held = sorted(random.Random(seed).sample(range(n), k))
    chosen = set(held)
    return [i for i in range(n) if i not in chosen], held


@dataclass
class TrainEval:
    """The blocks to train on and the blocks to evaluate on (empty: no eval data)."""

    train: list[Block]
    eval: list[Block]
    held_out: int = 0
    """Samples held out of the training file (data.eval_fraction), else 0."""
    cache: tuple[str, ...] = ()
    """How this process had each data set's samples: ``hit`` (the token cache) or ``built``
    (tokenized here), the training data first (`homelab_dp.data.samples.Loaded.cache`)."""
    fmt: str = ""
    """The training data's format, ``auto`` resolved (what the model learns to answer in)."""


def load_train_eval(
    data_cfg: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    seq_len_limit: int | None,
    min_blocks: int,
) -> TrainEval:
    """The training blocks (at least ``min_blocks``) and the eval blocks of a [data] section.

    ``data_cfg`` is a `homelab_dp.presets.preset.DataSection`; sections of older code without
    the eval fields read as "no eval data". The samples come from the token cache when it has
    them (`homelab_dp.data.samples`). Raises DataError naming the file (and line or row) of
    any bad record in either data set, or the field whose split leaves nothing to train or
    evaluate on.
    """
    data = load_examples(data_cfg, tokenizer, seq_len_limit=seq_len_limit)
    examples, fmt, pad, path = data.examples, data.fmt, data.pad_id, data.label
    fraction = float(getattr(data_cfg, "eval_fraction", 0.0) or 0.0)
    eval_path = str(getattr(data_cfg, "eval_path", "") or "")
    if fraction > 0:
        train_idx, held = split_indices(len(examples), fraction, seed)
        if not train_idx:
            raise DataError(
                f"data.eval_fraction: {fraction} of the {len(examples)} sample(s) of {path} "
                "leaves none to train on",
                hint="add data or lower data.eval_fraction",
            )
        where = f"{path} (after holding out {len(held)} sample(s) for data.eval_fraction)"
        train = blocks_of(
            [examples[i] for i in train_idx], data_cfg, fmt, pad, where=where, min_blocks=min_blocks
        )
        held_where = f"{path} (the {len(held)} sample(s) held out by data.eval_fraction)"
        evals = blocks_of(
            [examples[i] for i in held], data_cfg, fmt, pad, where=held_where, min_blocks=1
        )
        return TrainEval(train, evals, len(held), (data.cache,), fmt)
    train = blocks_of(examples, data_cfg, fmt, pad, where=path, min_blocks=min_blocks)
    if not eval_path:
        return TrainEval(train, [], cache=(data.cache,), fmt=fmt)
    ev = load_examples(data_cfg, tokenizer, seq_len_limit=seq_len_limit, eval_data=True)
    evals = blocks_of(ev.examples, data_cfg, ev.fmt, pad, where=ev.label, min_blocks=1)
    return TrainEval(train, evals, cache=(data.cache, ev.cache), fmt=fmt)
