"""Helpers for the torchrun integration tests: a tiny model, small data sets, and real runs.

Every run goes through the real launcher (`launch` → torchrun → the worker, gloo on the
CPU); nothing of ours is mocked. The tiny model (hidden 32, 2 layers, the demo tokenizer) is
built once per session.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.folder.run_folder import create_run_dir, read_run_spec, write_run_spec
from homelab_dp.runs.folder.run_state import read_state
from homelab_dp.runs.run_spec import Launch, Rendezvous, Resolved, RunSpec
from homelab_dp.supervise.launcher import launch

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
DEMO_DATA = ROOT / "assets" / "data" / "tiny-instruct.jsonl"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random LLaMA-style model (hidden 32, 2 layers, GQA) with the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Instruction data of varied lengths: with pack = false every block has its own token count."""
    out = tmp_path_factory.mktemp("data")
    lines = DEMO_DATA.read_text(encoding="utf-8").splitlines()
    for n in (12, 16, 64):
        (out / f"ragged-{n}.jsonl").write_text("\n".join(lines[:n]) + "\n", encoding="utf-8")
    return out


def make_run(
    root: Path,
    model: Path,
    data: Path,
    *,
    name: str,
    distribution: str = "ddp",
    method: str = "full",
    world: int = 2,
    micro: int = 2,
    accum: int = 1,
    dtype: str = "fp32",
    lr: float = 1e-3,
    seq_len: int = 32,
    activation_checkpointing: bool = False,
    train: dict[str, Any] | None = None,
    rendezvous: Rendezvous | None = None,
    offload: str = "none",
    offload_activations: bool = False,
    measure_steps: int = 0,
    sequence_parallel: int = 1,
    pack: bool = False,
    data_extra: dict[str, Any] | None = None,
) -> Path:
    """A run folder with spec.json for the given plan (what the controller would write);
    ``data_extra``: more [data] keys (``eval_path``, ...)."""
    preset = preset_from_dict(
        {
            "model": {"path": str(model)},
            "data": {"path": str(data), "seq_len": seq_len, "pack": pack, **(data_extra or {})},
            "train": {
                "method": method,
                "distribution": distribution,
                "micro_batch": micro,
                "grad_accum": accum,
                "max_steps": 3,
                "lr": lr,
                "seed": 7,
                "sequence_parallel": sequence_parallel,
                **(train or {}),
            },
            "lora": {"r": 4, "alpha": 8},
            "hardware": {"devices": "cpu", "nproc": world},
        }
    )
    resolved = Resolved(
        method=method,  # type: ignore[arg-type]
        distribution=distribution,  # type: ignore[arg-type]
        activation_checkpointing=activation_checkpointing,
        device="cpu",
        world_size=world,
        dtype=dtype,  # type: ignore[arg-type]
        micro_batch=micro,
        grad_accum=accum,
        lr=lr,
        offload=offload,  # type: ignore[arg-type]
        offload_activations=offload_activations,
        sequence_parallel=sequence_parallel,
    )
    rdzv = rendezvous or Rendezvous()
    launch = Launch(nproc_per_node=world // rdzv.nnodes, rendezvous=rdzv)
    spec = RunSpec(
        run_id=name, preset=preset, resolved=resolved, launch=launch, measure_steps=measure_steps
    )
    return create_run_dir(spec, root)


def _launch(
    run_dir: Path, nproc: int, *, stop_at: int | None = None, resume: bool = False
) -> subprocess.Popen[bytes]:
    """`run`'s launch, not waited for."""
    spec = read_run_spec(run_dir)
    if spec.launch.nproc_per_node != nproc:
        write_run_spec(run_dir, replace(spec, launch=replace(spec.launch, nproc_per_node=nproc)))
    env = {} if stop_at is None else {"HOMELAB_DP_STOP_AT_STEP": str(stop_at)}
    return launch(run_dir, resume=resume, extra_env=env)


def _waited(run_dir: Path, proc: subprocess.Popen[bytes]) -> int:
    rc = proc.wait()
    if rc != 0:
        print((run_dir / "logs" / "launcher.log").read_text(encoding="utf-8")[-6000:])
    return rc


def run(run_dir: Path, nproc: int, *, stop_at: int | None = None, resume: bool = False) -> int:
    """Run to the end (or to a test stop after ``stop_at`` steps) under the real launcher, on
    ``nproc`` processes (another count than the spec's: resuming on fewer or more processes)."""
    kw: dict[str, Any] = {"stop_at": stop_at, "resume": resume}
    return run_together((run_dir, nproc, kw))[0]


def run_together(*runs: tuple[Path, int, dict[str, Any]]) -> list[int]:
    """Independent runs at once, each ``(run_dir, nproc, run's keywords)`` started as `run`
    starts it; their exit codes. On the test machine's 2 cores a 1-process run (its agent,
    then its one worker) leaves a core idle, and every launch spends most of its time starting
    (imports, the rendezvous): two runs side by side take less time than one after the other.
    Only for runs whose claims are about their results, never their timings."""
    procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
    try:
        for rd, nproc, kw in runs:
            procs.append((rd, _launch(rd, nproc, **kw)))
        return [_waited(rd, proc) for rd, proc in procs]
    finally:  # Ctrl-C or a failed start: no run left behind (each is in its own session)
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait()


def run_detached(*argv: str, guard_s: float) -> Path:
    """``homelab-dp run ARGV --detach`` in this process (the preflight runs here), waited for in
    its run folder until it completes; the run folder. ``guard_s`` is a liveness guard."""
    from homelab_dp.cli import main
    from homelab_dp.vocabulary import FINAL_STATUSES

    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    before = set(runs.iterdir()) if runs.exists() else set()
    assert main(["run", *argv, "--detach"]) == 0
    (run_dir,) = set(runs.iterdir()) - before
    deadline = time.time() + guard_s
    while read_state(run_dir).get("status") not in FINAL_STATUSES:
        assert time.time() < deadline, read_state(run_dir)
        time.sleep(0.2)
    assert read_state(run_dir)["status"] == "completed", read_state(run_dir)
    return run_dir


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events, optionally only one type."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [e for e in out if kind is None or e["type"] == kind]


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The result's tensors (model.safetensors or adapter_model.safetensors)."""
    from safetensors.torch import load_file

    final = run_dir / "final"
    name = "adapter_model.safetensors" if (final / "adapter_config.json").exists() else None
    return load_file(final / (name or "model.safetensors"))


def copy_run(src: Path, dst_root: Path, name: str) -> Path:
    """A copy of a run folder (to resume one stopped run in several ways)."""
    dst = dst_root / name
    shutil.copytree(src, dst)
    spec = json.loads((dst / "spec.json").read_text(encoding="utf-8"))
    spec["run_id"] = name
    (dst / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    return dst


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest elementwise difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys and every tensor identical bit for bit."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def held_workers(run_dir: Path, count: int, timeout: float = 60) -> list[int]:
    """The run's ``count`` workers, once all have stopped themselves (SIGSTOP) where the test
    told them to (``HOMELAB_DP_FAULT``).

    ``timeout`` is a liveness guard: they stop within a step of their first step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        workers = read_state(run_dir).get("pids", {}).get("workers") or []
        with contextlib.suppress(psutil.NoSuchProcess):
            stopped = [psutil.Process(p).status() == psutil.STATUS_STOPPED for p in workers]
            if len(workers) == count and all(stopped):
                return workers
        time.sleep(0.05)
    raise AssertionError(
        f"the workers did not hold still within {timeout} s: {read_state(run_dir)}"
    )


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a `serve` process (it stops its replicas), SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], out: Path, err: Path, guard_s: float) -> str:
    """The line a `serve` process prints once its replicas are ready (a liveness guard of
    ``guard_s``; a process that exits first fails the test with its stderr)."""
    deadline = time.monotonic() + guard_s
    while not out.read_text().strip():
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)
    return out.read_text()
