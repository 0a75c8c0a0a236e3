"""Reading a data file's records as they are written, before columns or formats (no torch).

The second step of the data pipeline (`homelab_dp.data.samples`): the source is found
(`homelab_dp.data.sources`), then each of its files is read here into `RawRecords`, then
columns are renamed (`homelab_dp.data.columns`) and the records checked against their format
(`homelab_dp.data.records`).

- ``.txt``: plain text, one record ``{"text"}`` per paragraph (paragraphs are separated by
  blank lines); each record names the line it starts on.
- ``.json``, ``.csv`` and ``.parquet``: read whole through the ``datasets`` library (its
  packaged builder for each), null cells left out of a row; each record is ``file row N``, the
  N-th of the file from 1. A CSV cell is always a string (an empty one ""); a ``.json`` file is
  first parsed line by line here (`check_json_depth`), since one of the library's readers
  crashes on JSON nested too deeply.
- anything else (``.jsonl`` …): JSON lines, one object a line, blank lines skipped; a line that
  is not a JSON object is a problem naming ``file:line``, kept for the format check to report
  with the others.

A file that is missing, unreadable, not UTF-8, empty, or holds a record over
`MAX_RECORD_BYTES` is a DataError naming it (and the line) at once.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp import safe_files
from homelab_dp.data.sources import BUILDERS
from homelab_dp.errors import DataError

MAX_RECORD_BYTES = 8 * 2**20
"""The largest record read (one JSON line, or one paragraph of a .txt file): 8 MiB, some 2
million tokens, far beyond any seq_len. A larger one is refused naming its file:line before the
file is read whole (its tokens would take gigabytes in the preflight)."""
MAX_JSON_FILE_BYTES = 2**34
"""The largest ``.json`` file read (16 GiB: the ``datasets`` library holds it whole anyway)."""
_UNREADABLE = ("nested too deeply", "an integer of")
"""`homelab_dp.safe_files.BadJson` reasons no JSON reader should be asked to read."""
_JSON_HINT = "a record is a flat JSON object of strings (or chat messages): write it plainly"


@dataclass
class Entry:
    """One record of a file as read: where it is, and its object or what is wrong with it."""

    where: str
    """``file:line`` or ``file row N``."""
    value: dict | None
    """The record (None when its line is not a JSON object)."""
    problem: str = ""
    """What is wrong with it ("" when nothing is)."""
    kind: str = ""
    """The step that found the problem: ``json`` (reading) or ``columns`` (renaming)."""
    line: int = 0
    """The line it starts on (0 for a row of a columnar file)."""


@dataclass
class RawRecords:
    """A file's records as read (`read_file`), in file order."""

    path: Path
    entries: list[Entry]
    header: list[str] | None = None
    """A columnar file's column names (None for JSON lines and text)."""
    paragraphs: bool = False
    """A ``.txt`` file: the records are its paragraphs, ``{"text"}`` each."""


def read_file(path: Path, *, columnar: bool = True, first_only: bool = False) -> RawRecords:
    """The records of one data file (module docstring). ``columnar=False`` reads any file but
    ``.txt`` as JSON lines; ``first_only``, of a JSON lines file only its first record (what
    tells its format)."""
    path = Path(path)
    if columnar and path.suffix.lower() in BUILDERS:
        rows, header = _rows(path)
        entries = [Entry(f"{path} row {i}", row) for i, row in enumerate(rows, start=1)]
        return RawRecords(path, entries, header=header)
    text = open_text(path)
    if path.suffix.lower() == ".txt":
        return RawRecords(path, _paragraphs(path, text), paragraphs=True)
    entries = []
    for number, value, problem in _parsed_lines(path, text):
        kind = "json" if problem else ""
        entries.append(Entry(f"{path}:{number}", value, problem or "", kind, number))
        if first_only:
            break
    return RawRecords(path, entries)


def check_record_sizes(path: Path, limit: int = MAX_RECORD_BYTES) -> None:
    """A DataError naming ``file:line`` for the first record over ``limit`` bytes: a JSON line,
    or a paragraph of a ``.txt`` file. Reads the file in pieces of at most ``limit`` + 1 bytes
    (a longer line is over the limit by its first piece), so memory stays bounded whatever the
    file holds."""
    paragraphs = path.suffix.lower() == ".txt"
    size, start = 0, 1
    with open(path, "rb") as fh:
        for number, line in enumerate(iter(lambda: fh.readline(limit + 1), b""), start=1):
            if paragraphs and not line.strip():  # a blank line ends a paragraph
                size = 0
                continue
            if size == 0 or not paragraphs:
                size, start = 0, number
            size += len(line)
            if size > limit:
                raise DataError(
                    f"{path}:{start}: the record is over {limit // 2**20} MiB "
                    "(the limit on one record)",
                    hint="split it into smaller records (a long text into paragraphs or several "
                    "lines); a record far longer than data.seq_len is truncated anyway",
                )


def open_text(path: Path) -> str:
    """The file's text, or a DataError for a missing, unreadable or empty file."""
    if not path.exists():
        raise DataError(
            f"{path}: no such data file", hint="check data.path (a local .jsonl or .txt file)"
        )
    if not path.is_file():
        raise DataError(f"{path}: not a file", hint="data.path must name a .jsonl or .txt file")
    check_record_sizes(path)  # before the file is read whole: one huge line is refused cheaply
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text", hint="save the dataset as UTF-8"
        ) from None
    if not text.strip():
        raise DataError(
            f"{path}: the file is empty",
            hint="a dataset needs at least one record (one JSON object a line)",
        )
    return text


def _parsed_lines(path: Path, text: str) -> Iterator[tuple[int, dict | None, str | None]]:
    """Each non-blank line: its number, and its object or what is wrong with it."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = safe_files.parse(line)
        except safe_files.BadJson as exc:  # nested 100,000 deep, a 5,000-digit integer too
            yield number, None, f"{path}:{number}: not valid JSON ({exc.reason})"
            continue
        if not isinstance(value, dict):
            yield number, None, f"{path}:{number}: expected a JSON object, got {kind_of(value)}"
            continue
        yield number, value, None


def kind_of(value: Any) -> str:
    """What a JSON value is, in words, for a problem's message."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "true/false",
        int: "a number",
        float: "a number",
    }.get(type(value), "null")


def _paragraphs(path: Path, text: str) -> list[Entry]:
    """A .txt file as text records: one per blank-line-separated paragraph."""
    out: list[Entry] = []
    current: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if not current:
                start = number
            current.append(line.rstrip())
        elif current:
            out.append(Entry(f"{path}:{start}", {"text": "\n".join(current)}, line=start))
            current = []
    if current:
        out.append(Entry(f"{path}:{start}", {"text": "\n".join(current)}, line=start))
    return out


def _rows(path: Path) -> tuple[list[dict], list[str]]:
    """A columnar file's rows (null cells left out) and its column names.

    The whole file is read, never a part: a stream left half-read can leave the reader's
    threads running into the interpreter's exit (an abort instead of exit code 2)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    kind = BUILDERS[path.suffix.lower()]
    if kind == "json":
        check_json_depth(path)  # before the library's parsers, which crash on deep nesting
    extra: dict[str, Any] = {}
    if kind == "csv":  # every cell a string: a number-like answer stays text, "" stays ""
        header = _csv_header(path)
        extra = {
            "features": datasets.Features({c: datasets.Value("string") for c in header}),
            "keep_default_na": False,
        }
    try:
        stream = datasets.load_dataset(
            kind, data_files=str(path), split="train", streaming=True, **extra
        )
        rows = [{k: v for k, v in row.items() if v is not None} for row in stream]
    except DataError:
        raise
    except Exception as exc:  # a damaged file: the library's own words, one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"{path}: cannot read it as {kind}: {first}",
            hint=f"check that the file is valid {kind}",
        ) from None
    if not rows:
        raise DataError(f"{path}: the file is empty", hint="a dataset needs at least one record")
    names = list(stream.features or {}) or list(dict.fromkeys(k for r in rows for k in r))
    return rows, names


def check_json_depth(path: Path) -> None:
    """A DataError naming ``file:line`` when a ``.json`` file holds JSON nested too deeply or an
    integer too long to read (`homelab_dp.safe_files.parse`): the ``datasets`` library's JSON
    readers are not asked to, since one of them (pandas' ujson) ends the process with a
    segmentation fault on an array nested 100,000 deep. Each line is parsed (JSON lines, or
    one line of a document); the document whole only when it spreads over several lines."""
    try:
        text = safe_files.read_regular(path, MAX_JSON_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason})", hint="save it as UTF-8") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc})", hint="name a regular file") from None
    lines_parse = True
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            safe_files.parse(line)
        except safe_files.BadJson as exc:
            if exc.reason.startswith(_UNREADABLE):
                raise DataError(
                    f"{path}:{number}: not valid JSON ({exc.reason})", hint=_JSON_HINT
                ) from None
            lines_parse = False
    if lines_parse:
        return
    try:
        safe_files.parse(text)
    except safe_files.BadJson as exc:
        if exc.reason.startswith(_UNREADABLE):
            raise DataError(f"{path}: not valid JSON ({exc.reason})", hint=_JSON_HINT) from None


def _csv_header(path: Path) -> list[str]:
    """The header row of a CSV file (the file must be UTF-8 text with one)."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as fh:  # a BOM is no part of a name
            header = next(csv.reader(fh), [])
    except UnicodeDecodeError:
        raise DataError(f"{path}:1: not UTF-8 text", hint="save the dataset as UTF-8") from None
    if not header:
        raise DataError(f"{path}:1: no header row", hint="the first row names the columns")
    return header
