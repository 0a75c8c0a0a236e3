"""A resume of a run with no usable checkpoint says that it starts again from step 1 (a notice on
stderr, the state's reason, the resume event and ``resume_from`` 0 in ``--json``): never silent.

The resumed run waits in the queue behind a running run (this test's own process, recorded with
its start time), so its keeper starts nothing; stopping it ends it "interrupted"."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from homelab_dp.cli import main
from homelab_dp.runs.folder.run_state import current_state, read_state, update_state

from ..conftest import DATA

COMPLETED = DATA / "bad_input" / "runs" / "completed-run"


def _run(name: str, status: str) -> Path:
    run = Path(os.environ["HOMELAB_DP_RUNS"]) / name
    run.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(COMPLETED, run)
    spec = json.loads((run / "spec.json").read_text(encoding="utf-8"))
    spec["run_id"] = name
    (run / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    (run / "state.json").unlink()
    update_state(run, status=status, run_id=name, created=1795900000.0, attempt=1)
    return run


def test_a_resume_without_checkpoint_says_it_starts_from_step_1(capsys) -> None:
    busy = _run("busy-run", "running")
    update_state(busy, pids={"keeper": os.getpid()})  # alive, and recorded as the run's
    failed = _run("failed-run", "failed")
    rc = main(["resume", "failed-run", "--queue", "--detach", "--json"])
    out = capsys.readouterr()
    try:
        assert rc == 0, out.err
        assert "notice: run failed-run has no usable checkpoint: it starts again from step 1" in (
            out.err
        )
        assert json.loads(out.out)["resume_from"] == 0
        state = read_state(failed)
        assert state["resume_from"] == 0 and "from step 1" in state["reason"]
        events = [json.loads(line) for line in (failed / "events.jsonl").read_text().splitlines()]
        assert events[-1]["resume"] is True and "no usable checkpoint" in events[-1]["reason"]
    finally:
        assert main(["stop", "failed-run", "--timeout", "30"]) == 0
    assert current_state(failed)["status"] == "interrupted"
