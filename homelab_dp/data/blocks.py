"""Training blocks from tokenized samples: packing and padding (no torch).

The data pipeline (`homelab_dp.data.samples`): a dataset (`homelab_dp.data.sources`) → its
records read (`homelab_dp.data.reading`), columns renamed (`homelab_dp.data.columns`) and
checked (`homelab_dp.data.records`) → tokenized samples (`homelab_dp.data.tokenize`, loss masks;
kept in the token cache, `homelab_dp.data.token_cache`) → blocks (here, called by
`homelab_dp.data.eval_split` for the training and eval data).
Every problem is a `DataError` naming the file, row or line and field, raised by the preflight
before anything is launched; each worker builds the same blocks from the cached samples. Blocks
are plain lists; the worker turns them into tensors.

Blocks (`build_blocks`) hold exactly ``seq_len`` tokens with labels already shifted: the label
at position t is the target for position t, i.e. the next token, so the worker computes
``cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)`` with no slicing.

- **pack = true**: whole samples are bin-packed into blocks of ``seq_len`` inputs, best fit
  decreasing (longest first, each into the fullest block that still has room; equal lengths in
  file order, equally full blocks oldest first). A sample of n tokens takes n - 1 positions
  (inputs ``ids[:-1]``, targets ``labels[1:]``: its last token, ``eos``, is only a target), so a
  sample that fits is never split. ``position_ids`` restart at 0 at every sample, and the
  padding at the end of a block is a run of its own (positions 0..k-1, label -100,
  ``attention_mask`` 0). The worker gives the model these positions and no mask, and
  transformers masks attention to within each run (a block-diagonal causal mask for
  sdpa/eager, FlashAttention's varlen path): **attention never crosses samples**, so a packed
  block trains exactly as its samples would one per row. A longer sample is truncated to
  ``seq_len`` inputs (targets ``labels[1:seq_len + 1]``, as with pack = false) for completion,
  instruction and chat data; text is cut into consecutive pieces of ``seq_len`` inputs that
  share one token for the shift (every transition is trained once), each piece a sample.
- **pack = false**: one block per sample, truncated to ``seq_len`` (+1 target) or padded with
  ``pad_id``, ``attention_mask`` 0 and label -100 on the padding; positions 0..seq_len-1.

Blocks without a single target (a prompt longer than ``seq_len``) are dropped. Padded blocks
are in file order, packed ones in the order they were opened (their samples in file order);
shuffling is the worker's job (by seed, not world size).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from homelab_dp.data.records import FORMATS
from homelab_dp.data.tokenize import IGNORE_INDEX, Example, format_instruction, tokenize_records
from homelab_dp.errors import DataError

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "Block",
    "Example",
    "best_fit_decreasing",
    "build_blocks",
    "format_instruction",
    "blocks_of",
    "summarize",
    "tokenize_records",
]


@dataclass
class Block:
    """One training sequence of exactly seq_len tokens."""

    input_ids: list[int]
    labels: list[int]
    """Already shifted: labels[t] is the target for position t (the next token); -100 = none."""
    attention_mask: list[int]
    """1 for a real token, 0 for padding."""
    position_ids: list[int]
    """The position of each token within its own sample (packed blocks restart at each sample)."""

    @property
    def num_targets(self) -> int:
        """Tokens with a loss in this block."""
        return sum(label != IGNORE_INDEX for label in self.labels)


def _block(ids: list[int], targets: list[int], seq_len: int, pad_id: int) -> Block:
    """A block from up to seq_len inputs and their (shifted) targets, padded to seq_len."""
    pad = seq_len - len(ids)
    return Block(
        input_ids=ids + [pad_id] * pad,
        labels=targets + [IGNORE_INDEX] * (seq_len - len(targets)),
        attention_mask=[1] * len(ids) + [0] * pad,
        position_ids=list(range(seq_len)),
    )


Piece = tuple[list[int], list[int]]
"""One packed sample: its inputs and their (shifted) targets, of the same length."""


def _pieces(ex: Example, seq_len: int, split: bool) -> list[Piece]:
    """An example as packed samples: whole if its n - 1 inputs fit, else truncated to seq_len
    inputs or (``split``) cut into pieces of seq_len inputs sharing one token. Only pieces with
    a target are kept."""
    n = len(ex.input_ids) - 1  # the last token is only a target
    starts = range(0, n, seq_len) if split else range(min(n, 1))
    out = []
    for s in starts:
        targets = ex.labels[s + 1 : s + seq_len + 1]
        if any(t != IGNORE_INDEX for t in targets):
            out.append((ex.input_ids[s : s + len(targets)], targets))
    return out


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices (each bin's sizes sum to at most ``capacity``; every size fits).

    Longest first (equal sizes in index order), each item into the fullest bin that still has
    room (equally full bins: the oldest). The distinct free spaces are kept sorted for a
    bisect, each with a heap of its bins: O(n log n), plus list moves bounded by ``capacity``.
    Returns the bins in the order they were opened, each with its items in index order.
    """
    bins: list[list[int]] = []
    free: list[int] = []  # the distinct free spaces some bin has, ascending
    holders: dict[int, list[int]] = {}  # free space -> heap of the bins with it
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties by index
        size = sizes[i]
        k = bisect_left(free, size)
        if k < len(free):
            room = free[k]
            b = heapq.heappop(holders[room])
            if not holders[room]:
                del holders[room]
                free.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - size
        if left > 0:  # a full bin takes nothing more
            if left not in holders:
                insort(free, left)
                holders[left] = []
            heapq.heappush(holders[left], b)
    return [sorted(b) for b in bins]


def _packed_block(pieces: Sequence[Piece], seq_len: int, pad_id: int) -> Block:
    """Samples side by side, positions restarting at each; the padding is a run of its own."""
    ids: list[int] = []
    targets: list[int] = []
    positions: list[int] = []
    for inputs, shifted in pieces:
        ids += inputs
        targets += shifted
        positions += range(len(inputs))
    pad = seq_len - len(ids)
    return Block(
        input_ids=ids + [pad_id] * pad,
        labels=targets + [IGNORE_INDEX] * pad,
        attention_mask=[1] * len(ids) + [0] * pad,
        position_ids=positions + list(range(pad)),
    )


def attention_span(blocks: Sequence[Block]) -> float:
    """Keys a token attends over in the fullest block (`TrainShape.attention_span`): the largest
    Σ L² / seq_len over the blocks, L the lengths of a block's segments as the packed attention
    splits them (a new segment where positions restart or the padding begins). 0 for none."""
    best = 0
    for b in blocks:
        total, run = 0, 0
        for i, pos in enumerate(b.position_ids):
            starts = i > 0 and (pos == 0 or b.attention_mask[i] != b.attention_mask[i - 1])
            if starts:
                total += run * run
                run = 0
            run += 1
        best = max(best, (total + run * run) / max(1, len(b.position_ids)))
    return float(best)


def build_blocks(
    examples: Sequence[Example], seq_len: int, pack: bool, pad_id: int, *, split: bool = False
) -> list[Block]:
    """Cut examples into blocks of exactly seq_len tokens (see the module docstring).

    Packing bin-packs whole samples (`best_fit_decreasing`); a sample longer than seq_len
    inputs is truncated, or with ``split`` (text data) cut into pieces. Padding makes one block
    per example, truncated (``split`` is ignored). Blocks without any target are dropped.
    """
    if seq_len < 1:
        raise DataError(f"data.seq_len: must be at least 1, got {seq_len}", hint="e.g. 256")
    if pack:
        pieces = [p for ex in examples for p in _pieces(ex, seq_len, split)]
        bins = best_fit_decreasing([len(ids) for ids, _ in pieces], seq_len)
        return [_packed_block([pieces[i] for i in b], seq_len, pad_id) for b in bins]
    blocks = [
        _block(ex.input_ids[:seq_len], ex.labels[1 : seq_len + 1], seq_len, pad_id)
        for ex in examples
    ]
    return [b for b in blocks if b.num_targets]


def summarize(blocks: Sequence[Block]) -> dict[str, float]:
    """Counts for the preflight and the run's start event; ``fill`` is real / block tokens."""
    tokens = sum(sum(b.attention_mask) for b in blocks)
    size = sum(len(b.attention_mask) for b in blocks)
    return {
        "blocks": len(blocks),
        "tokens": tokens,
        "target_tokens": sum(b.num_targets for b in blocks),
        "padding_tokens": size - tokens,
        "fill": tokens / size if size else 0.0,
    }


def blocks_of(
    examples: Sequence[Example], data_cfg: Any, fmt: str, pad_id: int, *, where: str,
    min_blocks: int,
) -> list[Block]:  # fmt: skip
    """`build_blocks` as data.seq_len and data.pack say, checked: some token has a loss and
    there are at least ``min_blocks`` blocks (``where`` names the data in the errors)."""
    seq_len, pack = int(data_cfg.seq_len), bool(data_cfg.pack)
    blocks = build_blocks(examples, seq_len, pack, pad_id, split=fmt == "text")
    if not blocks:
        raise DataError(
            f"{where}: no token is left with a loss after masking "
            f"({fmt} format, seq_len {seq_len}, pack {str(pack).lower()})",
            hint="the prompts fill the whole sequence: raise data.seq_len",
        )
    if len(blocks) < min_blocks:
        raise DataError(
            f"{where}: {len(blocks)} training sequence{'s' if len(blocks) != 1 else ''} of "
            f"{seq_len} tokens, fewer than world size × micro-batch = {min_blocks}",
            hint="add data, lower data.seq_len or train.micro_batch, use fewer processes, "
            "or set data.pack = false (one sequence per sample)",
        )
    return blocks
