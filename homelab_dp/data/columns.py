"""``data.columns``: a format's fields renamed from the data's own columns (no torch).

The third step of the data pipeline (`homelab_dp.data.samples`), between reading a file's
records (`homelab_dp.data.reading`) and checking them against their format
(`homelab_dp.data.records`). ``data.columns`` maps a format's field to the data's column
(``{instruction = "question", output = "answer"}``): each record's column is renamed to the
field before the format is detected or checked, in every kind of file. A mapped column a
columnar file's header lacks is a DataError naming the file; a JSON line that lacks one is a
problem naming its ``file:line``, reported with the format's problems. A ``.txt`` file's
paragraphs are text and keep their one field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from homelab_dp.data.reading import Entry, RawRecords
from homelab_dp.errors import DataError

FIELDS = (
    "text", "prompt", "completion", "instruction", "input", "output", "messages",
    "conversations", "chosen", "rejected", "label",
)  # fmt: skip
"""The fields ``data.columns`` may map (every format's keys)."""


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


def rename(raw: RawRecords, columns: Mapping[str, str]) -> RawRecords:
    """A file's records with each mapped column renamed to its field (module docstring)."""
    if not columns or raw.paragraphs:
        return raw
    if raw.header is not None:
        missing_columns(raw.header, columns, str(raw.path))
        return replace(raw, entries=[replace(e, value=rename_row(e.value or {}, columns))
                                     for e in raw.entries])  # fmt: skip
    entries = []
    for e in raw.entries:
        if e.value is None:
            entries.append(e)
            continue
        value, problem = rename_columns(e.value, columns, e.where)
        # reported once, not again as the field it was mapped to
        entries.append(Entry(e.where, None, problem, "columns", e.line) if problem
                       else replace(e, value=value))  # fmt: skip
    return replace(raw, entries=entries)


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
