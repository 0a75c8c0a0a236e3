"""Bad preference data through the CLI's `run`: exit 2, one ``error:`` line naming the file and
line (or the objective to set), a ``hint:``, no traceback, nothing spawned, no run folder.

The preflight (`app.runs.check_data`) loads dpo/orpo/kto data through the preference loader
(`data.eval_split.load_preference_train_eval`), so every case runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from homelab_dp.cli import main
from tests.conftest import ROOT

DATA = ROOT / "assets" / "data"
GOOD = {"prompt": "Question: What is 2 + 2?\nAnswer:", "chosen": " 4.", "rejected": " 5."}


def _file(tmp_path: Path, bad: dict) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [GOOD] * 8 + [bad]), encoding="utf-8")
    return str(path)


# case -> (preset overrides, the error line's words ({file}: the data file))
CASES = {
    "sft on pairs": (["--set", "train.objective=sft"], "tiny-preferences.jsonl:1: the data "
                     "holds preference pairs (chosen, rejected), and train.objective sft"),
    "a row without rejected": ({"prompt": "Q:", "chosen": " a"},
                               "{file}:9: field 'rejected' missing"),
    "an empty response": ({"prompt": "Q:", "chosen": " a", "rejected": ""},
                          "{file}:9: field 'rejected' is empty (an empty response)"),
    "a prompt longer than seq_len": ({"prompt": "Q: " + "what is 1 + 1? " * 30, "chosen": " 2",
                                      "rejected": " 3"}, "{file}:9: the prompt takes"),
    "dpo on instruction data": (["--set", f"data.path={DATA / 'tiny-instruct.jsonl'}"],
                                "tiny-instruct.jsonl: train.objective dpo needs preference "
                                "pairs"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_preference_data_is_refused_before_anything_starts(kind, in_repo, tmp_path, capsys):
    extra, needle = CASES[kind]
    if isinstance(extra, dict):
        file = _file(tmp_path, extra)
        extra, needle = ["--set", f"data.path={file}"], needle.format(file=file)
    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    rc = main(["run", "tiny-dpo", *extra, "--detach"])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "", out
    assert lines[0].startswith("error: ") and needle in lines[0], lines
    assert lines[-1].startswith("hint: ") and "Traceback" not in out.err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "spawned"
    assert not runs.exists() or not any(runs.iterdir()), "a run folder was made"
