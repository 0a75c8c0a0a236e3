"""JSON-lines reading shared by the live tail, a GRPO run's rollouts and `measure`'s events:
objects kept in order, blank, torn, damaged and non-object lines left out."""

from __future__ import annotations

import json
from pathlib import Path

from homelab_dp.runs.folder.jsonl_tail import JsonlTail, json_objects
from homelab_dp.runs.folder.rollouts import latest_rollouts, rollout_path

DAMAGED = [b'{"a": 1}', b"", b"[1, 2]", b'{"b": ', b"\xff\xfe", b"[" * 5000, b'{"c": 3}']


def test_json_objects_keeps_the_objects_in_order() -> None:
    assert json_objects(DAMAGED) == [{"a": 1}, {"c": 3}]
    assert json_objects([line.decode("latin-1") for line in DAMAGED]) == [{"a": 1}, {"c": 3}]


def test_the_tail_holds_back_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"\n".join(DAMAGED) + b'\n{"d": ')
    tail = JsonlTail(path)
    assert tail.read() == [{"a": 1}, {"c": 3}]
    with path.open("ab") as fh:
        fh.write(b"4}\n")
    assert tail.read() == [{"d": 4}]


def test_rollouts_keep_every_object_line_the_last_one_unterminated_too(tmp_path: Path) -> None:
    """A line nested too deep is left out (it raised RecursionError before json_objects)."""
    path = rollout_path(tmp_path, 3)
    path.parent.mkdir()
    rows = [{"prompt_index": i, "completion": f"c{i}", "reward": float(i)} for i in range(2)]
    text = [json.dumps(rows[0]).encode(), *(DAMAGED[i] for i in (1, 2, 3, 5))]  # UTF-8 lines
    path.write_bytes(b"\n".join([*text, json.dumps(rows[1]).encode()]))
    got = latest_rollouts(tmp_path)
    assert got is not None and got.step == 3 and list(got.rows) == rows
