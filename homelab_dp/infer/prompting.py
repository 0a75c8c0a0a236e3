"""Messages -> the prompt a model answers, in the template it learned.

Which template (`template_for`):

- a run trained on instruction, completion or text data (its preset's format, or ``auto``
  detected from its data file while that file exists) answers in that format, even where its
  tokenizer also carries a chat template: the fine-tune taught it that prompt, not the chat one;
- otherwise (chat data, a bare model folder, a run whose data is gone) the tokenizer's chat
  template, rendered with ``add_generation_prompt=True``; with no chat template, the
  instruction template.

Rendering without a chat template:

- **instruction**: `homelab_dp.data.blocks.format_instruction`. Earlier turns are written as
  the model saw whole samples (prompt, answer, a blank line) and the last user message is the
  instruction to answer; a system message is prepended to the first instruction, separated by a
  blank line (the template has no system slot, and the ``Input`` slot is the user's data).
- **text / completion**: the messages' contents joined by newlines (plain continuation).

Stop strings: generation always stops at the model's eos token(s) (`eos_ids`); instruction
prompts also stop at ``### Instruction:`` so the answer ends where a new turn would start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp.data.blocks import format_instruction
from homelab_dp.data.records import detect_format
from homelab_dp.errors import DataError
from homelab_dp.rundir.results import ModelRef

CHAT = "chat"
INSTRUCTION = "instruction"
PLAIN = "plain"
INSTRUCTION_STOP = "### Instruction:"


@dataclass(frozen=True)
class Template:
    """How messages become a prompt for one model."""

    kind: str
    """``chat`` (the tokenizer's chat template), ``instruction`` or ``plain`` (concatenation)."""
    stop: tuple[str, ...] = field(default=())
    """Stop strings the template implies (besides the eos tokens)."""


def trained_format(ref: ModelRef | None) -> str | None:
    """The data format a run fine-tuned on (``auto`` detected from its data), or None."""
    if ref is None or ref.data_format is None:
        return None
    if ref.data_format != "auto":
        return ref.data_format
    if ref.data_path is None or not Path(ref.data_path).is_file():
        return None
    try:
        return detect_format(Path(ref.data_path))
    except DataError:
        return None


def template_for(tokenizer: Any, ref: ModelRef | None = None) -> Template:
    """The template ``ref``'s model answers in (see the module docstring)."""
    fmt = trained_format(ref)
    if fmt == INSTRUCTION:
        return Template(INSTRUCTION, (INSTRUCTION_STOP,))
    if fmt in ("text", "completion"):
        return Template(PLAIN)
    if getattr(tokenizer, "chat_template", None):
        return Template(CHAT)
    return Template(INSTRUCTION, (INSTRUCTION_STOP,))


def _instruction_text(messages: list[dict[str, str]]) -> str:
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"]
    out: list[str] = []
    pending: str | None = None  # a user message not yet answered
    for m in turns:
        if m["role"] == "user":
            # Two user messages in a row make one instruction.
            pending = m["content"] if pending is None else f"{pending}\n\n{m['content']}"
            continue
        out.append(_instruction(pending or "", system, not out) + m["content"] + "\n\n")
        pending = None
    out.append(_instruction(pending or "", system, not out))
    return "".join(out)


def _instruction(text: str, system: str, first: bool) -> str:
    if system and first:
        text = f"{system}\n\n{text}" if text else system
    return format_instruction(text)


def render_messages(tokenizer: Any, messages: list[dict[str, str]], template: Template) -> str:
    """The prompt text for a conversation, ending where the model's answer starts."""
    if template.kind == CHAT:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template.kind == INSTRUCTION:
        return _instruction_text(messages)
    return "\n".join(m["content"] for m in messages)


def prompt_ids(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    template: Template | None = None,
) -> list[int]:
    """Token ids of a raw prompt or of a conversation rendered with ``template``.

    A raw prompt and an instruction/plain rendering get the tokenizer's own leading special
    tokens (``<s>`` for LLaMA, as training added them); a chat template writes its own.
    """
    if messages is not None:
        template = template or template_for(tokenizer)
        text = render_messages(tokenizer, messages, template)
        special = template.kind != CHAT
    else:
        text, special = prompt or "", True
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def eos_ids(tokenizer: Any, model: Any = None) -> set[int]:
    """Every token id that ends an answer: the tokenizer's eos and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(i) for i in extra)
    return ids
