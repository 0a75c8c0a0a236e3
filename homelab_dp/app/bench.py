"""`homelab-dp bench MODEL --tasks NAMES|FILE.yaml`: lm-evaluation-harness on a model, data-parallel.

The front end (`prepare`, in the CLI's process: no torch) checks everything before anything
starts: ``--limit``, MODEL (`runs.model_ref.resolve_model_arg`: a run id or folder, a model
or adapter folder, a Hugging Face id from the local cache only), ``--base`` (the run's base
model), the devices (`app.evaluate.select_devices`), and the tasks: each item of ``--tasks``
(comma-separated) is a task file (``.yaml``/``.yml``, or any path that exists), checked as the
workers will load it (`app.task_files`: bounded safe YAML, lm_eval's keys and types, includes
inside its folder, and no code without ``--trust-task-code``), or a task name known to lm_eval's
task index (an unknown name: exit 2 with the nearest known names). Then `run_bench` starts
``torchrun … -m homelab_dp.app.bench JOB`` (N CPU processes on gloo, or one per chosen GPU), as
`homelab-dp eval` does (`app.evaluate.run_eval`: a private temporary folder, Ctrl-C stops every
worker). Each rank
runs ``lm_eval.simple_evaluate`` with HFLM: HFLM sees the torchrun world through accelerate and
shards the requests across the ranks; rank 0 writes the gathered result.

A task file is handed to lm_eval as its config, read by the front end's own rule
(`app.task_files.load_task_file`; its ``include:`` and, only when trusted, its ``!function``
resolved next to the file, as lm_eval does), with a relative ``dataset_kwargs.data_files`` read
from the task file's folder (lm_eval itself would read it from the working folder). Without
``--trust-task-code`` every Jinja template (lm_eval's own tasks' too) renders in Jinja's
sandbox. Datasets are read offline (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``): task
names need their data in the Hugging Face cache.

A LoRA result is evaluated as HFLM(pretrained=BASE, peft=ADAPTER); a run that merged its
adapter (``final/merged``) as that folder. A QLoRA result is evaluated on its 16-bit base plus
the adapter (noted in the result): the NF4 base it trained against is not rebuilt here.

The result (``--json``, and the file stored with a run)::

    {"model": "<name>", "path": "<folder evaluated>", "base": false,
     "tasks": {"<task>": {"<metric>": 0.25, "<metric>_stderr": 0.13, ...}},
     "samples": {"<task>": 12}, "limit": null, "world_size": 1, "device": "cpu",
     "seconds": 12.3, "lm_eval": "0.4.13", "notes": [], "time": "2026-...Z"}

Metric names are lm_eval's with its default filter's ``,none`` dropped (``acc``,
``acc_norm``, ``word_perplexity``); another filter stays in the name (``exact_match,flexible``).
Each metric's standard error sits beside it as ``<metric>_stderr`` (``<metric>_stderr,<filter>``
for another filter); null where lm_eval gives none. ``samples``: documents evaluated per task.

Stored with the run: a run MODEL writes ``<run>/bench.json`` (``--base``: ``bench-base.json``,
the base model's scores for the before/after line). A later bench of other tasks adds them to
the same file: its ``tasks`` (and ``samples``) merge by task name, a task run again replaces
its entry; the other fields describe the latest bench. The file is written whole and renamed
into place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from homelab_dp.app.evaluate import (
    Devices,
    eval_env,
    job_failure,
    launch_and_wait,
    select_devices,
)
from homelab_dp.app.task_files import (  # noqa: F401  (check_tasks: bench's own)
    TaskSpec,
    check_tasks,
    lm_eval_version,
    load_task_file,
    sandbox_templates,
)
from homelab_dp.errors import HardwareSpecError, HomelabError
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.model_ref import ModelRef, resolve_model, resolve_model_arg
from homelab_dp.supervise.launcher import torchrun_command
from homelab_dp.user_files.private_write import write_whole

BENCH_MODULE = "homelab_dp.app.bench"
BENCH_FILE = "bench.json"
BASE_BENCH_FILE = "bench-base.json"
DEFAULT_FILTER = "none"
"""lm_eval's name for "no filter": dropped from the metric names."""
BATCH_SIZE = 8
"""Requests per forward pass in each rank (lm_eval's ``batch_size``)."""


@dataclass(frozen=True)
class BenchJob:
    """Everything checked and resolved: what the workers are started with."""

    ref: ModelRef
    """The model evaluated (for ``--base``: the run's base model)."""
    tasks: tuple[TaskSpec, ...]
    limit: int | None
    """Documents per task at most (lm_eval's ``limit``); None for all."""
    devices: Devices
    base: bool = False
    """This is the base model of the run ``store`` belongs to."""
    store: Path | None = None
    """Where the result is stored (``<run>/bench.json`` or ``bench-base.json``); None: nowhere."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    trust_code: bool = False
    """``--trust-task-code``: the task files may run code (`app.task_files`)."""


def base_ref(ref: ModelRef) -> ModelRef:
    """The base model of the run ``ref`` came from (``--base``)."""
    if ref.run_dir is None:
        raise HomelabError(
            f"--base: {ref.name} is not a run; only a run has a base model",
            hint="give a run id or run folder, or bench the base model folder itself",
        )
    path = read_run_spec(ref.run_dir).preset.model.path  # a hub id is a local snapshot there
    base = resolve_model(str(ref.base or path))
    return ModelRef(name=f"{ref.name} (base)", path=base.path, base=base.base, run_dir=ref.run_dir,
                    trust_remote_code=ref.trust_remote_code, dtype=ref.dtype)  # fmt: skip


def prepare(model: str, tasks: str | list[str], limit: int | None = None,
            gpus: str | None = None, base: bool = False, *,
            trust_code: bool = False) -> BenchJob:  # fmt: skip
    """Resolve and check everything `bench` was given; a HomelabError before anything starts.
    ``trust_code``: ``--trust-task-code`` (task files may run code)."""
    from homelab_dp.app.evaluate import check_model, parse_gpus

    if limit is not None and limit < 1:
        raise HomelabError(f"--limit: must be at least 1, got {limit}",
                           hint="documents per task, e.g. --limit 100; leave it out for all")  # fmt: skip
    with _as_bench():
        parse_gpus(gpus)
    ref = resolve_model_arg(model, fetch=False)  # no network: the local cache only
    if base:
        ref = base_ref(ref)
    check_model(ref)
    specs = check_tasks(tasks, trust_code=trust_code)
    store = None
    if ref.run_dir is not None:
        store = ref.run_dir / (BASE_BENCH_FILE if base else BENCH_FILE)
    notes = ()
    if ref.quantized == "nf4":
        notes = ("QLoRA result: evaluated on its 16-bit base with the adapter, not the NF4 base",)
    with _as_bench():
        devices = select_devices(gpus)
    return BenchJob(ref, specs, limit, devices, base, store, notes, trust_code)


@contextlib.contextmanager
def _as_bench() -> Iterator[None]:
    """eval's device selection, its errors worded for bench (they name `eval`)."""
    try:
        yield
    except HardwareSpecError as exc:
        raise HardwareSpecError(exc.message.replace("for eval", "for bench"),
                                exc.hint.replace("eval runs", "bench runs")) from None  # fmt: skip


def job_document(job: BenchJob, folder: Path) -> dict[str, Any]:
    """What the workers read (`worker_main`)."""
    ref = job.ref
    return {
        "pretrained": str(ref.base if ref.is_adapter else ref.path),
        "peft": str(ref.path) if ref.is_adapter else None,
        "tokenizer": str(ref.tokenizer_path),
        "trust_remote_code": ref.trust_remote_code,
        "dtype": ref.dtype,
        "device": job.devices.kind,
        "tasks": [{"name": t.name, "file": str(t.file) if t.file else None} for t in job.tasks],
        "trust_code": job.trust_code,
        "index": any(t.members for t in job.tasks),
        "limit": job.limit,
        "batch_size": BATCH_SIZE,
        "result_path": str(folder / "result.json"),
        "error_dir": str(folder / "errors"),
    }


def bench_env(devices: Devices) -> dict[str, str]:
    """eval's worker environment (chosen cards only, loopback, offline) with datasets offline."""
    env = eval_env(devices)
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_bench(job: BenchJob) -> dict[str, Any]:
    """Run ``job`` under torchrun; the result document (stored with the run where there is one)."""
    start = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="homelab-dp-bench-"))  # 0700
    job_file = folder / "job.json"
    job_doc = job_document(job, folder)
    job_file.write_text(json.dumps(job_doc, indent=2), encoding="utf-8")
    cmd = torchrun_command(folder, job.devices.nproc, worker=(BENCH_MODULE, job_file))
    rc = launch_and_wait(folder, cmd, bench_env(job.devices))
    result = folder / "result.json"
    if rc != 0 or not result.is_file():
        raise job_failure(folder, rc, "bench")
    raw = json.loads(result.read_text(encoding="utf-8"))
    shutil.rmtree(folder, ignore_errors=True)
    doc = {
        "model": job.ref.name,
        "path": job_doc["peft"] or job_doc["pretrained"],
        "base": job.base,
        "tasks": raw["tasks"],
        "samples": raw["samples"],
        "limit": job.limit,
        "world_size": raw["world_size"],
        "device": job.devices.kind,
        "seconds": round(time.monotonic() - start, 3),
        "lm_eval": raw["lm_eval"],
        "notes": list(job.notes),
        "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if job.store is not None:
        store_result(job.store, doc)
    return doc


def store_result(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path``, keeping the tasks of an earlier bench that this one did not
    run (see the module docstring); written to a temporary file and renamed into place."""
    merged = dict(doc)
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or torn: this bench's result alone
        old = {}
    if isinstance(old, dict):
        for key in ("tasks", "samples"):
            if isinstance(old.get(key), dict):
                merged[key] = {**old[key], **doc[key]}
    write_whole(path, json.dumps(merged, indent=2) + "\n")


def read_bench(run_dir: Path, base: bool = False) -> dict[str, Any] | None:
    """A run's stored bench result (``base``: its base model's), or None when it has none."""
    try:
        doc = json.loads((run_dir / (BASE_BENCH_FILE if base else BENCH_FILE)).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def bench_model(model: str, tasks: str | list[str], limit: int | None = None,
                gpus: str | None = None, base: bool = False, *,
                trust_code: bool = False) -> dict[str, Any]:  # fmt: skip
    """`prepare` then `run_bench`: what `homelab-dp bench` does."""
    return run_bench(prepare(model, tasks, limit, gpus, base, trust_code=trust_code))


# --- the worker: one rank under torchrun ---------------------------------------------------


def _local_data_files(value: Any, folder: Path) -> Any:
    """``data_files`` (a path, a list, or a split → path(s) mapping) with relative local
    paths read from ``folder``; URLs and absolute paths kept."""
    if isinstance(value, dict):
        return {k: _local_data_files(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_local_data_files(v, folder) for v in value]
    if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
        return str(folder / value)
    return value


def task_config(path: Path, trust_code: bool) -> dict[str, Any]:
    """A task file as the config lm_eval builds the task from (see the module docstring),
    read by the front end's rule (`task_files.load_task_file`): a file changed since the check
    is checked again, and its functions are imported only with ``trust_code``."""
    cfg = load_task_file(path, trust_code=trust_code, resolve=True)
    kwargs = cfg.get("dataset_kwargs")
    if isinstance(kwargs, dict) and "data_files" in kwargs:
        cfg["dataset_kwargs"] = {
            **kwargs,
            "data_files": _local_data_files(kwargs["data_files"], path.parent),
        }
    return cfg


def metric_doc(results: dict[str, Any]) -> dict[str, Any]:
    """lm_eval's ``results[task]`` as ``{metric: value, metric_stderr: value}`` (module doc)."""
    out: dict[str, Any] = {}
    for key, value in results.items():
        metric, sep, filt = key.partition(",")
        if not sep:  # alias, name, sample_len: not metrics
            continue
        name = metric if filt == DEFAULT_FILTER else f"{metric},{filt}"
        out[name] = value if isinstance(value, (int, float)) else None  # "N/A": no stderr
    return out


def evaluate_job(job: dict[str, Any]) -> dict[str, Any] | None:
    """Run lm_eval on this rank; rank 0's result document, None on the other ranks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    files = [t for t in job["tasks"] if t["file"]]
    names = [t["name"] for t in job["tasks"] if not t["file"]]
    trust = job.get("trust_code") is True
    if not trust:
        sandbox_templates()
    manager = TaskManager(include_defaults=bool(names) or job.get("index") is True)
    specs: list[Any] = [*names, *(task_config(Path(t["file"]), trust) for t in files)]
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(job["dtype"], "auto")
    model_args: dict[str, Any] = {
        "pretrained": job["pretrained"],
        "tokenizer": job["tokenizer"],
        "dtype": dtype,
        "trust_remote_code": bool(job["trust_remote_code"]),
    }
    if job["peft"]:
        model_args["peft"] = job["peft"]
    try:
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=model_args,
            tasks=specs,
            task_manager=manager,
            device="cuda" if job["device"] == "cuda" else "cpu",
            batch_size=job["batch_size"],
            limit=job["limit"],
            log_samples=False,
        )
    except ConnectionError as exc:  # datasets, offline: a task's data is not in the cache
        raise HomelabError(
            f"a task's data set is not in the Hugging Face cache, and bench never goes online "
            f"({exc})",
            hint='load it once where there is network (python -c "import datasets; '
            "datasets.load_dataset('ORG/NAME', 'CONFIG')\") so that it is cached, or give a "
            "task .yaml over a local file (dataset_path: json, dataset_kwargs: data_files: ...)",
        ) from None
    if out is None:  # a rank other than 0
        return None
    return {
        "tasks": {task: metric_doc(res) for task, res in out["results"].items()},
        "samples": {
            t: int(n.get("effective", n.get("original", 0)))
            for t, n in out.get("n-samples", {}).items()
        },  # fmt: skip
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "lm_eval": lm_eval_version(),
    }


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc), encoding="utf-8")


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (``python -m homelab_dp.app.bench JOB_FILE`` under torchrun)."""
    parser = argparse.ArgumentParser(prog=f"python -m {BENCH_MODULE}")
    parser.add_argument("job_file", type=Path)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")
    job = json.loads(args.job_file.read_text(encoding="utf-8"))
    error: dict[str, Any]
    try:
        doc = evaluate_job(job)
        if doc is not None:
            _write_json(Path(job["result_path"]), doc)
        return 0
    except HomelabError as exc:
        error = {"rank": rank, "message": exc.message, "hint": exc.hint, "bad_input": True}
        code = exc.exit_code
    except Exception as exc:  # any crash: say which rank and what, then fail
        error = {"rank": rank, "message": f"{type(exc).__name__}: {exc}", "bad_input": False}
        code = 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(ImportError, RuntimeError):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    _write_json(Path(job["error_dir"]) / f"rank-{rank}.json", error)
    return code


if __name__ == "__main__":
    sys.exit(worker_main())
