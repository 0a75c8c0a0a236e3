"""The prompts a run answers while it trains (``data.sample_prompts``), read and checked (no torch).

``data.sample_prompts`` is a list of strings, or a file: ``.txt`` (one prompt per line, blank
lines skipped) or ``.jsonl`` (a ``"prompt"`` string per line). The preflight calls
`read_sample_prompts` so a bad file is an error naming the file and line before anything
starts; every rank of the worker reads the same list again (`homelab_dp.train.loop.sample_answers`).
"""

from __future__ import annotations

from pathlib import Path

from homelab_dp import safe_files
from homelab_dp.errors import DataError

FIELD = "data.sample_prompts"
DATA_PROMPTS = 3
"""Prompts taken from the data when ``data.sample_prompts`` is empty."""
SUFFIXES = (".txt", ".jsonl")
MAX_FILE_BYTES = 8 * 2**20
"""The largest file of prompts read (prompts are answered while training: a few, short)."""


def read_sample_prompts(value: str | list[str]) -> list[str]:
    """The prompts of ``data.sample_prompts`` ([] : none given, the data's own are used).

    Raises DataError naming the field, the file and the line of anything unusable: a file that
    is missing or of another kind, a line that is not a JSON object with a non-empty "prompt"
    string, an empty prompt in the list, or a file without a prompt."""
    if isinstance(value, list):
        for i, prompt in enumerate(value):
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(
                    f"{FIELD}[{i}]: an empty prompt",
                    hint="give each prompt some text, or leave the list empty ([] : prompts "
                    "from the data)",
                )
        return list(value)
    path = Path(value).expanduser()
    if path.suffix not in SUFFIXES:
        raise DataError(
            f"{FIELD}: {value} is neither a .txt nor a .jsonl file",
            hint='a .txt file (one prompt a line), a .jsonl file ({"prompt": ...} a line), '
            "or a list of strings",
        )
    try:  # a regular file only (a FIFO would wait, /dev/zero never end), of bounded size
        raw = safe_files.read_regular(path, MAX_FILE_BYTES)
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(
            f"{FIELD}: {path}:{line}: not UTF-8 text", hint="save the prompts as UTF-8"
        ) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DataError(
            f"{FIELD}: cannot read {value}: {reason}",
            hint="name an existing UTF-8 file of prompts",
        ) from None
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.suffix == ".txt":
            prompts.append(line)
            continue
        try:
            record = safe_files.parse(line)
        except safe_files.BadJson as exc:  # nested 100,000 deep, a 5,000-digit integer too
            raise DataError(
                f"{FIELD}: {path}:{n}: not JSON ({exc.reason})",
                hint='write one object a line: {"prompt": "..."}',
            ) from None
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f'{FIELD}: {path}:{n}: no "prompt" string',
                hint='write one object a line: {"prompt": "..."}',
            )
        prompts.append(prompt)
    if not prompts:
        raise DataError(
            f"{FIELD}: {path} holds no prompt",
            hint="write at least one prompt, or leave data.sample_prompts out",
        )
    return prompts


def prompt_count(value: str | list[str]) -> int:
    """How many prompts a run answers at each sampling (`DATA_PROMPTS` when none are given,
    or when the file cannot be read here: the preflight names that error)."""
    try:
        return len(read_sample_prompts(value)) or DATA_PROMPTS
    except DataError:
        return DATA_PROMPTS
