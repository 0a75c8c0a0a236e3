"""Checking records against their format (no torch): the fourth step of the data pipeline.

`homelab_dp.data.samples` finds the source (`homelab_dp.data.sources`), reads each file's
records (`homelab_dp.data.reading`), renames their columns (`homelab_dp.data.columns`), and
then checks them here (`check_file`): the format is told from the first record's keys when
data.format is auto, every record is checked against it, and the records come back in the form
tokenizing takes (`homelab_dp.data.tokenize`). Pure standard library: the parent process checks
a dataset before anything is launched.

Fields per format (extra keys are ignored):

==============  ===========================================================================
text            ``text``: non-empty string (a ``.txt`` file: one record per paragraph)
completion      ``prompt``: string; ``completion``: non-empty string
instruction     ``instruction``: non-empty string; ``output``: non-empty string;
                ``input``: optional string (missing or null means none)
chat            ``messages``: non-empty list of ``{"role", "content"}``, role one of
                system / user / assistant, content a string; at least one assistant turn
sharegpt        ``conversations``: non-empty list of ``{"from", "value"}``, from one of
                human / gpt / system; at least one gpt turn (read as chat)
preference      ``chosen`` and ``rejected``: non-empty strings with a ``prompt`` string (without
                one, the text both share, as in the raw HH-RLHF layout), or
                lists of chat messages that share every turn but the last, an assistant turn
                (the TRL, HH-RLHF and UltraFeedback-binarized layouts; an optional
                ``prompt``, a string or messages, is put before turns that lack it)
kto             ``prompt``: string; ``completion``: non-empty string; ``label``: true/false
                (also "true"/"false"/1/0, as a CSV file holds it)
==============  ===========================================================================

Every problem names ``file:line`` (``file row N`` for the columnar files) and the field; all
records of a file are checked, the first problem is reported with the count of the others.

ShareGPT records (``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``)
are checked as they are, so a problem names ``conversations[i].from``, and then converted to
the chat format's OpenAI messages (``human`` → user, ``gpt`` → assistant). Turns already
written as ``{"role", "content"}`` inside ``conversations`` are taken as they are.

A preference objective's data must be in the format it trains on (`check_objective_format`):
pairs for DPO and ORPO, labelled completions for KTO.
"""

from __future__ import annotations

from typing import Any

from homelab_dp.data.reading import RawRecords
from homelab_dp.data.reading import kind_of as _kind
from homelab_dp.errors import DataError

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

FORMATS = ("text", "completion", "instruction", "chat")
"""The formats samples are tokenized in (`homelab_dp.data.tokenize`)."""
PREFERENCE_FORMATS = ("preference", "kto")
"""The formats of preference data (`homelab_dp.data.preference_blocks`): pairs, labelled
completions."""
LAYOUTS = (*FORMATS, "sharegpt", *PREFERENCE_FORMATS)
"""What data.format may name besides auto: ShareGPT records are read as chat."""
ROLES = ("system", "user", "assistant")
PAIR_OBJECTIVES = ("dpo", "orpo")
"""The objectives that train on chosen/rejected pairs (data format ``preference``)."""
KTO_OBJECTIVES = ("kto",)
"""The objectives that train on labelled completions (data format ``kto``)."""
_ACCEPTED = (
    '{"text"} | {"prompt","completion"} | {"instruction","input","output"} | {"messages"} '
    '| {"conversations"} | {"prompt","chosen","rejected"} | {"prompt","completion","label"}'
)
_FORMAT_HINT = (
    f"accepted records: {_ACCEPTED}; set data.format to say which (text | completion | "
    "instruction | chat | sharegpt | preference | kto), or map your columns with data.columns"
)


def sharegpt_problems(record: dict, where: str) -> list[str]:
    """Every problem of a ShareGPT record (empty: it converts to a chat record)."""
    turns = record.get("conversations")
    if "conversations" not in record or turns is None:
        return [f"{where}: field 'conversations' missing"]
    problems = message_problems(turns, "conversations", where, sharegpt=True)
    if not problems and all(_sharegpt_role(t) != "assistant" for t in turns):
        problems.append(f"{where}: field 'conversations' has no gpt turn, so nothing to learn from")
    return problems


def _sharegpt_role(turn: dict) -> str:
    """The chat role of a checked ShareGPT turn (``from``, or ``role`` when it has no ``from``)."""
    return SHAREGPT_ROLES[turn["from"] if "from" in turn else turn["role"]]


def sharegpt_to_chat(record: dict) -> dict:
    """A checked ShareGPT record as a chat record (``{"messages": [{role, content}]}``)."""
    messages = []
    for turn in record["conversations"]:
        who = turn["from"] if "from" in turn else turn["role"]
        text = turn["value"] if "value" in turn or "content" not in turn else turn["content"]
        messages.append({"role": SHAREGPT_ROLES[who], "content": text})
    return {"messages": messages}


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
    problems = message_problems(messages, "messages", where)
    if not problems and not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
        problems.append(
            f"{where}: field 'messages' has no assistant turn (roles: {roles}), "
            "so nothing to learn from"
        )
    return problems


def message_problems(messages: Any, name: str, where: str, *, sharegpt: bool = False) -> list[str]:
    """Every problem of a list of chat messages in field ``name``: each ``{role, content}``,
    or with ``sharegpt`` a ShareGPT turn (``{from, value}``, or ``{role, content}`` as is)."""
    if not isinstance(messages, list) or not messages:
        what = "empty" if isinstance(messages, list) else _kind(messages)
        return [f"{where}: field '{name}' must be a non-empty list, got {what}"]
    problems = []
    for i, message in enumerate(messages):
        field = f"{name}[{i}]"
        if not isinstance(message, dict):
            problems.append(f"{where}: field '{field}' must be an object, got {_kind(message)}")
            continue
        if sharegpt:
            key = "from" if "from" in message else "role"
            text_key = "value" if "value" in message or "content" not in message else "content"
            known, shown, expected = SHAREGPT_ROLES, "from", "human, gpt, system"
        else:
            key, text_key, known, shown, expected = (
                "role",
                "content",
                ROLES,
                "role",
                ", ".join(ROLES),
            )
        if message.get(key) not in known:
            got = "missing" if key not in message else repr(message.get(key))
            problems.append(
                f"{where}: field '{field}.{shown}' is {got}; expected one of {expected}"
            )
        if not isinstance(message.get(text_key), str):
            got = "missing" if text_key not in message else _kind(message[text_key])
            problems.append(f"{where}: field '{field}.{text_key}' must be a string, got {got}")
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
    problems = message_problems(record["chosen"], "chosen", where)
    problems += message_problems(record["rejected"], "rejected", where)
    prompt = record.get("prompt")
    if isinstance(prompt, list):
        problems += message_problems(prompt, "prompt", where)
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


def check_file(raw: RawRecords, fmt: str) -> tuple[list[dict], list[str], str, str]:
    """A file's renamed records checked against ``fmt`` (auto: told from the first record's
    keys). Returns the records in the form tokenizing takes, where each is, the format they
    were checked in (``sharegpt`` stays itself: a folder's next file is read in it) and the
    format they are tokenized in (ShareGPT: ``chat``). The first problem (JSON lines that do
    not parse, then mapped columns missing, then the format's) is raised with the count of the
    others."""
    if raw.paragraphs:
        if fmt not in ("auto", "text"):
            raise DataError(
                f"{raw.path}: a .txt file holds plain text, but data.format is {fmt!r}",
                hint='set data.format = "text" (or auto), or use a .jsonl file for this format',
            )
        return [e.value or {} for e in raw.entries], [e.where for e in raw.entries], "text", "text"
    if fmt == "auto":
        fmt = first_format(raw)
    kept = [e for e in raw.entries if e.value is not None]
    problems = read_problems(raw)
    records, final = check_records([e.value or {} for e in kept], [e.where for e in kept], fmt,
                                   problems=problems, label="the file")  # fmt: skip
    return records, [e.where for e in kept], fmt, final


def read_problems(raw: RawRecords) -> list[str]:
    """What reading and renaming found wrong with a file's records, in the order they are
    reported: the JSON lines that do not parse, then the records that lack a mapped column."""
    found: dict[str, list[str]] = {"json": [], "columns": []}
    for e in raw.entries:
        if e.kind in found:
            found[e.kind].append(e.problem)
    return found["json"] + found["columns"]


def first_format(raw: RawRecords) -> str:
    """The format a file's first record's keys tell (a ``.txt`` file is text); a DataError
    when that record does not parse, lacks a mapped column or fits no format."""
    if raw.paragraphs:
        return "text"
    first = raw.entries[0]  # reading refuses a file without a record
    if first.kind == "json":  # the first record decides: a bad one is reported at once
        raise DataError(first.problem, hint="each line must be one JSON object")
    if first.kind == "columns":
        raise DataError(first.problem, hint="fix data.columns to name the data's own keys")
    return format_of(list(first.value or {}), first.where)


def objective_format(objective: str) -> str:
    """The data format a preference objective trains on: ``preference`` or ``kto``."""
    return "kto" if objective in KTO_OBJECTIVES else "preference"


def check_objective_format(objective: str, fmt: str, where: str) -> None:
    """A DataError when the data's format ``fmt`` is not what ``objective`` trains on, naming
    the objective to set for this data."""
    need = objective_format(objective)
    if fmt == need:
        return
    what = {
        "preference": "preference pairs (chosen, rejected)",
        "kto": "KTO records (prompt, completion, label)",
    }
    if fmt == "preference":
        hint = 'set train.objective = "dpo" (or "orpo") for pairs'
    elif fmt == "kto":
        hint = 'set train.objective = "kto" for labelled completions'
    else:
        hint = 'set train.objective = "sft" (the default) to fine-tune on this data'
    accepted = (
        '{"prompt","chosen","rejected"} or {"chosen": [messages], "rejected": [messages]}'
        if need == "preference"
        else '{"prompt","completion","label": true|false}'
    )
    raise DataError(
        f"{where}: train.objective {objective} needs {what[need]}, but the data is "
        f"{what.get(fmt, fmt + ' format')}",
        hint=f"{hint}, or give records {accepted} (data.columns maps other names)",
    )
