"""Record layouts before the format checks: column mapping and ShareGPT conversations.

Pure standard library. ``data.columns`` maps a format's field to the data's column
(``{instruction = "question", output = "answer"}``): each record's column is renamed to the
field before the format is detected or checked, in every kind of file.

ShareGPT records (``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``)
are checked as they are, so a problem names ``conversations[i].from``, and then converted to
the chat format's OpenAI messages (``human`` → user, ``gpt`` → assistant). Turns already
written as ``{"role", "content"}`` inside ``conversations`` are taken as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from homelab_dp.errors import DataError

FIELDS = (
    "text", "prompt", "completion", "instruction", "input", "output", "messages",
    "conversations",
)  # fmt: skip
"""The fields ``data.columns`` may map (every format's keys)."""

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}
"""ShareGPT's ``from`` values and the chat role each becomes."""


def check_columns(columns: Mapping[str, str]) -> dict[str, str]:
    """``data.columns`` as a plain dict, or a DataError naming an unknown field or a column
    mapped twice."""
    columns = dict(columns or {})
    for name, column in columns.items():
        if name not in FIELDS:
            raise DataError(
                f"data.columns.{name}: not a field of any format",
                hint=f"map one of {', '.join(FIELDS)} to your data's column, "
                'e.g. {instruction = "question", output = "answer"}',
            )
        if not isinstance(column, str) or not column:
            raise DataError(f"data.columns.{name}: must name a column", hint='e.g. "question"')
    seen: dict[str, str] = {}
    for name, column in columns.items():
        if column in seen:
            raise DataError(
                f"data.columns: column {column!r} is mapped to both {seen[column]} and {name}",
                hint="map each column to one field",
            )
        seen[column] = name
    return columns


def rename_columns(record: dict, columns: Mapping[str, str], where: str) -> tuple[dict, str]:
    """The record with each mapped column renamed to its field, and a problem ("" if none):
    a mapped column the record lacks."""
    if not columns:
        return record, ""
    out = dict(record)
    for name, column in columns.items():
        if column not in out:
            return record, f"{where}: column {column!r} (data.columns.{name}) missing"
        value = out.pop(column)
        out[name] = value
    return out, ""


def rename_row(row: dict, columns: Mapping[str, str]) -> dict:
    """A columnar file's row with its mapped columns renamed (a null cell was left out of the
    row: its field is then missing, as the format checks say)."""
    if not columns:
        return row
    field_of = {column: name for name, column in columns.items()}
    # A column already named like a mapped field gives way to the mapping.
    return {field_of.get(k, k): v for k, v in row.items() if k in field_of or k not in columns}


def missing_columns(names: list[str], columns: Mapping[str, str], where: str) -> None:
    """A DataError for the first mapped column a file's header lacks (columnar files)."""
    for name, column in columns.items():
        if column not in names:
            raise DataError(
                f"{where}: no column {column!r} (data.columns.{name}); "
                f"its columns: {', '.join(names) or 'none'}",
                hint="fix data.columns to name one of the file's columns",
            )


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a value")


def sharegpt_problems(record: dict, where: str) -> list[str]:
    """Every problem of a ShareGPT record (empty: it converts to a chat record)."""
    turns = record.get("conversations")
    if "conversations" not in record or turns is None:
        return [f"{where}: field 'conversations' missing"]
    if not isinstance(turns, list) or not turns:
        what = "empty" if isinstance(turns, list) else _kind(turns)
        return [f"{where}: field 'conversations' must be a non-empty list, got {what}"]
    problems = []
    roles = []
    for i, turn in enumerate(turns):
        field = f"conversations[{i}]"
        if not isinstance(turn, dict):
            problems.append(f"{where}: field '{field}' must be an object, got {_kind(turn)}")
            continue
        who, key = (turn.get("from"), "from") if "from" in turn else (turn.get("role"), "role")
        if who not in SHAREGPT_ROLES:
            got = "missing" if key not in turn else repr(who)
            problems.append(
                f"{where}: field '{field}.from' is {got}; expected one of human, gpt, system"
            )
        else:
            roles.append(SHAREGPT_ROLES[who])
        text_key = "value" if "value" in turn or "content" not in turn else "content"
        if not isinstance(turn.get(text_key), str):
            got = "missing" if text_key not in turn else _kind(turn[text_key])
            problems.append(f"{where}: field '{field}.{text_key}' must be a string, got {got}")
    if not problems and "assistant" not in roles:
        problems.append(f"{where}: field 'conversations' has no gpt turn, so nothing to learn from")
    return problems


def sharegpt_to_chat(record: dict) -> dict:
    """A checked ShareGPT record as a chat record (``{"messages": [{role, content}]}``)."""
    messages = []
    for turn in record["conversations"]:
        who = turn["from"] if "from" in turn else turn["role"]
        text = turn["value"] if "value" in turn or "content" not in turn else turn["content"]
        messages.append({"role": SHAREGPT_ROLES[who], "content": text})
    return {"messages": messages}
