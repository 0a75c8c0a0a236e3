"""GRPO's data: prompts, each with the columns its rewards read (no torch).

A record is ``{"prompt": "..."}`` or a chat ``{"messages": [{"role", "content"}, ...]}`` whose
last turn is not the assistant's (the completion follows the chat template's assistant
header); every other column (``answer``, ...) is kept and passed to the reward functions by
name. ``data.columns`` renames columns as for the other formats. A .jsonl file, or a .json,
.csv or .parquet file or folder of them (`homelab_dp.data.sources`); every problem is reported
at once, each naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp.data.columns import check_columns, rename
from homelab_dp.data.reading import read_file
from homelab_dp.data.records import message_problems, read_problems
from homelab_dp.data.sources import BUILDERS, resolve_source
from homelab_dp.errors import DataError

MAX_PROBLEMS = 5
"""Problems listed in the error (the count says how many more)."""


@dataclass
class PromptRecord:
    """One prompt and the record's other columns."""

    prompt: str | list[dict]
    """The prompt text, or the chat messages before the completion."""
    columns: dict[str, Any] = field(default_factory=dict)
    """The record's other columns (passed to the rewards as keyword arguments)."""
    where: str = ""
    """``file:line`` (or ``file row N``): what an error names."""

    @property
    def chat(self) -> bool:
        """Whether the prompt is chat messages (the completion follows the chat template)."""
        return isinstance(self.prompt, list)


def prompt_problems(record: dict, where: str) -> list[str]:
    """What keeps ``record`` from being a GRPO prompt ([] when it is one)."""
    if "prompt" in record and "messages" in record:
        return [f"{where}: both 'prompt' and 'messages'; a prompt record has one of them"]
    if "prompt" in record:
        value = record["prompt"]
        if isinstance(value, list):  # chat messages under "prompt", as TRL's conversational data
            return _chat_problems(value, "prompt", where)
        if not isinstance(value, str) or not value.strip():
            return [f"{where}: field 'prompt' must be a non-empty string or a list of messages"]
        return []
    if "messages" in record:
        return _chat_problems(record["messages"], "messages", where)
    keys = ", ".join(record) or "none"
    return [f"{where}: no 'prompt' or 'messages' field (fields: {keys})"]


def _chat_problems(messages: Any, name: str, where: str) -> list[str]:
    problems = message_problems(messages, name, where)
    if not problems and messages[-1]["role"] == "assistant":
        problems.append(f"{where}: field '{name}' ends with an assistant turn; a prompt ends "
                        "before the answer the model generates")  # fmt: skip
    return problems


def prompt_record(record: dict, where: str) -> PromptRecord:
    """The `PromptRecord` of a checked record."""
    key = "prompt" if "prompt" in record else "messages"
    columns = {k: v for k, v in record.items() if k != key}
    return PromptRecord(record[key], columns, where)


def read_prompts(path: str, split: str = "train",
                 columns: dict[str, str] | None = None) -> list[PromptRecord]:  # fmt: skip
    """Every prompt of ``data.path`` (with ``data.split`` and ``data.columns``).

    Raises DataError naming the file and line of each unusable record (the first few), or
    for data without a prompt."""
    source = resolve_source(path, split)
    renames = check_columns(columns or {})
    values: list[dict] = []
    wheres: list[str] = []
    problems: list[str] = []
    for f in source.files():
        if f.suffix.lower() not in (*BUILDERS, ".jsonl"):
            raise DataError(f"{f}: GRPO prompts come from .jsonl, .json, .csv or .parquet files",
                            hint='write one {"prompt": ...} object a line')  # fmt: skip
        raw = rename(read_file(f), renames)
        problems += read_problems(raw)
        kept = [e for e in raw.entries if e.value is not None]
        values += [e.value for e in kept]
        wheres += [e.where for e in kept]
    records = []
    for value, where in zip(values, wheres, strict=True):
        found = prompt_problems(value, where)
        problems += found
        if not found:
            records.append(prompt_record(value, where))
    if problems:
        more = len(problems) - MAX_PROBLEMS
        extra = f" (and {more} more)" if more > 0 else ""
        raise DataError("; ".join(problems[:MAX_PROBLEMS]) + extra,
                        hint='a GRPO prompt is {"prompt": "..."} or {"messages": [...]} ending '
                        "before the answer, with any other columns for the rewards")  # fmt: skip
    if not records:
        raise DataError(f"data.path: {Path(path)} holds no prompts",
                        hint='write one {"prompt": ...} object a line')  # fmt: skip
    return records
