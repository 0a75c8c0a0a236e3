"""Preference data as training blocks: pairs (DPO, ORPO) and labelled completions (KTO); no torch.

The pairs come down the same pipeline as SFT's samples (`homelab_dp.data.samples.load_pairs`:
source, records, columns, format checks ``preference`` and ``kto``, tokens, token cache); this
module only cuts them into `PairBlock` s, as `homelab_dp.data.blocks` cuts samples, and
`homelab_dp.data.eval_split.load_preference_train_eval` calls it for the training and eval data.

A pair is a prompt and two responses (chosen, rejected); a KTO record is a prompt, one
completion and its label (desirable or not), and a second, mismatched "KL" completion: the same
prompt with the completion of another record, fixed here (the next record in the order
``train.seed`` shuffles the data into), so it never depends on how a batch is split.

Each sequence (prompt + response, eos at the end) takes its tokens but the last as inputs, as
an SFT sample does, and must fit ``data.seq_len`` inputs: a response that does not fit is
truncated; a prompt that leaves no room for a response token is a `DataError` naming its
``file:line``. Labels are shifted like `homelab_dp.data.blocks.Block.labels` (``labels[t]`` is
the target of position t) and are -100 outside the responses.

- **pack = true**: whole pairs are best-fit packed (`homelab_dp.data.blocks.best_fit_decreasing`,
  longest first) into ONE row of ``2 · seq_len`` tokens: chosen then rejected, each sequence's
  positions restarting at 0, so transformers' packed-sequence detection keeps attention inside
  each sequence (exact); the padding at the end is a run of its own (label -100, mask 0,
  sequence -1).
- **pack = false**: one pair per block, two rows of ``seq_len`` (row 0 chosen, row 1 rejected),
  padded, with an attention mask.

Pairs whose chosen and rejected responses are the same tokens carry no signal: they are left
out and counted (`homelab_dp.data.eval_split.PreferenceTrainEval.identical`;
`identical_warning` says it once).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from homelab_dp.data.blocks import best_fit_decreasing
from homelab_dp.data.tokenize import IGNORE_INDEX, PairExample
from homelab_dp.errors import DataError


@dataclass
class PairBlock:
    """One block of preference data: the loop indexes it as it does an SFT block."""

    input_ids: list[list[int]]
    """Rows × row length: one row of 2·seq_len (packed) or two rows of seq_len (unpacked)."""
    labels: list[list[int]]
    """Shifted like SFT's: labels[r][t] is the target of position t; -100 outside responses."""
    attention_mask: list[list[int]]
    """1 for a real token, 0 for padding."""
    position_ids: list[list[int]]
    """Restart at 0 at the start of every sequence (and of the padding run)."""
    sequence: list[list[int]]
    """Per position: 2k = the chosen sequence of the block's pair k, 2k+1 = its rejected one
    (KTO: 2k = the completion, 2k+1 = its mismatched KL completion); -1 on padding."""
    desirable: list[int] = field(default_factory=list)
    """KTO only: per pair k, 1 desirable / 0 undesirable; [] for pairs."""
    n_pairs: int = 0
    """Pairs (KTO: completions) in this block: the loss's unit count."""

    @property
    def num_targets(self) -> int:
        """Tokens with a label, over every row (both sequences of every pair)."""
        return sum(t != IGNORE_INDEX for row in self.labels for t in row)

    @property
    def row_len(self) -> int:
        """Tokens per row."""
        return len(self.input_ids[0]) if self.input_ids else 0


Seq = tuple[list[int], list[int]]
"""One sequence of a block: its inputs and their (shifted) targets, of the same length."""


def sequence_of(prompt: list[int], response: list[int], seq_len: int, where: str) -> Seq:
    """A prompt and response as block inputs and shifted targets: at most ``seq_len`` inputs
    (a response that does not fit is truncated), targets -100 on the prompt. A DataError
    naming ``where`` when the prompt leaves no room for a response token."""
    ids = (prompt + response)[: seq_len + 1]
    labels = [IGNORE_INDEX] * len(prompt) + response
    targets = labels[1 : len(ids)]
    if not any(t != IGNORE_INDEX for t in targets):
        raise DataError(
            f"{where}: the prompt takes {len(prompt)} tokens, leaving no room for a response "
            f"token within data.seq_len {seq_len}",
            hint="raise data.seq_len (each of a pair's sequences must fit it), or shorten "
            "the prompt",
        )
    return ids[:-1], targets


@dataclass
class _Unit:
    """One pair's two sequences (KTO: the completion and its KL completion) and its label."""

    a: Seq
    b: Seq
    desirable: int = -1


def kto_partners(n: int, seed: int) -> list[int]:
    """For each of ``n`` KTO records, the record whose completion makes its mismatched KL
    completion: the next one in the order ``seed`` shuffles them into (a cycle; itself when
    ``n`` is 1). Fixed by the data and the seed alone, never by the batch split."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    partner = [0] * n
    for k, i in enumerate(order):
        partner[i] = order[(k + 1) % n]
    return partner


def units_of(
    pairs: Sequence[PairExample], fmt: str, seq_len: int, seed: int
) -> tuple[list[_Unit], int]:
    """The pairs' sequences for blocks, and how many pairs were left out for identical chosen
    and rejected responses (pairs only). Every pair is checked: the first whose prompt leaves
    no room for a response is raised with the count of the others."""
    partner = kto_partners(len(pairs), seed) if fmt == "kto" else []
    units = []
    identical = 0
    problems: list[DataError] = []
    for i, p in enumerate(pairs):
        other = pairs[partner[i]].chosen if partner else p.rejected
        try:
            a = sequence_of(p.prompt, p.chosen, seq_len, p.where)
            b = sequence_of(p.prompt, other, seq_len, p.where)
        except DataError as exc:
            problems.append(exc)
            continue
        if not partner and p.chosen == p.rejected:
            identical += 1
            continue
        units.append(_Unit(a, b, p.desirable))
    if problems:
        first, more = problems[0], len(problems) - 1
        if more:
            first = DataError(
                f"{first} (and {more} more record{'s' if more > 1 else ''} like it)",
                hint=first.hint,
            )
        raise first
    return units, identical


def _padded_row(
    seqs: Sequence[Seq], ids: list[int], row_len: int, pad_id: int, pack: bool
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """One row of sequences side by side (ids 2k, 2k+1 … given in ``ids``), padded."""
    inputs: list[int] = []
    targets: list[int] = []
    positions: list[int] = []
    sequence: list[int] = []
    for (x, y), s in zip(seqs, ids, strict=True):
        inputs += x
        targets += y
        positions += range(len(x))
        sequence += [s] * len(x)
    pad = row_len - len(inputs)
    # Packed: the padding is a run of its own; unpacked: positions simply count on.
    pad_positions = list(range(pad)) if pack else list(range(len(inputs), row_len))
    return (
        inputs + [pad_id] * pad,
        targets + [IGNORE_INDEX] * pad,
        [1] * len(inputs) + [0] * pad,
        positions + pad_positions,
        sequence + [-1] * pad,
    )


def build_pair_blocks(
    units: Sequence[_Unit], seq_len: int, pack: bool, pad_id: int, *, kto: bool = False
) -> list[PairBlock]:
    """PairBlocks (module docstring): pack, best-fit pairs into rows of 2·seq_len (bins in the
    order they were opened, pairs in data order inside); else one pair per block, two rows."""
    out = []
    if pack:
        sizes = [len(u.a[0]) + len(u.b[0]) for u in units]
        groups = best_fit_decreasing(sizes, 2 * seq_len)
    else:
        groups = [[i] for i in range(len(units))]
    for group in groups:
        chosen = [units[i] for i in group]
        if pack:
            seqs = [s for u in chosen for s in (u.a, u.b)]
            rows = [_padded_row(seqs, list(range(len(seqs))), 2 * seq_len, pad_id, True)]
        else:
            u = chosen[0]
            rows = [_padded_row([u.a], [0], seq_len, pad_id, False),
                    _padded_row([u.b], [1], seq_len, pad_id, False)]  # fmt: skip
        ids, labels, mask, positions, sequence = (list(col) for col in zip(*rows, strict=True))
        out.append(
            PairBlock(
                ids,
                labels,
                mask,
                positions,
                sequence,
                desirable=[u.desirable for u in chosen] if kto else [],
                n_pairs=len(chosen),
            )  # fmt: skip
        )
    return out


def pair_blocks_of(
    pairs: Sequence[PairExample], data_cfg: Any, fmt: str, pad_id: int, *, seed: int,
    where: str, min_blocks: int,
) -> tuple[list[PairBlock], int]:  # fmt: skip
    """`build_pair_blocks` as data.seq_len and data.pack say, checked (at least ``min_blocks``
    blocks; ``where`` names the data); also the count of identical pairs left out."""
    seq_len, pack = int(data_cfg.seq_len), bool(data_cfg.pack)
    if seq_len < 1:
        raise DataError(f"data.seq_len: must be at least 1, got {seq_len}", hint="e.g. 256")
    units, identical = units_of(pairs, fmt, seq_len, seed)
    blocks = build_pair_blocks(units, seq_len, pack, pad_id, kto=fmt == "kto")
    if len(blocks) < min_blocks:
        what = "pairs" if fmt == "preference" else "records"
        left = f" ({identical} identical pair(s) left out)" if identical else ""
        raise DataError(
            f"{where}: {len(blocks)} preference block(s) ({len(units)} {what}{left}), fewer "
            f"than world size × micro-batch = {min_blocks}",
            hint="add data, lower train.micro_batch, use fewer processes, or set data.pack = "
            "false (one pair per block)",
        )
    return blocks, identical


def identical_warning(count: int, label: str) -> str:
    """The one warning for pairs whose chosen and rejected responses are the same ("" if
    none): the preflight prints it and the run's start log repeats it."""
    if not count:
        return ""
    s = "s" if count != 1 else ""
    return (
        f"warning: {label}: {count} pair{s} with identical chosen and rejected responses "
        f"left out of training (no preference signal)"
    )
