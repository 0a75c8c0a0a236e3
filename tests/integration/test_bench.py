"""`homelab-dp bench` through the real CLI: lm_eval under real torchrun workers on the CPU.

- On the demo model and two tiny local task files (a multiple-choice task and a rolling
  log-likelihood one), `bench --json` gives exactly the metrics `lm_eval.simple_evaluate` gives
  when called directly in this process on the same model and tasks (lm_eval reading the
  task files itself, from their folder).
- A run folder as MODEL, on 2 CPU processes (HFLM shards the requests over the torchrun world):
  the same metrics as 1 process, stored as the run's bench.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.app.bench import BATCH_SIZE, BENCH_FILE, read_bench
from homelab_dp.cli import main
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run

from ..conftest import DATA, run_cli

pytestmark = pytest.mark.slow

TASKS_DIR = DATA / "bench"
TASK_FILES = (TASKS_DIR / "tiny_arith.yaml", TASKS_DIR / "tiny_text.yaml")
TASKS_ARG = ",".join(map(str, TASK_FILES))


@pytest.fixture(scope="module")
def direct() -> dict[str, Any]:
    """lm_eval's own answer: simple_evaluate on the demo model and the task files, in this
    process, from the tasks' folder (lm_eval reads a relative data_files from the working
    folder)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(TASKS_DIR)
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(DEMO_MODEL), "dtype": "float32"},
            tasks=[str(p) for p in TASK_FILES],
            task_manager=TaskManager(include_defaults=False),
            device="cpu",
            batch_size=BATCH_SIZE,
        )
    return out["results"]


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    """`bench DEMO_MODEL --tasks BOTH --gpus cpu:1 --json`: its JSON document (module-scoped,
    so stdout is caught here rather than by the function-scoped capsys)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", str(DEMO_MODEL), "--tasks", TASKS_ARG, "--gpus", "cpu:1", "--json"])
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


def test_bench_equals_lm_eval_called_directly(
    one_process: dict[str, Any], direct: dict[str, Any]
) -> None:
    doc = one_process
    assert set(doc["tasks"]) == {"tiny_arith", "tiny_text"}
    assert doc["samples"] == {"tiny_arith": 12, "tiny_text": 12}
    assert doc["world_size"] == 1 and doc["device"] == "cpu" and doc["model"] == "tiny-llama"
    assert doc["seconds"] > 0
    arith, text = doc["tasks"]["tiny_arith"], doc["tasks"]["tiny_text"]
    assert set(arith) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert set(text) == {"word_perplexity", "byte_perplexity", "bits_per_byte",
                         "word_perplexity_stderr", "byte_perplexity_stderr",
                         "bits_per_byte_stderr"}  # fmt: skip
    for task, metrics in doc["tasks"].items():
        for name, value in metrics.items():
            metric, _, _ = name.partition(",")
            expected = direct[task][f"{metric},none"]
            assert value == (expected if expected != "N/A" else None), (task, name)  # exact
    # Not trivially equal: a perplexity above 1 and a real accuracy were computed.
    assert text["word_perplexity"] > 1.0 and 0.0 <= arith["acc"] <= 1.0
    assert 0.0 < arith["acc_stderr"] < 1.0


def test_run_folder_on_two_processes_stores_bench_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_process: dict[str, Any]
) -> None:
    run = make_run(tmp_path / "runs", DEMO_MODEL, DEMO_DATA, name="20260101-000000-full-bnch")
    shutil.copytree(DEMO_MODEL, run / "final")
    rc, out, err = run_cli(capsys, "bench", str(run), "--tasks", TASKS_ARG, "--gpus", "cpu:2",
                           "--json")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["world_size"] == 2 and doc["model"] == run.name and doc["base"] is False
    assert doc["tasks"] == one_process["tasks"]  # the same metrics, exactly, as 1 process
    stored = read_bench(run)
    assert stored is not None and (run / BENCH_FILE).is_file()
    assert stored["tasks"] == doc["tasks"] and stored["seconds"] == doc["seconds"]
    assert not (run / "bench-base.json").exists()


def test_a_trusted_function_runs_in_the_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_process: dict[str, Any]
) -> None:
    """``--trust-task-code``: the task file's ``!function`` is imported by the workers (their
    marker file), and a process_docs that keeps every document gives the same metrics."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "keep.py").write_text(
        "import os, pathlib\n"
        "def docs(ds):\n"
        "    pathlib.Path(__file__).with_name(f\"rank{os.environ.get('RANK', '?')}\").touch()\n"
        "    return ds\n",
        encoding="utf-8",
    )
    text = (TASKS_DIR / "tiny_arith.yaml").read_text(encoding="utf-8")
    text = text.replace("test: tiny_arith.jsonl", f"test: {TASKS_DIR / 'tiny_arith.jsonl'}")
    (folder / "t.yaml").write_text(text + "process_docs: !function keep.docs\n", encoding="utf-8")
    argv = ["bench", str(DEMO_MODEL), "--tasks", str(folder / "t.yaml"), "--gpus", "cpu:1"]
    rc, _, err = run_cli(capsys, *argv, "--json")
    assert rc == 2 and "--trust-task-code" in err and not (folder / "rank0").exists()
    rc, out, err = run_cli(capsys, *argv, "--json", "--trust-task-code")
    assert rc == 0, err
    assert (folder / "rank0").exists()
    assert json.loads(out)["tasks"]["tiny_arith"] == one_process["tasks"]["tiny_arith"]
