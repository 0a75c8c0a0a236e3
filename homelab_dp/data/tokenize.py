"""Tokenizing validated records into samples with their loss masks (no torch).

The tokenizer is any Hugging Face tokenizer (only ``__call__``, ``eos_token_id``,
``pad_token_id`` and ``apply_chat_template`` are used). `homelab_dp.data.samples` keeps what it
makes in the token cache, so a data set is tokenized once for the preflight and every rank.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from homelab_dp.data.records import FORMATS, PREFERENCE_FORMATS
from homelab_dp.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized sample. ``labels[i]`` is ``input_ids[i]`` where token i is a target."""

    input_ids: list[int]
    labels: list[int]
    """Same length as input_ids; -100 where there is no loss (prompt, system/user turns)."""


def format_instruction(instruction: str, input: str = "") -> str:
    """The prompt of an instruction record; the output follows it directly."""
    if input:
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (one batched call: fast tokenizers)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _leading_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The special tokens the tokenizer puts before a text (``<s>`` for LLaMA, none for GPT-2)."""
    plain = _encode(tokenizer, ["a"])[0]
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return full[:k]
    return []


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's end-of-sequence id, or a DataError when it has none."""
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


def _chat_example(tokenizer: PreTrainedTokenizerBase, messages: list[dict], where: str) -> Example:
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


@dataclass
class PairExample:
    """One tokenized preference pair (or KTO record): the prompt's tokens and each response's
    tokens, which follow the prompt directly (joined, they are the whole sequence)."""

    prompt: list[int]
    """The prompt's tokens, the tokenizer's leading special tokens first (no loss on them)."""
    chosen: list[int]
    """The chosen response's tokens, eos (or the chat template's end of turn) at the end; KTO:
    the completion's."""
    rejected: list[int]
    """The rejected response's tokens; [] for KTO."""
    where: str
    """The record's ``file:line`` (or ``file row N``), for errors found when blocks are cut."""
    desirable: int = -1
    """KTO: 1 desirable, 0 undesirable; -1 for a pair."""


def _chat_pair(
    tokenizer: PreTrainedTokenizerBase, record: dict, where: str
) -> tuple[list[int], list[int], list[int]]:
    """A chat pair's prompt and responses: the shared turns rendered with the generation
    prompt, and the tokens each last assistant turn adds (as `_chat_example` finds a turn)."""
    import jinja2  # a transformers dependency; only chat data needs it

    def ids_of(msgs: list[dict], generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=generation_prompt
        )
        return _encode(tokenizer, [text])[0]

    shared = record["messages"]
    try:
        prompt = ids_of(shared, True)
        chosen = ids_of([*shared, {"role": "assistant", "content": record["chosen"]}], False)
        rejected = ids_of([*shared, {"role": "assistant", "content": record["rejected"]}], False)
    except jinja2.TemplateError as exc:
        raise DataError(
            f"{where}: the model's chat template refused this conversation: {exc}",
            hint="fix the order of roles the template expects (often: system?, user, assistant, …)",
        ) from None
    # The prompt both sequences start with (a template may render the header differently once
    # an answer follows: the common part then stays the prompt, the rest is the response).
    cut = min(_common_prefix(chosen, prompt), _common_prefix(rejected, prompt))
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _sft_objective_refused(fmt: str, where: Sequence[str] | None) -> DataError:
    """The error for preference data given to supervised fine-tuning (train.objective sft)."""
    place = f"{where[0]}: " if where else ""
    if fmt == "kto":
        what, hint = "KTO records (prompt, completion, label)", 'set train.objective = "kto"'
    else:
        what = "preference pairs (chosen, rejected)"
        hint = 'set train.objective = "dpo" (or "orpo") to learn from pairs'
    return DataError(
        f"{place}the data holds {what}, and train.objective sft learns from single answers",
        hint=hint + ", or give SFT data (text, completion, instruction, chat)",
    )


def tokenize_pairs(
    records: Sequence[dict],
    fmt: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    where: Sequence[str],
) -> list[PairExample]:
    """Tokenize checked preference (or KTO) records (`homelab_dp.data.records.preference_record`
    forms). String pairs and KTO records as the completion format does: the leading special
    tokens and the prompt, then each response with eos; chat pairs with the chat template SFT
    uses (`_chat_pair`). ``where`` names each record."""
    if fmt not in PREFERENCE_FORMATS:
        raise DataError(f"data.format: {fmt!r} is not preference data", hint="preference | kto")
    eos = eos_id(tokenizer)
    if fmt == "kto":
        lead = _leading_ids(tokenizer)
        prompts = _encode(tokenizer, [r["prompt"] for r in records])
        answers = _encode(tokenizer, [r["completion"] for r in records])
        return [
            PairExample(lead + p, a + [eos], [], w, int(bool(r["label"])))
            for r, p, a, w in zip(records, prompts, answers, where, strict=True)
        ]
    chat = [i for i, r in enumerate(records) if "messages" in r]
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where[chat[0]]}: chat pairs need a chat template, and the model's tokenizer "
            "has none",
            hint="use a model whose tokenizer has a chat_template, or write the pairs as "
            '{"prompt","chosen","rejected"} strings',
        )
    plain = [i for i, r in enumerate(records) if "messages" not in r]
    out: list[PairExample | None] = [None] * len(records)
    if plain:
        lead = _leading_ids(tokenizer)
        texts = [records[i][k] for i in plain for k in ("prompt", "chosen", "rejected")]
        ids = _encode(tokenizer, texts)
        for n, i in enumerate(plain):
            p, c, r = ids[3 * n : 3 * n + 3]
            out[i] = PairExample(lead + p, c + [eos], r + [eos], where[i])
    for i in chat:
        prompt, chosen, rejected = _chat_pair(tokenizer, records[i], where[i])
        out[i] = PairExample(prompt, chosen, rejected, where[i])
    return [x for x in out if x is not None]


def tokenize_records(
    records: Sequence[dict],
    fmt: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    where: Sequence[str] | None = None,
) -> list[Example]:
    """Tokenize validated records of one format, with the loss mask of the module docstring.

    ``where`` (optional, one per record, e.g. ``"data.jsonl:7"``) names records in errors.
    """
    if fmt in PREFERENCE_FORMATS:
        raise _sft_objective_refused(fmt, where)
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
    eos = eos_id(tokenizer)
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
