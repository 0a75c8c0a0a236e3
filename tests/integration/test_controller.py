"""The run controller end to end, through the real console script, torchrun and gloo on CPU.

Detached runs, attach, killing the follower, graceful stop and resume, two runs at once, and a
two-"node" run over loopback that must match a one-node run of the same world size.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from homelab_dp.cli.main import main
from homelab_dp.runs.folder.run_state import alive_pids, read_state
from homelab_dp.runs.preset_results import read_results
from homelab_dp.train.loop.rank_guard import FAULT_ENV
from tests.conftest import write_preset
from tests.integration.conftest import held_workers

EXE = Path(sys.executable).with_name("homelab-dp")
pytestmark = pytest.mark.slow


def cli(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(EXE), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def start_detached(env: dict[str, str], preset: Path, *extra: str) -> str:
    out = cli(env, "run", str(preset), "--detach", "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["run_id"]


def wait_status(env: dict[str, str], run_id: str, statuses: set[str], timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        doc = json.loads(cli(env, "status", run_id, "--json").stdout)
        if doc["status"] in statuses:
            return doc
        time.sleep(0.5)
    raise AssertionError(f"{run_id} did not reach {statuses}: {doc}")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    runs = tmp_path / "runs"
    return {**os.environ, "HOMELAB_DP_RUNS": str(runs)}


def test_two_detached_runs_at_once_complete_with_their_figures(
    env: dict[str, str], tiny_model: Path, data_dir: Path, tmp_path: Path, capsys
) -> None:
    data = data_dir / "ragged-64.jsonl"
    preset = write_preset(tmp_path, "p-6-64", tiny_model, data, seq_len=64, pack=True, max_steps=6)
    first = start_detached(env, preset, "--force")  # --force: the CPU host is in use by first
    second = start_detached(env, preset, "--force")
    assert first != second
    docs = [wait_status(env, r, {"completed", "failed"}) for r in (first, second)]
    for doc in docs:
        assert doc["status"] == "completed", doc["reason"]
        assert (doc["step"], doc["total_steps"]) == (6, 6)
        assert doc["loss"] > 0 and doc["tokens"] > 0 and doc["tokens_per_s"] > 0
        assert len(doc["peak_memory_bytes"]) == 2 and doc["estimate_bytes"] > 0
        assert Path(doc["final_path"], "model.safetensors").is_file()
        assert not alive_pids(read_state(Path(doc["path"])))
        assert stat.S_IMODE(os.stat(doc["path"]).st_mode) == 0o700
    runs = json.loads(cli(env, "runs", "--json").stdout)
    assert {r["run_id"] for r in runs} == {first, second}

    # Each is recorded against its preset with the figures `status` shows of it; the next plan
    # of the preset expects their duration, and `presets show` lists them.
    records = {r["run_id"]: r for r in read_results("p-6-64")}
    assert set(records) == {first, second}
    for doc in docs:
        r = records[doc["run_id"]]
        assert r == json.loads(Path(doc["path"], "results.json").read_text(encoding="utf-8"))
        assert (r["tokens_per_s"], r["mfu"], r["energy_wh"], r["wall_s"], r["tokens"], r["steps"],
                r["final_loss"], r["peak_memory_bytes"], r["source"]) == (
            doc["tokens_per_s"], doc["mfu"], doc["energy_wh"], doc["duration_s"], doc["tokens"],
            doc["step"], doc["loss"], doc["peak_memory_bytes"], str(preset))  # fmt: skip
    assert main(["plan", str(preset), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["expected"]
    tps = statistics.median(d["tokens_per_s"] for d in docs)
    tokens = 6 * statistics.median(d["tokens"] / 6 for d in docs)
    fixed = statistics.median(d["duration_s"] - d["tokens"] / d["tokens_per_s"] for d in docs)
    assert (expected["from_runs"], expected["tokens_per_s"]) == (2, tps)
    assert expected["duration_s"] == pytest.approx(max(fixed, 0) + tokens / tps)
    print(f"expected {expected}; the runs took {[d['duration_s'] for d in docs]} s")
    assert main(["plan", str(preset)]) == 0
    assert "expected: ~" in capsys.readouterr().out
    assert main(["presets", "show", str(preset)]) == 0
    assert {first, second} <= set(capsys.readouterr().out.split())


STOP_STEPS = 12
"""Steps of the run stopped at step 2 and resumed (it trains the other ten)."""


def test_attach_kill_follower_stop_and_resume(
    env: dict[str, str], tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """`stop` must find the run still going. Rather than racing the run, both ranks hold still
    at the start of step 2 (an injected SIGSTOP, `homelab_dp.train.loop.rank_guard`) until the stop
    request is pending on them; then they go on and take it at that step's end. The resume
    trains the rest, to STOP_STEPS."""
    data = data_dir / "ragged-64.jsonl"
    preset = write_preset(
        tmp_path, "p-12-64", tiny_model, data, seq_len=64, pack=True, max_steps=STOP_STEPS
    )
    hold = "sigstop:rank=0:step=2;sigstop:rank=1:step=2"  # fires once per run folder
    run_id = start_detached({**env, FAULT_ENV: hold}, preset)
    follower = subprocess.Popen(
        [str(EXE), "attach", run_id, "--json"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert follower.stdout is not None
    kinds = []
    for line in follower.stdout:  # attach receives the run's events as they come
        kinds.append(json.loads(line)["type"])
        if kinds[-1] == "step":
            break
    assert "step" in kinds
    workers = held_workers(Path(env["HOMELAB_DP_RUNS"]) / run_id, 2)
    try:
        follower.kill()  # the follower dies; the run does not
        follower.wait()
        time.sleep(1.0)
        assert json.loads(cli(env, "status", run_id, "--json").stdout)["status"] == "running"

        stopping = subprocess.Popen([str(EXE), "stop", run_id], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
        _wait_until_pending(workers, signal.SIGTERM, stopping)
    finally:
        for pid in workers:  # let them go (also when the test failed: the run then ends itself)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    _, err = stopping.communicate(timeout=240)
    assert stopping.returncode == 0, err
    doc = json.loads(cli(env, "status", run_id, "--json").stdout)
    assert doc["status"] == "interrupted" and 2 <= doc["step"] < STOP_STEPS
    run_dir = Path(doc["path"])
    assert not alive_pids(read_state(run_dir))
    complete = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").is_file()]
    assert complete, "a graceful stop leaves a complete checkpoint"
    assert not (run_dir / "results.json").exists()  # an interrupted run is not recorded

    resumed = cli(env, "resume", run_id, "--json", timeout=400)
    assert resumed.returncode == 0, resumed.stderr
    events = [json.loads(line) for line in resumed.stdout.splitlines()]
    steps = [e["step"] for e in events if e["type"] == "step"]
    assert steps and steps[0] == doc["step"] + 1 and steps[-1] == STOP_STEPS
    final = json.loads(cli(env, "status", run_id, "--json").stdout)
    assert final["status"] == "completed" and final["attempt"] == 2
    assert [r["launches"] for r in read_results("p-12-64")] == [2]  # recorded once, completed

    again = cli(env, "resume", run_id)
    assert again.returncode == 2 and "already completed" in again.stderr


def _wait_until_pending(
    pids: list[int], sig: signal.Signals, sender: subprocess.Popen, timeout: float = 60
) -> None:
    """Until ``sig`` is pending on every (stopped) process: sent, to be taken once continued.

    ``timeout`` is a liveness guard: `stop` sends it within a few seconds of starting."""
    bit = 1 << (sig - 1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert sender.poll() is None, sender.communicate()
        if all(_pending(pid) & bit for pid in pids):
            return
        time.sleep(0.05)
    raise AssertionError(f"{sig.name} not pending on {pids} within {timeout} s")


def _pending(pid: int) -> int:
    """The signals pending on a process (Linux: /proc/PID/status, thread and shared sets)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def test_two_nodes_over_loopback_match_one_node(
    env: dict[str, str], tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    data = data_dir / "ragged-64.jsonl"
    # Checkpoints every step: the node without rank 0 writes its shards too and must not fail.
    preset = write_preset(
        tmp_path, "p-5-64", tiny_model, data, seq_len=64, pack=True, max_steps=5, checkpoint_every=1
    )
    # One thread a process in both set-ups: the CPU's per-sample attention kernel
    # (homelab_packed) sums its backward in an order that depends on the thread count, so 1 and
    # 2 threads a process agree to rounding only (sdpa's did bit for bit).
    env = {**env, "OMP_NUM_THREADS": "1"}
    one = start_detached(env, preset, "--force")  # three runs share the CPU host on purpose
    port = _free_port()
    nodes = [
        subprocess.Popen(
            [
                str(EXE),
                "run",
                str(preset),
                "--json",
                "--force",
                "--gpus",
                "cpu:1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1] for o in outs]
    # c10d assigns global ranks in joining order: rank 0's folder has the events and result.
    events = [json.loads(line) for out, _ in outs for line in out.splitlines()]
    start = next(e for e in events if e["type"] == "start")
    assert start["world_size"] == 2
    runs = Path(env["HOMELAB_DP_RUNS"])
    two_node_ids = {e["run_id"] for e in events if e.get("run_id")}
    assert len(two_node_ids) == 2
    holder = [r for r in two_node_ids if (runs / r / "final" / "model.safetensors").is_file()]
    assert len(holder) == 1
    (other,) = two_node_ids - set(holder)
    ends = [e for e in events if e["type"] == "end"]
    assert ends and all(e["reason"] == "completed" for e in ends)
    assert len(start["pids"]) == 2
    # Rank 0 alone writes the training events; the other node's controller records its state.
    theirs = [json.loads(line) for line in (runs / other / "events.jsonl").read_text().splitlines()]
    assert {e["type"] for e in theirs} == {"state"}
    assert theirs[-1]["status"] == "completed" and "another node" in theirs[-1]["reason"]
    single = wait_status(env, one, {"completed", "failed"})
    assert single["status"] == "completed"
    a = load_file(str(runs / one / "final" / "model.safetensors"))
    b = load_file(str(runs / holder[0] / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stop_and_attach_of_unknown_runs(env: dict[str, str]) -> None:
    for cmd in ("stop", "attach", "status", "resume"):
        out = cli(env, cmd, "no-such-run")
        assert out.returncode == 2 and "no such run" in out.stderr and "hint:" in out.stderr
