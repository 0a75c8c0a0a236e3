"""What the user has chosen so far: a preset, edits to its main fields, what-if hardware.

Shared by the Plan and Launch screens. Edits are kept as the text typed and become ``--set``
overrides, so the TUI plans and launches exactly what the equivalent CLI command would.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Literal

from homelab_dp.app.plan import Planned, make_plan
from homelab_dp.app.presets import Preset, load_named, open_preset
from homelab_dp.vocabulary import DISTRIBUTIONS, METHODS

DEFAULT_PRESET = "tiny-demo"


@dataclass(frozen=True)
class EditableField:
    """One editable preset field."""

    key: str
    """``section.name`` as in ``--set``."""
    label: str
    kind: Literal["text", "int", "choice"]
    choices: tuple[str, ...] = ()


FIELDS: tuple[EditableField, ...] = (
    EditableField("model.path", "model or id", "text"),  # the help line: folder or HF id
    EditableField("data.path", "data", "text"),
    EditableField("data.seq_len", "seq_len", "int"),
    EditableField("train.micro_batch", "micro-batch", "int"),
    EditableField("train.grad_accum", "accumulation", "int"),
    EditableField("train.method", "method", "choice", ("auto", *METHODS)),
    EditableField(
        "train.distribution",
        "distribution",
        "choice",
        ("auto", *DISTRIBUTIONS),
    ),
    EditableField("lora.r", "LoRA r", "int"),
    EditableField(
        "train.activation_checkpointing", "act. ckpt", "choice", ("auto", "true", "false")
    ),
)
FIELDS_BY_KEY = {f.key: f for f in FIELDS}


def field_value(preset: Preset, key: str) -> str:
    """A preset field as the text shown in its editor (booleans as true/false)."""
    section, name = key.split(".")
    value = getattr(getattr(preset, section), name)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def override(key: str, text: str) -> str:
    """The ``--set`` override for a field's text: numbers and booleans bare, strings quoted."""
    kind = FIELDS_BY_KEY[key].kind
    text = text.strip()
    if kind == "int" or (kind == "choice" and text in ("true", "false")):
        return f"{key}={text}"
    return f"{key}={json.dumps(text)}"  # a JSON string is a valid TOML basic string


@dataclass
class Session:
    """The choices the Plan and Launch screens share."""

    preset_name: str = ""
    base: Preset | None = None
    """The preset as its file says (paths not yet resolved)."""
    edits: dict[str, str] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)
    """Further ``--set KEY=VALUE`` overrides typed on the Launch screen."""
    gpus: str = ""
    """What-if hardware as ``--gpus`` takes it (2x24GiB, cpu:2); empty: the probed devices."""
    planned: Planned | None = None
    """The latest successful plan of these choices."""

    def load(self, name: str) -> None:
        """Choose a preset by name; forgets the edits. Raises PresetError."""
        self.base = load_named(name)
        self.preset_name = name
        self.edits.clear()
        self.planned = None

    def value(self, key: str) -> str:
        """The current text of a field: the edit, else the preset's value."""
        if key in self.edits:
            return self.edits[key]
        return field_value(self.base, key) if self.base is not None else ""

    def overrides(self) -> list[str]:
        """``--set`` overrides: the edited fields that differ from the preset, then the extras."""
        out = [
            override(key, text)
            for key, text in self.edits.items()
            if self.base is not None and text.strip() != field_value(self.base, key)
        ]
        return out + list(self.extra)

    def command(self, verb: str = "run") -> str:
        """The CLI command that does the same (``homelab-dp run NAME --set …``)."""
        args = ["homelab-dp", verb, self.preset_name or "PRESET"]
        if self.gpus:
            args += ["--gpus", self.gpus]
        for item in self.overrides():
            args += ["--set", item]
        return shlex.join(args)

    def open(self) -> Preset:
        """The preset with the overrides applied and paths resolved. Raises HomelabError."""
        return open_preset(self.preset_name, self.overrides())

    def plan(self, *, fetch: bool = True, find_seq_len: bool = False) -> Planned:
        """Plan the current choices (fast: no torch). A model given by Hugging Face id is
        planned from its config.json: the cached one, else downloaded when ``fetch`` (one small
        file; never while typing). ``find_seq_len``: with `plan --find-seq-len`'s answer (the
        longest data.seq_len; a second or two, so only when asked). Raises HomelabError."""
        self.planned = None  # a failed re-plan must not leave the old plan looking current
        self.planned = make_plan(self.open(), self.gpus.strip() or None, fetch=fetch,
                                 find_seq_len=find_seq_len)  # fmt: skip
        return self.planned
