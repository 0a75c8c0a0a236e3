"""Hostile JSON in a user's data is an error naming file:line, never a traceback or a crash.

Every reader of user JSON is tried: JSON lines of each format (SFT text and chat, preference
pairs, KTO records; the first line, which decides an auto format, and a later one), a ``.json``
file read through the ``datasets`` library (whose ujson parser ended the process with a
segmentation fault on deep nesting), ``data.sample_prompts``, and the CLI's `run` on the
training and the eval data. The hostile values: arrays and objects nested 100,000 deep (closed
or not), 5,000-digit integers (positive, negative, as a KTO label), and the damaged ones: a
truncated line, bytes that are not UTF-8, wrong types; and at the path a FIFO, a symlink to
``/dev/zero``, a file far over its bound (none may hang or read without limit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from homelab_dp.data.sample_prompts import MAX_FILE_BYTES, read_sample_prompts
from homelab_dp.data.samples import read_source, read_with_lines
from homelab_dp.data.sources import resolve_source
from homelab_dp.errors import DataError

from ..conftest import ROOT, run_cli

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

DEEP = 100_000
DIGITS = 5_000
HOSTILE = {
    "array nested 100,000 deep": ("[" * DEEP + "]" * DEEP, "nested too deeply"),
    "object nested 100,000 deep": ('{"a":' * DEEP + "1" + "}" * DEEP, "nested too deeply"),
    "unclosed nesting 100,000 deep": ("[" * DEEP, "nested too deeply"),
    "5,000-digit integer": ("9" * DIGITS, f"an integer of {DIGITS} digits"),
    "negative 5,000-digit integer": ("-" + "1" * DIGITS, f"an integer of {DIGITS} digits"),
}
"""Each hostile JSON value, and what the error says of it."""

GOOD = {
    "text": {"text": "a plain record"},
    "chat": {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]},
    "preference": {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    "kto": {"prompt": "2+2?", "completion": "4", "label": True},
}  # fmt: skip
"""One good record of each format the hostile value is put into."""


def _line(fmt: str, value: str) -> str:
    """A record of ``fmt`` whose extra field ``x`` (KTO: its label) holds ``value``."""
    good = json.dumps(GOOD[fmt])
    if fmt == "kto":
        return good.replace("true", value)
    return good[:-1] + f', "x": {value}}}'


@pytest.mark.parametrize("fmt", list(GOOD))
@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("at", [1, 3])
def test_a_hostile_json_line_is_refused_with_its_file_and_line(
    tmp_path: Path, fmt: str, hostile: str, at: int
) -> None:
    value, says = HOSTILE[hostile]
    lines = [json.dumps(GOOD[fmt])] * 3
    lines[at - 1] = _line(fmt, value)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for given in ("auto", fmt):
        with pytest.raises(DataError) as err:
            read_with_lines(data, given)
        assert err.value.message.startswith(f"{data}:{at}: not valid JSON ({says}")
        assert err.value.hint


@pytest.mark.parametrize("hostile", list(HOSTILE))
@pytest.mark.parametrize("layout", ["array", "lines", "pretty"])
def test_a_hostile_json_file_is_refused_before_the_datasets_library_reads_it(
    tmp_path: Path, hostile: str, layout: str
) -> None:
    value, says = HOSTILE[hostile]
    good, bad = json.dumps(GOOD["text"]), _line("text", value)
    data = tmp_path / "data.json"
    if layout == "array":
        data.write_text(f"[{good}, {bad}]", encoding="utf-8")
    elif layout == "lines":
        data.write_text(f"{good}\n{bad}\n", encoding="utf-8")
    else:  # a document spread over lines: one bracket a line, deep only as a whole
        spread = value.replace("[", "[\n").replace("]", "]\n").replace('{"a":', '{"a":\n')
        data.write_text(f'[\n{good},\n{{"x": {spread}}}\n]\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_source(resolve_source(str(data), "train", field="data.path"), "auto")
    where = f"{data}: " if layout == "pretty" and "nested" in says else f"{data}:"
    assert err.value.message.startswith(where) and f"not valid JSON ({says}" in err.value.message


def test_a_json_file_of_ordinary_records_still_reads(tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    records = [{**GOOD["text"], "n": 10**12, "deep": [[[[["fine"]]]]]}] * 3
    data.write_text(json.dumps(records, indent=2), encoding="utf-8")
    got, wheres, fmt = read_source(resolve_source(str(data), "train", field="data.path"), "auto")
    assert fmt == "text" and len(got) == 3 and wheres[2] == f"{data} row 3"


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"prompt": "fine"}\n{"prompt": "trunc', ":2: not JSON (Unterminated string"),
        (b'{"prompt": "fine"}\n\xff\xfe not utf-8\n', ":2: not UTF-8 text"),
        (b'{"prompt": 12}\n', ':1: no "prompt" string'),
        (b'["prompt"]\n', ':1: no "prompt" string'),
        *[((f'{{"prompt": "a", "x": {v}}}\n').encode(), f":1: not JSON ({s}")
          for v, s in HOSTILE.values()],
    ],
)  # fmt: skip
def test_damaged_and_hostile_sample_prompts_name_the_file_and_line(
    tmp_path: Path, content: bytes, says: str
) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        read_sample_prompts(str(path))
    assert err.value.message.startswith("data.sample_prompts: ") and says in err.value.message


@pytest.mark.parametrize("kind", ["fifo", "devzero", "huge"])
def test_sample_prompts_read_a_regular_file_of_bounded_size_only(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "prompts.jsonl"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: an open that waits would never return
    elif kind == "devzero":
        path.symlink_to("/dev/zero")  # endless bytes
    else:
        with open(path, "wb") as fh:
            fh.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(DataError) as err:
        read_sample_prompts(str(path))
    says = {"fifo": "not a regular file (a FIFO)", "huge": "over the limit",
            "devzero": "not a regular file (a character device)"}[kind]  # fmt: skip
    assert says in err.value.message and err.value.hint


@pytest.mark.parametrize("field", ["data.path", "data.eval_path", "data.sample_prompts"])
@pytest.mark.parametrize("hostile", ["array nested 100,000 deep", "5,000-digit integer"])
def test_the_cli_refuses_hostile_data_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, hostile: str
) -> None:
    value, says = HOSTILE[hostile]
    good = (ROOT / "assets" / "data" / "tiny-preferences.jsonl").read_text().splitlines()
    path = tmp_path / "hostile.jsonl"
    if field == "data.sample_prompts":
        lines = ['{"prompt": "fine"}', f'{{"prompt": "a", "x": {value}}}']
    else:
        lines = [good[0], _line("preference", value), good[1]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    rc, _, err = run_cli(capsys, "run", "tiny-dpo", "--detach", "--set", f"{field}={path}")
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and f"{path}:2: not " in lines[0], lines
    assert says in lines[0] and lines[-1].startswith("hint: ")
    assert list(runs.iterdir()) == []
