"""Prompt templates: messages to the prompt a model answers, in the format it learned (for
generation), and the same template written as an Ollama `Modelfile` (for an export).

**The Modelfile**: ``FROM``, a ``TEMPLATE`` in the prompt format the run trained with, and
``PARAMETER stop`` lines.

The template is an Ollama (Go ``text/template``) template over ``.Messages`` that renders a
conversation to the same text `serving.replica.prompt_templates` renders it to for this run (`template_for`):

- **instruction**: `prompting`'s instruction rendering spelled in Go: system messages joined by
  a blank line go in front of the first instruction, consecutive user messages make one
  instruction, each earlier answer is followed by a blank line.
- **plain** (text / completion data): the messages' contents joined by newlines.
- **chat** (the tokenizer's Jinja chat template): a Jinja template cannot be translated into Go
  in general, so it is *probed*: rendered with marker contents for a system, user and assistant
  turn, cut into the text around each role's content and the generation prompt, and the cut is
  checked by rendering three conversations both ways. A template that does not cut (one that
  moves the system message into the first user turn, numbers turns, or trims contents) gets no
  ``TEMPLATE`` line: `ollama create` then uses its own detection of the chat template from
  ``tokenizer_config.json`` / ``chat_template.jinja``, and the export says so in its notes.

Checked with Go's ``text/template`` as Ollama runs it (``missingkey=zero``, consecutive
messages of one role joined by a blank line before the template sees them): the instruction
template renders every conversation as `serving.replica.prompt_templates` does; the plain and chat templates do
for every conversation without two messages of one role in a row (Ollama has joined those
before any template can tell them apart).

Neither template writes the beginning-of-sequence token when the tokenizer adds it by itself
(LLaMA's ``<s>``): Ollama's runtime adds it as training did, and a second one would change the
prompt. Stop strings: the eos token(s) text, and ``### Instruction:`` for instruction models
(where `serving.replica.prompt_templates` stops too).

Ollama reads a Modelfile's quoted values verbatim (no escapes), so a value is written between
double quotes, and a template between triple quotes; a template that holds three quotes in a
row cannot be written and is left out like an uncuttable chat template.

**Generation**: messages -> the prompt a model answers, in the template it learned.

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
from typing import TYPE_CHECKING, Any

from homelab_dp.data.blocks import format_instruction
from homelab_dp.data.samples import detect_format
from homelab_dp.errors import DataError
from homelab_dp.runs.model_ref import ModelRef

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def template_for(tokenizer: PreTrainedTokenizerBase, ref: ModelRef | None = None) -> Template:
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


def render_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template: Template
) -> str:
    """The prompt text for a conversation, ending where the model's answer starts."""
    if template.kind == CHAT:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if template.kind == INSTRUCTION:
        return _instruction_text(messages)
    return "\n".join(m["content"] for m in messages)


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
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


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: Any = None) -> set[int]:
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


# Contents that no template changes and no template text contains: the probe finds them again.
_MARKS = {
    "system": "QzSYSTEMzQ",
    "user": "QzUSERzQ",
    "assistant": "QzASSISTANTzQ",
    "user2": "QzNEXTzQ",
}

INSTRUCTION_GO = (
    '{{ $sys := "" }}{{ range .Messages }}{{ if eq .Role "system" }}{{ if $sys }}'
    '{{ $sys = printf "%s\\n\\n%s" $sys .Content }}{{ else }}{{ $sys = .Content }}{{ end }}'
    "{{ end }}{{ end }}"
    '{{ $pending := "" }}{{ $has := false }}{{ $first := true }}'
    '{{ range .Messages }}{{ if eq .Role "user" }}'
    '{{ if $has }}{{ $pending = printf "%s\\n\\n%s" $pending .Content }}'
    "{{ else }}{{ $pending = .Content }}{{ end }}{{ $has = true }}"
    '{{ else if eq .Role "assistant" }}'
    "### Instruction:\n"
    "{{ if and $first $sys }}{{ $sys }}{{ if $pending }}\n\n{{ $pending }}{{ end }}"
    "{{ else }}{{ $pending }}{{ end }}\n\n### Response:\n{{ .Content }}\n\n"
    '{{ $first = false }}{{ $pending = "" }}{{ $has = false }}{{ end }}{{ end }}'
    "### Instruction:\n"
    "{{ if and $first $sys }}{{ $sys }}{{ if $pending }}\n\n{{ $pending }}{{ end }}"
    "{{ else }}{{ $pending }}{{ end }}\n\n### Response:\n"
)
"""`serving.replica.prompt_templates`'s instruction rendering as an Ollama template (Go ``printf`` strings take
``\\n`` escapes; the Modelfile passes them through verbatim)."""

PLAIN_GO = "{{ range $i, $m := .Messages }}{{ if $i }}\n{{ end }}{{ $m.Content }}{{ end }}"
"""The messages' contents joined by newlines (text and completion models)."""


@dataclass(frozen=True)
class ChatParts:
    """A chat template cut around each role's content (see the module docstring)."""

    prefix: str
    """Text before the first message (the bos token removed where the tokenizer adds it)."""
    around: dict[str, tuple[str, str]]
    """Role -> (text before its content, text after it)."""
    generation: str
    """The generation prompt: what comes after the last message, where the answer starts."""

    def render(self, messages: list[dict[str, str]]) -> str:
        """The conversation as this cut renders it (what the Go template renders)."""
        out = [self.prefix]
        for m in messages:
            before, after = self.around[m["role"]]
            out.append(before + m["content"] + after)
        return "".join(out) + self.generation

    def go_template(self) -> str:
        """The cut as an Ollama template over ``.Messages``."""
        branches = []
        for role in ("system", "user", "assistant"):
            before, after = self.around[role]
            branches.append(f'if eq .Role "{role}" }}}}{before}{{{{ .Content }}}}{after}')
        body = "{{ " + "{{ else ".join(branches) + "{{ end }}"
        return f"{self.prefix}{{{{ range .Messages }}}}{body}{{{{ end }}}}{self.generation}"


@dataclass(frozen=True)
class Modelfile:
    """A Modelfile's text and what the reader should know about it."""

    text: str
    template_kind: str
    """``instruction``, ``plain``, ``chat`` (cut from the chat template) or ``none``."""
    notes: list[str] = field(default_factory=list)


def _chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation: bool = True
) -> str:
    return str(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    )


def _msg(role: str, mark: str | None = None) -> dict[str, str]:
    return {"role": role, "content": _MARKS[mark or role]}


def _between(text: str, start: str, end: str) -> str:
    """The text between the first ``start`` and the next ``end`` (ValueError when absent)."""
    i = text.index(start) + len(start)
    return text[i : text.index(end, i)]


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer puts its bos token in front of a text by itself."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return bos is not None and bool(ids) and ids[0] == bos


def cut_chat_template(tokenizer: PreTrainedTokenizerBase) -> ChatParts | None:
    """Probe the tokenizer's chat template into a `ChatParts`, or None where it does not cut."""
    user, asst, user2, system = (
        _msg("user"), _msg("assistant"), _msg("user", "user2"), _msg("system"),
    )  # fmt: skip
    try:
        one = _chat(tokenizer, [user], generation=False)
        one_gen = _chat(tokenizer, [user])
        two = _chat(tokenizer, [user, asst], generation=False)
        three = _chat(tokenizer, [user, asst, user2])
        with_system = _chat(tokenizer, [system, user])
        u, a, s = _MARKS["user"], _MARKS["assistant"], _MARKS["system"]
        if not one_gen.startswith(one):
            return None
        generation = one_gen[len(one) :]
        user_after = one[one.index(u) + len(u) :]
        head = one[: one.index(u)]
        asst_after = two[two.index(a) + len(a) :]
        asst_before = _between(two, u, a)[len(user_after) :]
        between_turns = _between(three, a, _MARKS["user2"])
        if not between_turns.startswith(asst_after):
            return None
        user_before = between_turns[len(asst_after) :]
        if not head.endswith(user_before):
            return None
        prefix = head[: len(head) - len(user_before)]
        sys_head = with_system[: with_system.index(s)]
        if not sys_head.startswith(prefix):
            return None
        sys_before = sys_head[len(prefix) :]
        sys_after = _between(with_system, s, u)
        if not sys_after.endswith(user_before):
            return None
        sys_after = sys_after[: len(sys_after) - len(user_before)]
        pieces = (prefix, generation, sys_before, sys_after, user_before, user_after,
                  asst_before, asst_after)  # fmt: skip
        if any("{{" in piece for piece in pieces):  # would open a Go action
            return None
    except Exception:  # noqa: BLE001 - a template that refuses a probe conversation does not cut
        return None
    around = {
        "system": (sys_before, sys_after),
        "user": (user_before, user_after),
        "assistant": (asst_before, asst_after),
    }
    parts = ChatParts(prefix, around, generation)
    checks = ([system, user, asst, user2], [user, asst, user2], [system, user])
    try:
        if any(parts.render(c) != _chat(tokenizer, c) for c in checks):
            return None
    except Exception:  # noqa: BLE001
        return None
    bos = getattr(tokenizer, "bos_token", None)
    if bos and prefix.startswith(bos) and adds_bos(tokenizer):
        parts = ChatParts(prefix[len(bos) :], around, generation)
    return parts


def stop_strings(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """The ``PARAMETER stop`` values, in order, without repeats or empty strings."""
    out: list[str] = []
    for text in (t for group in groups for t in group):
        if text and text not in out:
            out.append(text)
    return out


def _quoted(value: str) -> str:
    # Ollama takes what is between the outer quotes verbatim: nothing to escape.
    return f'"{value}"'


def build_modelfile(
    tokenizer: PreTrainedTokenizerBase, template: Template, eos_texts: list[str], source: str = "."
) -> Modelfile:
    """The Modelfile for a model in ``source`` (``.``: the folder it sits in) that answers in
    ``template`` (`serving.replica.prompt_templates.template_for`)."""
    notes: list[str] = []
    go: str | None
    turn_end: list[str] = []  # a chat template's end of an answer (ChatML's <|im_end|>)
    if template.kind == INSTRUCTION:
        go, kind = INSTRUCTION_GO, "instruction"
    elif template.kind == CHAT:
        parts = cut_chat_template(tokenizer)
        go, kind = (parts.go_template(), "chat") if parts is not None else (None, "none")
        if parts is not None:
            turn_end.append(parts.around["assistant"][1].strip())
        else:
            notes.append(
                "the chat template could not be cut into a Go template: no TEMPLATE line; "
                "`ollama create` detects the template from tokenizer_config.json itself"
            )
    else:
        go, kind = PLAIN_GO, "plain"
    if go is not None and '"""' in go:
        notes.append("the template holds three quotes in a row: no TEMPLATE line")
        go, kind = None, "none"
    lines = [f"FROM {source}"]
    if go is not None:
        lines.append(f'TEMPLATE """{go}"""')
    lines += [
        f"PARAMETER stop {_quoted(s)}" for s in stop_strings(eos_texts, template.stop, turn_end)
    ]
    return Modelfile("\n".join(lines) + "\n", kind, notes)
