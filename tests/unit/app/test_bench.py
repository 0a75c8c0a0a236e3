"""`homelab-dp bench` in this process: bad input refused before anything starts, and the pieces
of the result (lm_eval's metric names, the stored file, relative data_files, the table).

Nothing here starts lm_eval's evaluation: the torchrun runs are in
tests/integration/test_bench.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from homelab_dp.app.bench import (
    BASE_BENCH_FILE,
    BENCH_FILE,
    BENCH_MODULE,
    _local_data_files,
    bench_env,
    job_document,
    metric_doc,
    prepare,
    read_bench,
    store_result,
    task_config,
)
from homelab_dp.render.bench import bench_rows
from tests.conftest import DATA, run_cli
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run

TASK = DATA / "bench" / "tiny_arith.yaml"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A full fine-tune's run folder whose final/ holds the demo model (no training)."""
    folder = make_run(tmp_path / "runs", DEMO_MODEL, DEMO_DATA, name="20260101-000000-full-unit")
    shutil.copytree(DEMO_MODEL, folder / "final")
    return folder


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a bench would make its job folder: empty afterwards means nothing was started."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _refused(capsys: pytest.CaptureFixture[str], temp_root: Path, *argv: str) -> str:
    """`bench ARGV`: exit 2, an error line and a hint line, no traceback, no job folder."""
    rc, out, err = run_cli(capsys, "bench", *argv)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and any(ln.startswith("hint: ") for ln in lines), err
    assert "Traceback" not in err and out == ""
    assert list(temp_root.iterdir()) == []  # no torchrun job was prepared
    return err


def test_unknown_task_names_near_ones(
    capsys: pytest.CaptureFixture[str], temp_root: Path, run: Path
) -> None:
    err = _refused(capsys, temp_root, str(run), "--tasks", "hellaswg", "--gpus", "cpu:1")
    assert "unknown task 'hellaswg'" in err and "hellaswag" in err.split("hint:")[1]
    assert not (run / BENCH_FILE).exists()


def test_task_file_that_does_not_parse_names_its_line(
    capsys: pytest.CaptureFixture[str], temp_root: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: broken\ndataset_path: json\ndoc_to_text: [unclosed\n", encoding="utf-8")
    err = _refused(capsys, temp_root, str(DEMO_MODEL), "--tasks", str(bad), "--gpus", "cpu:1")
    assert str(bad) in err and " line " in err and "not a readable task file" in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [("- a list\n- not a mapping\n", "not a readable task file"),
     ("dataset_path: json\n", "names no task")],
)  # fmt: skip
def test_task_file_that_is_no_task(
    capsys: pytest.CaptureFixture[str], temp_root: Path, tmp_path: Path, content: str,
    expected: str,
) -> None:  # fmt: skip
    bad = tmp_path / "t.yaml"
    bad.write_text(content, encoding="utf-8")
    err = _refused(capsys, temp_root, str(DEMO_MODEL), "--tasks", str(bad), "--gpus", "cpu:1")
    assert expected in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [str(DEMO_MODEL), "--tasks", "missing/task.yaml"],
            "task file missing/task.yaml not found",
        ),
        (["no-such-model-folder", "--tasks", str(TASK)], "model 'no-such-model-folder'"),
        ([str(DEMO_MODEL), "--tasks", str(TASK), "--limit", "0"], "--limit: must be at least 1"),
        ([str(DEMO_MODEL), "--tasks", " , "], "--tasks: no task given"),
        ([str(DEMO_MODEL), "--tasks", str(TASK), "--base"], "--base: tiny-llama is not a run"),
        (
            [str(DEMO_MODEL), "--tasks", str(TASK), "--gpus", "2x24GiB"],
            "--gpus: '2x24GiB' is not a device selection for bench",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], temp_root: Path, argv: list[str], expected: str
) -> None:
    gpus = [] if "--gpus" in argv else ["--gpus", "cpu:1"]  # never the NVML probe here
    assert expected in _refused(capsys, temp_root, *argv, *gpus)


def test_base_of_a_run_is_its_preset_model_stored_beside(run: Path) -> None:
    job = prepare(str(run), str(TASK), limit=3, gpus="cpu:2", base=True)
    assert job.ref.path == DEMO_MODEL and job.store == run / BASE_BENCH_FILE and job.base
    doc = job_document(job, Path("/j"))
    assert doc["pretrained"] == str(DEMO_MODEL) and doc["peft"] is None and doc["limit"] == 3
    assert doc["tasks"] == [{"name": "tiny_arith", "file": str(TASK)}]
    assert job.devices.kind == "cpu" and job.devices.nproc == 2
    plain = prepare(str(run), str(TASK), gpus="cpu:1")
    assert plain.ref.path == run / "final" and plain.store == run / BENCH_FILE


def test_adapter_folder_is_its_base_with_peft(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(DEMO_MODEL), "peft_type": "LORA"})
    )
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    doc = job_document(prepare(str(adapter), str(TASK), gpus="cpu:1"), tmp_path)
    assert doc["pretrained"] == str(DEMO_MODEL) and doc["peft"] == str(adapter)
    assert doc["tokenizer"] == str(DEMO_MODEL)  # the adapter folder holds none


def test_metric_names_drop_the_default_filter_only() -> None:
    raw = {"alias": "t", "name": "t", "sample_len": 12, "acc,none": 0.25,
           "acc_stderr,none": 0.125, "word_perplexity,none": 3.5,
           "word_perplexity_stderr,none": "N/A", "exact_match,flexible": 0.5,
           "exact_match_stderr,flexible": 0.1}  # fmt: skip
    assert metric_doc(raw) == {
        "acc": 0.25, "acc_stderr": 0.125, "word_perplexity": 3.5,
        "word_perplexity_stderr": None, "exact_match,flexible": 0.5,
        "exact_match_stderr,flexible": 0.1,
    }  # fmt: skip


def test_relative_data_files_are_read_beside_the_task_file(tmp_path: Path) -> None:
    folder = Path("/tasks")
    assert _local_data_files({"test": "a.jsonl", "train": ["b.jsonl", "/abs/c.jsonl"]},
                             folder) == {"test": "/tasks/a.jsonl",
                                         "train": ["/tasks/b.jsonl", "/abs/c.jsonl"]}  # fmt: skip
    assert _local_data_files("hf://datasets/x/y.jsonl", folder) == "hf://datasets/x/y.jsonl"
    cfg = task_config(TASK, trust_code=False)
    assert cfg["dataset_kwargs"]["data_files"] == {"test": str(TASK.parent / "tiny_arith.jsonl")}
    assert cfg["task"] == "tiny_arith" and cfg["output_type"] == "multiple_choice"


def test_stored_result_merges_tasks_by_name(tmp_path: Path) -> None:
    first = {"model": "m", "tasks": {"a": {"acc": 0.5}, "b": {"acc": 0.1}},
             "samples": {"a": 4, "b": 4}, "seconds": 1.0}  # fmt: skip
    second = {"model": "m", "tasks": {"b": {"acc": 0.2}, "c": {"acc": 0.3}},
              "samples": {"b": 8, "c": 8}, "seconds": 2.0}  # fmt: skip
    store_result(tmp_path / BENCH_FILE, first)
    store_result(tmp_path / BENCH_FILE, second)
    doc = read_bench(tmp_path)
    assert doc == {"model": "m", "tasks": {"a": {"acc": 0.5}, "b": {"acc": 0.2}, "c": {"acc": 0.3}},
                   "samples": {"a": 4, "b": 8, "c": 8}, "seconds": 2.0}  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == [BENCH_FILE]  # no temporary file left
    assert read_bench(tmp_path, base=True) is None


def test_table_rows_pair_each_metric_with_its_stderr() -> None:
    doc = {"tasks": {"arith": {"acc": 0.25, "acc_stderr": 0.13, "acc_norm": 0.5,
                               "acc_norm_stderr": None, "em,flex": 1.0, "em_stderr,flex": 0.0}},
           "samples": {"arith": 12}}  # fmt: skip
    assert bench_rows(doc) == [
        ("arith (12)", "acc", "0.2500", "0.1300"),
        ("", "acc_norm", "0.5000", "-"),
        ("", "em,flex", "1.0000", "0.0000"),
    ]


def test_task_data_not_in_the_cache_is_bad_input(tmp_path: Path) -> None:
    """The worker (one rank, offline as bench starts it) turns datasets'
    offline ConnectionError into bad input: exit 2, an error file with a hint, no result."""
    task = tmp_path / "t.yaml"
    task.write_text("task: not_cached\ndataset_path: homelab-dp-tests/not-cached\n"
                    "test_split: test\noutput_type: loglikelihood\ndoc_to_text: '{{q}}'\n"
                    "doc_to_target: '{{a}}'\n", encoding="utf-8")  # fmt: skip
    job = prepare(str(DEMO_MODEL), str(task), gpus="cpu:1")
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job_document(job, tmp_path)), encoding="utf-8")
    # No torchrun world (no RANK, WORLD_SIZE): HFLM runs as one process, the worker as rank 0.
    env = {k: v for k, v in bench_env(job.devices).items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", BENCH_MODULE, str(job_file)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    error = json.loads((tmp_path / "errors" / "rank-0.json").read_text(encoding="utf-8"))
    assert error["bad_input"] is True and "homelab-dp-tests/not-cached" in error["message"]
    assert "not in the Hugging Face cache" in error["message"] and "dataset_path" in error["hint"]
    assert not (tmp_path / "result.json").exists()


def test_front_end_checks_without_torch() -> None:
    """Everything bench checks before it starts (MODEL, the task file, the devices) loads no
    torch nor transformers in the CLI's process: lm_eval's task loading does not need them."""
    code = (
        "import sys\nfrom homelab_dp.app.bench import prepare\n"
        f"prepare({str(DEMO_MODEL)!r}, {str(TASK)!r}, limit=2, gpus='cpu:1')\n"
        "print(sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip() == "['lm_eval']"  # it did read the task file through lm_eval
