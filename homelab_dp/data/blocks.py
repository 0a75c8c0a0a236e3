"""The data pipeline: a dataset file → validated records → tokenized examples → training blocks.

Used by the parent process for the preflight (every problem is a `DataError` naming the file,
line and field, raised before anything is launched) and by each worker to build its blocks.
No torch: blocks are plain lists; the worker turns them into tensors. The tokenizer is any
Hugging Face tokenizer (only ``__call__``, ``eos_token_id``, ``pad_token_id`` and
``apply_chat_template`` are used).

Loss masks per format (``-100`` = no loss):

- **text**: every token.
- **completion**: the completion only. Prompt and completion are tokenized separately and
  joined as given (no separator is added: start the completion with a space where one is meant).
- **instruction**: the output only, after the fixed prompt of `format_instruction`::

      ### Instruction:
      {instruction}

      ### Input:          <- these two lines only when "input" is not empty
      {input}

      ### Response:
      {output}</s>

- **chat**: the assistant turns only (their content and the end-of-turn marker the chat
  template writes), found by rendering the conversation prefix by prefix with the tokenizer's
  own ``apply_chat_template``; system and user turns and the role headers carry no loss.

Text, completion and instruction samples start with the special tokens the tokenizer adds
itself (``<s>`` for LLaMA-style tokenizers, nothing for others) and end with ``eos``; chat
samples are exactly what the template renders. The first token of a sample is never a target
(nothing in the sample precedes it).

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
from pathlib import Path
from typing import Any

from homelab_dp.data.records import FORMATS, detect_format, read_records, read_with_lines
from homelab_dp.errors import DataError

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "Block",
    "Example",
    "best_fit_decreasing",
    "build_blocks",
    "detect_format",
    "format_instruction",
    "blocks_of",
    "load_dataset",
    "load_examples",
    "read_records",
    "summarize",
    "tokenize_records",
]

IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized sample. ``labels[i]`` is ``input_ids[i]`` where token i is a target."""

    input_ids: list[int]
    labels: list[int]
    """Same length as input_ids; -100 where there is no loss (prompt, system/user turns)."""


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


def format_instruction(instruction: str, input: str = "") -> str:
    """The prompt of an instruction record; the output follows it directly."""
    if input:
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (one batched call: fast tokenizers)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _leading_ids(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text (``<s>`` for LLaMA, none for GPT-2)."""
    plain = _encode(tokenizer, ["a"])[0]
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k]
    return []


def _eos(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            "the model's tokenizer has no end-of-sequence (eos) token",
            hint="set eos_token in the model folder's tokenizer_config.json",
        )
    return int(eos)


def _prompt_answer(lead: list[int], prompt: list[int], answer: list[int], eos: int) -> Example:
    ids = lead + prompt + answer + [eos]
    labels = [IGNORE_INDEX] * (len(lead) + len(prompt)) + answer + [eos]
    labels[0] = IGNORE_INDEX
    return Example(ids, labels)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _chat_example(tokenizer: Any, messages: list[dict], where: str) -> Example:
    """Render a conversation; loss on the tokens that each assistant turn adds."""
    import jinja2  # a transformers dependency; only chat data needs it

    def ids_of(msgs: list[dict], generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=generation_prompt
        )
        return _encode(tokenizer, [text])[0]

    try:
        ids = ids_of(messages, False)
        labels = [IGNORE_INDEX] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # The turn starts after the prefix rendered with the assistant header and ends where
            # the prefix through this turn stops matching; comparing token prefixes (not
            # lengths) copes with templates that write extra text after the last message.
            start = _common_prefix(ids, ids_of(messages[:i], True))
            end = _common_prefix(ids, ids_of(messages[: i + 1], False))
            labels[start:end] = ids[start:end]
    except jinja2.TemplateError as exc:
        raise DataError(
            f"{where}: the model's chat template refused this conversation: {exc}",
            hint="fix the order of roles the template expects (often: system?, user, assistant, …)",
        ) from None
    if labels:
        labels[0] = IGNORE_INDEX
    return Example(ids, labels)


def tokenize_records(
    records: Sequence[dict],
    fmt: str,
    tokenizer: Any,
    *,
    where: Sequence[str] | None = None,
) -> list[Example]:
    """Tokenize validated records of one format, with the loss mask of the module docstring.

    ``where`` (optional, one per record, e.g. ``"data.jsonl:7"``) names records in errors.
    """
    if fmt not in FORMATS:
        raise DataError(f"data.format: unknown format {fmt!r}", hint=f"one of {FORMATS}")
    if fmt == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "chat data needs a chat template, and the model's tokenizer has none",
                hint="use a model whose tokenizer has a chat_template, "
                "or convert the data to the instruction format",
            )
        places = (
            list(where) if where is not None else [f"record {i + 1}" for i in range(len(records))]
        )
        return [
            _chat_example(tokenizer, r["messages"], w) for r, w in zip(records, places, strict=True)
        ]
    eos = _eos(tokenizer)
    lead = _leading_ids(tokenizer)
    if fmt == "text":
        out = []
        for ids in _encode(tokenizer, [r["text"] for r in records]):
            ids = lead + ids + [eos]
            out.append(Example(ids, [IGNORE_INDEX] + ids[1:]))
        return out
    if fmt == "completion":
        prompts = [r["prompt"] for r in records]
        answers = [r["completion"] for r in records]
    else:
        prompts = [format_instruction(r["instruction"], r.get("input") or "") for r in records]
        answers = [r["output"] for r in records]
    return [
        _prompt_answer(lead, p, a, eos)
        for p, a in zip(_encode(tokenizer, prompts), _encode(tokenizer, answers), strict=True)
    ]


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


def load_dataset(
    data_cfg: Any,
    tokenizer: Any,
    *,
    seq_len_limit: int | None,
    min_blocks: int,
) -> list[Block]:
    """Read, check, tokenize and block a dataset as the preset's [data] section says.

    ``data_cfg`` is a `homelab_dp.core.preset.DataSection` (path, format, seq_len, pack);
    ``seq_len_limit`` is the model's position limit (None: unknown); ``min_blocks`` is
    world_size × micro_batch. Raises DataError (file[:line], field, hint) for a missing or
    empty file, a bad JSON line, records that do not fit the format, chat without an assistant
    turn, seq_len beyond the model's positions, nothing with loss, or fewer blocks than needed.
    """
    path = Path(data_cfg.path)
    examples, fmt, pad_id = load_examples(data_cfg, path, tokenizer, seq_len_limit=seq_len_limit)
    return blocks_of(examples, data_cfg, fmt, pad_id, where=str(path), min_blocks=min_blocks)


def load_examples(
    data_cfg: Any, path: Path, tokenizer: Any, *, seq_len_limit: int | None
) -> tuple[list[Example], str, int]:
    """The tokenized samples of ``path`` (one per record, in file order), their format and the
    padding id; checks data.seq_len against the model's positions first."""
    seq_len = int(data_cfg.seq_len)
    if seq_len_limit is not None and seq_len > seq_len_limit:
        raise DataError(
            f"data.seq_len: {seq_len} is beyond the model's {seq_len_limit} positions "
            "(max_position_embeddings)",
            hint=f"set data.seq_len to at most {seq_len_limit}",
        )
    records, lines, fmt = read_with_lines(path, data_cfg.format)
    examples = tokenize_records(records, fmt, tokenizer, where=[f"{path}:{n}" for n in lines])
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # padding is masked out, so any id will do
        pad_id = _eos(tokenizer)
    return examples, fmt, int(pad_id)


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
