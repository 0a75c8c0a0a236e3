"""Reading and validating dataset files (part of `homelab_dp.data.blocks`; import from there).

Pure standard library: the parent process checks a dataset before anything is launched.

Accepted files:

- ``.txt``: format text, one document per paragraph; paragraphs are separated by blank lines.
- anything else (``.jsonl`` …): JSON lines, one object a line; blank lines are skipped.

Fields per format (extra keys are ignored):

==============  ===========================================================================
text            ``text``: non-empty string
completion      ``prompt``: string; ``completion``: non-empty string
instruction     ``instruction``: non-empty string; ``output``: non-empty string;
                ``input``: optional string (missing or null means none)
chat            ``messages``: non-empty list of ``{"role", "content"}``, role one of
                system / user / assistant, content a string; at least one assistant turn
sharegpt        ``conversations``: non-empty list of ``{"from", "value"}``, from one of
                human / gpt / system; at least one gpt turn (read as chat,
                `homelab_dp.data.records`)
preference      ``chosen`` and ``rejected``: non-empty strings with a ``prompt`` string (without
                one, the text both share, as in the raw HH-RLHF layout), or
                lists of chat messages that share every turn but the last, an assistant turn
                (the TRL, HH-RLHF and UltraFeedback-binarized layouts; an optional
                ``prompt``, a string or messages, is put before turns that lack it)
kto             ``prompt``: string; ``completion``: non-empty string; ``label``: true/false
                (also "true"/"false"/1/0, as a CSV file holds it)
==============  ===========================================================================

``data.columns`` renames columns to these fields first (`homelab_dp.data.records`). Every
problem names ``file:line`` (``file row N`` for the columnar files of `homelab_dp.data.sources`,
which check their rows with `check_records`) and the field; all records are checked, the first
problem is reported with the count of the others.

Record layouts before the format checks: column mapping and ShareGPT conversations.

Pure standard library. ``data.columns`` maps a format's field to the data's column
(``{instruction = "question", output = "answer"}``): each record's column is renamed to the
field before the format is detected or checked, in every kind of file.

ShareGPT records (``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``)
are checked as they are, so a problem names ``conversations[i].from``, and then converted to
the chat format's OpenAI messages (``human`` → user, ``gpt`` → assistant). Turns already
written as ``{"role", "content"}`` inside ``conversations`` are taken as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from homelab_dp import safe_files
from homelab_dp.errors import DataError

FIELDS = (
    "text", "prompt", "completion", "instruction", "input", "output", "messages",
    "conversations", "chosen", "rejected", "label",
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


FORMATS = ("text", "completion", "instruction", "chat")
"""The formats samples are tokenized in (`homelab_dp.data.tokenize`)."""
PREFERENCE_FORMATS = ("preference", "kto")
"""The formats of preference data (`homelab_dp.data.preference_blocks`): pairs, labelled
completions."""
LAYOUTS = (*FORMATS, "sharegpt", *PREFERENCE_FORMATS)
"""What data.format may name besides auto: ShareGPT records are read as chat."""
ROLES = ("system", "user", "assistant")
MAX_RECORD_BYTES = 8 * 2**20
"""The largest record read (one JSON line, or one paragraph of a .txt file): 8 MiB, some 2
million tokens, far beyond any seq_len. A larger one is refused naming its file:line before the
file is read whole (its tokens would take gigabytes in the preflight)."""
_ACCEPTED = (
    '{"text"} | {"prompt","completion"} | {"instruction","input","output"} | {"messages"} '
    '| {"conversations"} | {"prompt","chosen","rejected"} | {"prompt","completion","label"}'
)
_FORMAT_HINT = (
    f"accepted records: {_ACCEPTED}; set data.format to say which (text | completion | "
    "instruction | chat | sharegpt | preference | kto), or map your columns with data.columns"
)


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


def _open_text(path: Path) -> str:
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
            yield number, None, f"{path}:{number}: expected a JSON object, got {_kind(value)}"
            continue
        yield number, value, None


def _json_lines(path: Path, text: str) -> tuple[list[Any], list[int], list[str]]:
    """Parse every non-blank line; return values, their line numbers and the problems found."""
    values, lines, problems = [], [], []
    for number, value, problem in _parsed_lines(path, text):
        if problem is not None:
            problems.append(problem)
        else:
            values.append(value)
            lines.append(number)
    return values, lines, problems


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "true/false",
        int: "a number",
        float: "a number",
    }.get(type(value), "null")


def format_from_keys(keys: list[str]) -> str | None:
    """The format a record's keys point to, or None (a distinguishing key is enough).

    ``chosen``/``rejected`` mean pairs before anything else (UltraFeedback-binarized rows also
    hold ``messages``); ``label`` beside ``completion`` means KTO."""
    if "chosen" in keys or "rejected" in keys:
        return "preference"
    if "label" in keys and "completion" in keys:
        return "kto"
    if "messages" in keys:
        return "chat"
    if "conversations" in keys:
        return "sharegpt"
    if "instruction" in keys:
        return "instruction"
    if "prompt" in keys or "completion" in keys:
        return "completion"
    if "text" in keys:
        return "text"
    return None


def detect_format(path: Path, columns: dict[str, str] | None = None) -> str:
    """The format of a dataset file: ``.txt`` is text; otherwise from the first record's keys
    (after ``columns``, data.columns).

    Raises DataError for a missing or empty file, a bad first line, or keys that fit no format
    (naming the keys found and the accepted ones).
    """
    path = Path(path)
    text = _open_text(path)
    if path.suffix.lower() == ".txt":
        return "text"
    for number, value, problem in _parsed_lines(path, text):
        if value is None:  # the first record decides: a bad one is reported at once
            raise DataError(str(problem), hint="each line must be one JSON object")
        value, problem = rename_columns(value, columns or {}, f"{path}:{number}")
        if problem:
            raise DataError(problem, hint="fix data.columns to name the data's own keys")
        return format_of(list(value), f"{path}:{number}")
    raise AssertionError("unreachable: _open_text rejects blank files")


def format_of(keys: list[str], where: str) -> str:
    """`format_from_keys`, or a DataError naming the keys found and the accepted ones."""
    fmt = format_from_keys(keys)
    if fmt is None:
        found = ", ".join(repr(k) for k in keys) or "none"
        raise DataError(
            f"{where}: cannot tell the data format from the keys ({found})", hint=_FORMAT_HINT
        )
    return fmt


def _check_str(record: dict, key: str, where: str, *, required: bool, non_empty: bool) -> str:
    """One problem for ``record[key]`` or "" when it is fine."""
    if key not in record or (record[key] is None and not required):
        return f"{where}: field '{key}' missing" if required else ""
    value = record[key]
    if not isinstance(value, str):
        return f"{where}: field '{key}' must be a string, got {_kind(value)}"
    if non_empty and not value:
        return f"{where}: field '{key}' is empty"
    return ""


def _check_chat(record: dict, where: str) -> list[str]:
    messages = record.get("messages")
    if "messages" not in record:
        return [f"{where}: field 'messages' missing"]
    problems = _message_problems(messages, "messages", where)
    if not problems and not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        problems.append(
            f"{where}: field 'messages' has no assistant turn (roles: {roles}), "
            "so nothing to learn from"
        )
    return problems


def _message_problems(messages: Any, name: str, where: str) -> list[str]:
    """Every problem of a list of chat messages in field ``name`` (each ``{role, content}``)."""
    if not isinstance(messages, list) or not messages:
        what = "empty" if isinstance(messages, list) else _kind(messages)
        return [f"{where}: field '{name}' must be a non-empty list, got {what}"]
    problems = []
    for i, message in enumerate(messages):
        field = f"{name}[{i}]"
        if not isinstance(message, dict):
            problems.append(f"{where}: field '{field}' must be an object, got {_kind(message)}")
            continue
        role = message.get("role")
        if role not in ROLES:
            got = "missing" if "role" not in message else repr(role)
            problems.append(
                f"{where}: field '{field}.role' is {got}; expected one of {', '.join(ROLES)}"
            )
        if not isinstance(message.get("content"), str):
            got = "missing" if "content" not in message else _kind(message["content"])
            problems.append(f"{where}: field '{field}.content' must be a string, got {got}")
    return problems


def _conversation(record: dict, side: str) -> list[dict]:
    """The whole conversation of a chat pair's ``side`` (chosen or rejected): an optional
    ``prompt`` put before it when the side lacks it (a messages prompt the side does not start
    with; a string prompt, as a user turn, before a side that is only its answer)."""
    turns = [{"role": m["role"], "content": m["content"]} for m in record[side]]
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        head = [{"role": m["role"], "content": m["content"]} for m in prompt]
        return turns if turns[: len(head)] == head else head + turns
    if isinstance(prompt, str) and len(turns) == 1:
        return [{"role": "user", "content": prompt}, *turns]
    return turns


def preference_problems(record: dict, where: str) -> list[str]:
    """Every problem of a preference record (empty: `preference_record` converts it): both
    responses present and non-empty; strings with a string prompt, or chat messages sharing
    every turn but the last, an assistant turn."""
    sides = ("chosen", "rejected")
    missing = [s for s in sides if record.get(s) is None]
    if missing:
        return [
            f"{where}: field '{s}' missing (a preference pair needs chosen and rejected)"
            for s in missing
        ]
    kinds = {s: type(record[s]) for s in sides}
    if kinds["chosen"] is str and kinds["rejected"] is str:
        if record.get("prompt") is not None and not isinstance(record["prompt"], str):
            return [f"{where}: field 'prompt' must be a string, got {_kind(record['prompt'])}"]
        pair = _string_pair(record)
        problems = [f"{where}: field '{s}' is empty (an empty response)" for s in sides
                    if not pair[s].strip()]  # fmt: skip
        if not pair["prompt"] and record.get("prompt") is None:
            problems.insert(0, f"{where}: field 'prompt' missing, and 'chosen' and 'rejected' "
                            "share no text to take as the prompt")  # fmt: skip
        return problems
    if kinds["chosen"] is not list or kinds["rejected"] is not list:
        return [
            f"{where}: fields 'chosen' and 'rejected' must both be strings or both lists of "
            f"chat messages, got {_kind(record['chosen'])} and {_kind(record['rejected'])}"
        ]
    problems = _message_problems(record["chosen"], "chosen", where)
    problems += _message_problems(record["rejected"], "rejected", where)
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        problems += _message_problems(prompt, "prompt", where)
    elif prompt is not None and not isinstance(prompt, str):
        problems.append(f"{where}: field 'prompt' must be a string or chat messages, "
                        f"got {_kind(prompt)}")  # fmt: skip
    if problems:
        return problems
    chosen, rejected = _conversation(record, "chosen"), _conversation(record, "rejected")
    for side, turns in (("chosen", chosen), ("rejected", rejected)):
        last = turns[-1]
        if last["role"] != "assistant":
            problems.append(f"{where}: field '{side}' must end with an assistant turn "
                            f"(the response), its last turn is {last['role']!r}")  # fmt: skip
        elif not last["content"].strip():
            problems.append(f"{where}: field '{side}': the last assistant turn is empty "
                            "(an empty response)")  # fmt: skip
        elif len(turns) == 1:
            problems.append(f"{where}: field '{side}' has no turn before its answer "
                            "(no prompt): give the user's turn or a 'prompt'")  # fmt: skip
    if problems:
        return problems
    if chosen[:-1] != rejected[:-1]:
        turn = next(
            (i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1], strict=False)) if a != b),
            min(len(chosen), len(rejected)) - 1,
        )
        problems.append(
            f"{where}: 'chosen' and 'rejected' do not share the turns before their last "
            f"(they differ at turn {turn}, counted from 0): a pair answers one conversation"
        )
    return problems


def _string_pair(record: dict) -> dict:
    """A string pair's prompt and responses. Without a ``prompt`` (the raw HH-RLHF layout: each
    side the whole dialogue), the prompt is the text both sides share, as TRL's
    ``extract_prompt`` takes it: up to where they differ, a space there going to the responses."""
    chosen, rejected = record["chosen"], record["rejected"]
    if record.get("prompt") is not None:
        return {"prompt": record["prompt"], "chosen": chosen, "rejected": rejected}
    cut = 0
    while cut < min(len(chosen), len(rejected)) and chosen[cut] == rejected[cut]:
        cut += 1
    if 0 < cut < min(len(chosen), len(rejected)) and chosen[cut - 1] == " ":
        cut -= 1
    return {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def preference_record(record: dict) -> dict:
    """A checked preference record in the form tokenizing takes: ``{"prompt", "chosen",
    "rejected"}`` strings, or chat pairs as ``{"messages": shared turns, "chosen": answer,
    "rejected": answer}`` (the two last assistant turns' content)."""
    if isinstance(record["chosen"], str):
        return _string_pair(record)
    chosen, rejected = _conversation(record, "chosen"), _conversation(record, "rejected")
    return {
        "messages": chosen[:-1],
        "chosen": chosen[-1]["content"],
        "rejected": rejected[-1]["content"],
    }


_TRUE = ("true", "1", "yes", "desirable")
_FALSE = ("false", "0", "no", "undesirable")


def kto_label(value: Any) -> bool:
    """A KTO record's ``label`` as a bool (true/false, 1/0, or those as text: CSV cells)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(value)


def _label_problems(record: dict, where: str) -> list[str]:
    """A problem for a KTO record's ``label`` that is missing or not true/false."""
    if record.get("label") is None:
        return [f"{where}: field 'label' missing (true: a desirable completion, false: not)"]
    try:
        kto_label(record["label"])
    except ValueError:
        return [f"{where}: field 'label' must be true or false, got {record['label']!r}"]
    return []


def check_record(record: dict, fmt: str, where: str) -> list[str]:
    """Every problem of one record against its format (empty list: the record is fine)."""
    if fmt == "chat":
        return _check_chat(record, where)
    if fmt == "sharegpt":
        return sharegpt_problems(record, where)
    if fmt == "preference":
        return preference_problems(record, where)
    checks = {
        "text": [("text", True, True)],
        "completion": [("prompt", True, False), ("completion", True, True)],
        "instruction": [
            ("instruction", True, True),
            ("input", False, False),
            ("output", True, True),
        ],
        "kto": [("prompt", True, False), ("completion", True, True)],
    }[fmt]
    problems = [
        _check_str(record, key, where, required=req, non_empty=non_empty)
        for key, req, non_empty in checks
    ]
    problems = [p for p in problems if p]
    if fmt == "kto":
        problems += _label_problems(record, where)
    if problems and format_from_keys(list(record)) not in (None, fmt):
        problems[0] += f" (this record looks like {format_from_keys(list(record))} format)"
    return problems


def check_format_name(fmt: str) -> None:
    """A DataError unless ``fmt`` is auto or one of `LAYOUTS`."""
    if fmt not in (*LAYOUTS, "auto"):
        raise DataError(
            f"data.format: unknown format {fmt!r}",
            hint="one of auto, text, completion, instruction, chat, sharegpt, preference, kto",
        )


def read_with_lines(
    path: Path, fmt: str, columns: dict[str, str] | None = None
) -> tuple[list[dict], list[int], str]:
    """Validated records, the line each starts on, and the format (``auto`` resolved; ShareGPT
    records come back as chat records, format ``chat``). ``columns``: data.columns."""
    path = Path(path)
    check_format_name(fmt)
    text = _open_text(path)
    if path.suffix.lower() == ".txt":
        if fmt not in ("auto", "text"):
            raise DataError(
                f"{path}: a .txt file holds plain text, but data.format is {fmt!r}",
                hint='set data.format = "text" (or auto), or use a .jsonl file for this format',
            )
        return _paragraphs(text)
    if fmt == "auto":
        fmt = detect_format(path, columns)
    values, lines, problems = _json_lines(path, text)
    if columns:
        kept: list[tuple[dict, int]] = []
        for value, number in zip(values, lines, strict=True):
            value, problem = rename_columns(value, columns, f"{path}:{number}")
            if problem:  # reported once, not again as the field it was mapped to
                problems.append(problem)
            else:
                kept.append((value, number))
        values, lines = [v for v, _ in kept], [n for _, n in kept]
    wheres = [f"{path}:{n}" for n in lines]
    records, fmt = check_records(values, wheres, fmt, problems=problems, label="the file")
    return records, lines, fmt


def check_records(
    values: list[dict], wheres: list[str], fmt: str, *, problems: list[str] | None = None,
    label: str = "the data",
) -> tuple[list[dict], str]:  # fmt: skip
    """Every record checked against ``fmt`` (not auto); the first problem (after any given
    ``problems``) raised with the count of the others. Returns the records, ShareGPT converted
    to chat, and the format they are tokenized in."""
    problems = list(problems or [])
    for value, where in zip(values, wheres, strict=True):
        problems.extend(check_record(value, fmt, where))
    if problems:
        first = problems[0]
        more = len(problems) - 1
        if more:
            first += f" (and {more} more problem{'s' if more > 1 else ''} in {label})"
        hint = (
            "each line must be one JSON object"
            if "JSON" in problems[0]
            else "fix data.columns to name the data's own columns"
            if "data.columns" in problems[0]
            else f"the {fmt} format needs {_needs(fmt)}; {_FORMAT_HINT}"
        )
        raise DataError(first, hint=hint)
    if fmt == "sharegpt":
        return [sharegpt_to_chat(v) for v in values], "chat"
    if fmt == "preference":
        return [preference_record(v) for v in values], fmt
    if fmt == "kto":
        return [{**v, "label": kto_label(v["label"])} for v in values], fmt
    return values, fmt


def _needs(fmt: str) -> str:
    return {
        "text": "a non-empty 'text'",
        "completion": "'prompt' and a non-empty 'completion'",
        "instruction": "non-empty 'instruction' and 'output' (and an optional 'input')",
        "chat": "'messages': a list of {role, content} with at least one assistant turn",
        "sharegpt": "'conversations': a list of {from, value} with at least one gpt turn",
        "preference": "non-empty 'chosen' and 'rejected' answers with a 'prompt', or 'chosen' "
        "and 'rejected' chat messages that share every turn but the last assistant turn",
        "kto": "'prompt', a non-empty 'completion' and 'label' (true or false)",
    }[fmt]


def _paragraphs(text: str) -> tuple[list[dict], list[int], str]:
    """A .txt file as text records: one per blank-line-separated paragraph."""
    records: list[dict] = []
    lines: list[int] = []
    current: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if not current:
                lines.append(number)
            current.append(line.rstrip())
        elif current:
            records.append({"text": "\n".join(current)})
            current = []
    if current:
        records.append({"text": "\n".join(current)})
    return records, lines, "text"


def read_records(path: Path, fmt: str) -> list[dict]:
    """Validated records of a dataset file (``fmt`` may be ``auto``); DataError on problems."""
    return read_with_lines(Path(path), fmt)[0]
