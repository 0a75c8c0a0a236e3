"""Training and eval blocks of a [data] section, SFT and preference data alike (no torch).

The top of the data path: `load_train_eval` (SFT) and `load_preference_train_eval` (DPO, ORPO,
KTO) have the data set's samples or pairs from the pipeline (`homelab_dp.data.samples`: source,
records, columns, format checks, tokens, token cache), hold out the eval share, and cut the
blocks (`homelab_dp.data.blocks`, `homelab_dp.data.preference_blocks`).

The eval data is either its own data set (``data.eval_path``, read and checked exactly like
the training data, in any supported format; of a folder or Hub id, its validation or test
split) or a held-out share of the training samples (``data.eval_fraction``). The held-out
samples are chosen from the *samples* — one per record of the file, before any packing or text
splitting — by ``train.seed`` alone (`split_indices`), so the eval set is the same on any world
size and micro-batch, and no piece of a held-out sample is ever trained on. The training blocks
are then built from the remaining samples and the eval blocks from the held-out ones, with the
same ``seq_len`` and ``pack``; pairs (KTO: records) are held out the same way.

Used by the preflight (`homelab_dp.app.runs.check_data`: the training blocks it counts are
those left after the split) and by every rank of the worker (`homelab_dp.train.loop.rank_setup`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from homelab_dp.data.blocks import Block, blocks_of
from homelab_dp.data.preference_blocks import PairBlock, pair_blocks_of
from homelab_dp.data.samples import load_examples, load_pairs
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


def _held_out(items: list, fraction: float, seed: int, label: str,
              noun: str) -> tuple[list, list, str, str]:  # fmt: skip
    """The items to train on and those data.eval_fraction holds out (`split_indices`), and
    what errors call each; a DataError when none is left to train on."""
    train_idx, held = split_indices(len(items), fraction, seed)
    if not train_idx:
        raise DataError(
            f"data.eval_fraction: {fraction} of the {len(items)} {noun}(s) of {label} "
            "leaves none to train on",
            hint="add data or lower data.eval_fraction",
        )
    where = f"{label} (after holding out {len(held)} {noun}(s) for data.eval_fraction)"
    held_where = f"{label} (the {len(held)} {noun}(s) held out by data.eval_fraction)"
    return [items[i] for i in train_idx], [items[i] for i in held], where, held_where


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
        kept, held, where, held_where = _held_out(examples, fraction, seed, path, "sample")
        train = blocks_of(kept, data_cfg, fmt, pad, where=where, min_blocks=min_blocks)
        evals = blocks_of(held, data_cfg, fmt, pad, where=held_where, min_blocks=1)
        return TrainEval(train, evals, len(held), (data.cache,), fmt)
    train = blocks_of(examples, data_cfg, fmt, pad, where=path, min_blocks=min_blocks)
    if not eval_path:
        return TrainEval(train, [], cache=(data.cache,), fmt=fmt)
    ev = load_examples(data_cfg, tokenizer, seq_len_limit=seq_len_limit, eval_data=True)
    evals = blocks_of(ev.examples, data_cfg, ev.fmt, pad, where=ev.label, min_blocks=1)
    return TrainEval(train, evals, cache=(data.cache, ev.cache), fmt=fmt)


def load_dataset(
    data_cfg: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len_limit: int | None,
    min_blocks: int,
) -> list[Block]:
    """Read, check, tokenize (or read from the token cache) and block a dataset as the
    preset's [data] section says, without eval data.

    ``data_cfg`` is a `homelab_dp.presets.preset.DataSection` (path, split, columns, format,
    seq_len, pack); ``seq_len_limit`` is the model's position limit (None: unknown);
    ``min_blocks`` is world_size × micro_batch. Raises DataError (file[:line] or row, field,
    hint) for a missing or empty file, a bad record, records that do not fit the format, chat
    without an assistant turn, seq_len beyond the model's positions, nothing with loss, or
    fewer blocks than needed.
    """
    data = load_examples(data_cfg, tokenizer, seq_len_limit=seq_len_limit)
    return blocks_of(
        data.examples, data_cfg, data.fmt, data.pad_id, where=data.label, min_blocks=min_blocks
    )


@dataclass
class PreferenceTrainEval:
    """The preference blocks to train and evaluate on (`load_preference_train_eval`)."""

    train: list[PairBlock]
    eval: list[PairBlock]
    """Empty: no eval data."""
    fmt: str = ""
    """The data's format: ``preference`` or ``kto``."""
    cache: tuple[str, ...] = ()
    """How this process had each data set's pairs: ``hit`` (token cache) or ``built``, the
    training data first."""
    identical: int = 0
    """Pairs left out because chosen and rejected are the same tokens (training and eval data)."""
    held_out: int = 0
    """Pairs (KTO: records) held out by data.eval_fraction, else 0."""
    label: str = ""
    """What messages call the training data (its file, or ``FOLDER (split NAME)``)."""


def load_preference_train_eval(
    data_cfg: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    objective: str,
    seed: int,
    seq_len_limit: int | None,
    min_blocks: int,
) -> PreferenceTrainEval:
    """The training blocks (at least ``min_blocks``) and eval blocks of a [data] section for
    a preference ``objective`` (dpo, orpo: pairs; kto: labelled completions), mirroring
    `load_train_eval`: data.eval_fraction holds out pairs (records)
    by ``seed`` before blocks are cut; data.eval_path is read as the training data. KTO's
    mismatched completions are drawn by ``seed`` within each split. Raises DataError (file:line
    or row, hint) for bad records, a format the objective does not train on, a prompt that
    leaves no room for a response, or too few blocks."""
    data = load_pairs(data_cfg, tokenizer, objective=objective, seq_len_limit=seq_len_limit)
    pairs, fmt, pad, path = data.pairs, data.fmt, data.pad_id, data.label
    fraction = float(getattr(data_cfg, "eval_fraction", 0.0) or 0.0)
    eval_path = str(getattr(data_cfg, "eval_path", "") or "")
    common = dict(fmt=fmt, label=path)
    if fraction > 0:
        kept, held, where, held_where = _held_out(pairs, fraction, seed, path, "pair")
        train, same = pair_blocks_of(kept, data_cfg, fmt, pad, seed=seed, where=where,
                                     min_blocks=min_blocks)  # fmt: skip
        evals, same_eval = pair_blocks_of(held, data_cfg, fmt, pad, seed=seed, where=held_where,
                                          min_blocks=1)  # fmt: skip
        return PreferenceTrainEval(train, evals, cache=(data.cache,), identical=same + same_eval,
                                   held_out=len(held), **common)  # fmt: skip
    train, same = pair_blocks_of(pairs, data_cfg, fmt, pad, seed=seed, where=path,
                                 min_blocks=min_blocks)  # fmt: skip
    if not eval_path:
        return PreferenceTrainEval(train, [], cache=(data.cache,), identical=same, **common)
    ev = load_pairs(data_cfg, tokenizer, objective=objective, seq_len_limit=seq_len_limit,
                    eval_data=True)  # fmt: skip
    evals, same_eval = pair_blocks_of(ev.pairs, data_cfg, ev.fmt, pad, seed=seed,
                                      where=ev.label, min_blocks=1)  # fmt: skip
    return PreferenceTrainEval(train, evals, cache=(data.cache, ev.cache),
                               identical=same + same_eval, **common)  # fmt: skip
