"""Fault injection into real runs (torchrun, gloo, 2 CPU processes), one test per fault.

The promise under test: a run never hangs, a crash loses at most the steps since the last
checkpoint, resume is exact (bitwise equal to an uninterrupted run), and nothing of a run is
left running. Every test ends by checking that no process recorded in state.json is alive.

Faults come from outside (signals sent by the test) or from ``HOMELAB_DP_FAULT``
(`homelab_dp.train.loop.rank_guard`), which fires once per run folder at an exact step — "mid-step" means
at the start of a micro-step, after the step's first all-reduce. Each test measures how long
the outcome took and records it (`record`): printed, and appended as a JSON line to
``$HOMELAB_DP_RELIABILITY_LOG`` when set — docs/RELIABILITY.md's table comes from that log.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from homelab_dp.app.runs import RunController, make_controller
from homelab_dp.runs.folder.heartbeats import read_heartbeats
from homelab_dp.runs.folder.jsonl_tail import JsonlTail
from homelab_dp.runs.folder.run_state import ACTIVE, alive_pids, current_state, read_state
from homelab_dp.runs.run_spec import Rendezvous
from homelab_dp.train.loop.checkpoints import check_checkpoint, find_usable
from homelab_dp.train.loop.rank_guard import FAULT_ENV
from tests.conftest import default_sigint, write_preset
from tests.integration.conftest import bitwise_equal, copy_run, events, final_weights
from tests.integration.test_controller import EXE, cli

pytestmark = pytest.mark.slow
STEPS = 8  # checkpoints at 2, 4, 6 (and the end); the reference run is uninterrupted
WATCHDOG_S = 4
RESULTS = os.environ.get("HOMELAB_DP_RELIABILITY_LOG")
END_LIVENESS_S = 90
"""Liveness guard on how soon a run ends after a fault (for a hang: beyond the watchdog's limit).
It must end, not hang; how soon is a figure, not a pass mark: typically 1-7 s (this file's
RELIABILITY lines, README's fault table; `python benchmarks/run_e2e.py`, its fault rows), 3.1 s
for a killed rank and 5.2 s for out of memory on a 2-core machine at a load average of 3-5.
(30 s bounds used to stand here.)"""


def record(fault: str, outcome: str, seconds: float, **extra: Any) -> None:
    """Print (and log) a measured outcome for the RELIABILITY table."""
    row = {"fault": fault, "outcome": outcome, "seconds": round(seconds, 2), **extra}
    print(f"\nRELIABILITY {json.dumps(row)}")
    if RESULTS:
        with open(RESULTS, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")


def fault_preset(folder: Path, name: str, model: Path, data: Path, **train: Any) -> Path:
    """The shared small preset (2 CPU processes: micro 2 × world 2 × accumulation 2), a
    checkpoint every 2 steps, short watchdog and timeouts."""
    train = {"max_steps": STEPS, "checkpoint_every": 2, "watchdog_s": 60,
             "collective_timeout_s": 30, **train}  # fmt: skip
    return write_preset(folder, name, model, data, **train)


@contextlib.contextmanager
def fault(spec: str | None) -> Iterator[None]:
    """``HOMELAB_DP_FAULT`` for the processes started inside the block (inherited at spawn)."""
    old = os.environ.pop(FAULT_ENV, None)
    if spec:
        os.environ[FAULT_ENV] = spec
    try:
        yield
    finally:
        os.environ.pop(FAULT_ENV, None)
        if old is not None:
            os.environ[FAULT_ENV] = old


def start(c: RunController, preset: Path, spec: str | None = None, **kw: Any) -> str:
    with fault(spec):
        return c.start(c.prepare(str(preset), force=kw.get("force", False)), **kw)


def wait_done(c: RunController, run_id: str, timeout: float = 240) -> dict[str, Any]:
    """Poll the state (cheap: the test shares 2 cores with the run) until the run has ended.

    ``timeout`` is a liveness guard: a run or resume of this preset takes 15-25 s on 2 loaded
    cores (`python benchmarks/run_e2e.py`, its whole-run row; README's fault table)."""
    run_dir = c.run_dir(run_id)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if current_state(run_dir).get("status") not in ACTIVE:
            return c.status(run_id)
        time.sleep(0.2)
    raise AssertionError(f"{run_id} still {read_state(run_dir)['status']} after {timeout} s")


def wait_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    """Until step ``step`` has an event. ``timeout`` is a liveness guard: a run's first step comes
    8-18 s after its start on 2 cores (`python benchmarks/run_e2e.py`, its first-step row)."""
    tail = JsonlTail(run_dir / "events.jsonl")  # reads only what is new
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(e.get("type") == "step" and e["step"] >= step for e in tail.read()):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s: {read_state(run_dir)}")


def fired_at(run_dir: Path, kind: str, rank: int, step: int) -> float:
    """When an injected fault fired (its one-shot marker is written just before)."""
    return (run_dir / "logs" / f"fault-{kind}-rank{rank}-step{step}").stat().st_mtime


def nothing_alive(run_dir: Path, workers: bool = True) -> None:
    """No recorded process is alive (the keeper gets a moment to exit after its verdict)."""
    state = read_state(run_dir)
    assert not workers or state["pids"].get("workers"), "the workers were recorded"
    deadline = time.time() + 5  # liveness guard: all gone 0.02-0.14 s after the final state
    while alive_pids(state) and time.time() < deadline:  # (`benchmarks/run_e2e.py`, last column)
        time.sleep(0.1)
    roles = {pid: role for role, pid in state["pids"].items() if isinstance(pid, int)}
    left = {pid: roles.get(pid, "worker") for pid in alive_pids(state)}
    assert not left, f"left running: {left}"


def attempt_events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """Events of the latest launch (after the last controller/keeper "starting" state)."""
    all_events = events(run_dir)
    starts = [i for i, e in enumerate(all_events) if e.get("status") == "starting"]
    return [e for e in all_events[starts[-1] if starts else 0 :] if e["type"] == kind]


# ---------------------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def controller(folder: Path) -> RunController:
    return make_controller(folder / "runs")


@pytest.fixture(scope="module")
def data(data_dir: Path) -> Path:
    return data_dir / "ragged-64.jsonl"


@pytest.fixture(scope="module")
def twins(controller: RunController, folder: Path, tiny_model: Path, data: Path) -> dict:
    """Two uninterrupted runs of one preset started at once, with every socket they listened on.

    They are the reference every resumed run must match bit for bit (test 8 checks that the
    two did not collide).
    """
    preset = fault_preset(folder, "reference", tiny_model, data)
    t = time.time()
    runs = [start(controller, preset, force=True), start(controller, preset, force=True)]
    dirs = [controller.run_dir(r) for r in runs]
    sockets: list[set[tuple[str, int]]] = [set(), set()]
    while any(current_state(d).get("status") in ACTIVE for d in dirs):  # sample while they run
        for d, seen in zip(dirs, sockets, strict=True):
            pids = read_state(d)["pids"]
            seen.update(_listening([*(pids.get("workers") or []), pids.get("agent") or 0]))
        time.sleep(0.1)
    docs = [wait_done(controller, r) for r in runs]
    return {"docs": docs, "dirs": dirs, "sockets": sockets, "seconds": time.time() - t}


@pytest.fixture(scope="module")
def reference(twins: dict) -> dict:
    """The final weights of an uninterrupted run."""
    assert twins["docs"][0]["status"] == "completed", twins["docs"][0]["reason"]
    return final_weights(twins["dirs"][0])


@pytest.fixture(scope="module")
def killed(controller: RunController, folder: Path, tiny_model: Path, data: Path) -> dict:
    """A run whose rank 1 was SIGKILLed mid-step 5, and an untouched copy of its folder."""
    preset = fault_preset(folder, "killed", tiny_model, data)
    run_id = start(controller, preset, "sigkill:rank=1:step=5")
    doc = wait_done(controller, run_id)
    run_dir = Path(doc["path"])
    pristine = copy_run(run_dir, folder / "pristine", "killed-copy")
    return {"doc": doc, "dir": run_dir, "pristine": pristine}


# ---------------------------------------------------------------------------- the faults


def test_1_sigkill_one_rank_mid_step(controller, killed, reference) -> None:
    doc, run_dir = killed["doc"], killed["dir"]
    took = read_state(run_dir)["ended"] - fired_at(run_dir, "sigkill", 1, 5)
    assert doc["status"] == "failed"
    assert "rank 1" in doc["reason"] and "SIGKILL" in doc["reason"], doc["reason"]
    assert took < END_LIVENESS_S, f"the run took {took:.1f} s to end"  # liveness guard
    shown = cli({**os.environ, "HOMELAB_DP_RUNS": str(controller.root)}, "status", doc["run_id"])
    assert "failed — rank 1" in shown.stdout and "SIGKILL" in shown.stdout, shown.stdout
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step-*"))] == [
        "step-2",
        "step-4",
    ]
    assert check_checkpoint(run_dir / "checkpoints" / "step-4") is None  # the last one, intact
    nothing_alive(run_dir)
    record("SIGKILL one rank mid-step", f"failed: {doc['reason']}", took)

    t = time.time()
    controller.resume(doc["run_id"])
    resumed = wait_done(controller, doc["run_id"])
    assert resumed["status"] == "completed", resumed["reason"]
    start_event = attempt_events(run_dir, "start")[-1]
    assert start_event["start_step"] == 4 and start_event["resumed_from"].endswith("step-4")
    assert bitwise_equal(final_weights(run_dir), reference), "resume is exact"
    nothing_alive(run_dir)
    record("… resume after it", "completed from step-4, weights bitwise equal", time.time() - t)


def test_2_sigstop_one_rank_the_watchdog_ends_the_run(controller, folder, tiny_model, data) -> None:
    preset = fault_preset(folder, "stall", tiny_model, data, watchdog_s=WATCHDOG_S)
    run_id = start(controller, preset, "sigstop:rank=1:step=3")
    doc = wait_done(controller, run_id)
    run_dir = Path(doc["path"])
    took = read_state(run_dir)["ended"] - fired_at(run_dir, "sigstop", 1, 3)
    assert doc["status"] == "failed"
    assert doc["reason"].startswith("stalled: rank 1 ") and "state T" in doc["reason"]
    failure = read_state(run_dir)["failure"]
    assert failure["kind"] == "stall" and failure["rank"] == 1 and failure["step"] == 3
    # below: the watchdog waits its limit (a real bound); above: a liveness guard
    assert WATCHDOG_S <= took < WATCHDOG_S + END_LIVENESS_S, f"{took:.1f} s"
    nothing_alive(run_dir)  # the stopped rank was killed too (SIGTERM cannot reach it)
    record("SIGSTOP one rank (hang)", f"failed: {doc['reason'].split(';')[0]}", took,
           watchdog_s=WATCHDOG_S)  # fmt: skip


def test_3_signals_to_the_follower_and_to_the_agent(controller, folder, tiny_model, data) -> None:
    preset = fault_preset(
        folder, "signals", tiny_model, data, max_steps=100_000, log_every=5, grad_accum=1
    )
    env = {**os.environ, "HOMELAB_DP_RUNS": str(controller.root)}
    follower = subprocess.Popen([str(EXE), "run", str(preset)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert follower.stdout is not None
    first = follower.stdout.readline()
    if not first.startswith("started "):
        follower.kill()
        raise AssertionError(f"`run` did not start: {first!r} {follower.communicate()[1]}")
    run_id = first.split()[1]
    lines = []
    for line in follower.stdout:  # plain mode: one line per logged step
        lines.append(line)
        if re.search(r" step \d+/\d+ ", line):
            break
    follower.send_signal(signal.SIGTERM)
    follower.communicate(timeout=30)
    run_dir = controller.run_dir(run_id)
    assert events(run_dir, "step"), (lines, (run_dir / "events.jsonl").read_text()[-3000:])
    step = events(run_dir, "step")[-1]["step"]
    wait_step(run_dir, step + 5)  # unaffected: it goes on
    attached = subprocess.Popen([str(EXE), "attach", run_id], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_sigint)  # fmt: skip
    assert attached.stdout is not None
    for line in attached.stdout:
        if re.search(r" step \d+/\d+ ", line):
            break
    attached.send_signal(signal.SIGINT)  # Ctrl-C only detaches (the CLI contract)
    _, err = attached.communicate(timeout=30)
    assert attached.returncode == 130 and f"homelab-dp attach {run_id}" in err
    step = events(run_dir, "step")[-1]["step"]
    wait_step(run_dir, step + 5)
    assert controller.status(run_id)["status"] == "running"

    t = time.time()
    stopped = cli(env, "stop", run_id)
    took_stop = time.time() - t
    assert stopped.returncode == 0, stopped.stderr
    doc = controller.status(run_id)
    end = events(run_dir, "end")[-1]
    assert doc["status"] == "interrupted" and end["reason"] == "stopped"
    assert check_checkpoint(run_dir / "checkpoints" / f"step-{end['steps']}") is None
    nothing_alive(run_dir)
    record("SIGTERM, then SIGINT, to the following CLI; then `stop`",
           "run unaffected by both; `stop`: interrupted, checkpoint at the stop step", took_stop)  # fmt: skip

    controller.resume(run_id)
    wait_step(run_dir, end["steps"] + 5)
    agent = read_state(run_dir)["pids"]["agent"]
    t = time.time()
    os.kill(agent, signal.SIGTERM)
    doc = wait_done(controller, run_id)
    took = read_state(run_dir)["ended"] - t
    end2 = events(run_dir, "end")[-1]
    assert doc["status"] == "interrupted", doc["reason"]
    assert doc["reason"].startswith("the torchrun agent received SIGTERM: stopped at step")
    assert end2["reason"] == "stopped" and end2["steps"] > end["steps"]
    assert check_checkpoint(run_dir / "checkpoints" / f"step-{end2['steps']}") is None
    nothing_alive(run_dir)
    record("SIGTERM to the torchrun agent", f"interrupted: {doc['reason'].split(';')[0]}", took)


def test_4_sigkill_the_agent_leaves_no_orphans(controller, folder, tiny_model, data) -> None:
    preset = fault_preset(
        folder, "agent", tiny_model, data, max_steps=100_000, log_every=5, grad_accum=1
    )
    run_id = start(controller, preset)
    run_dir = controller.run_dir(run_id)
    wait_step(run_dir, 5)
    workers = read_state(run_dir)["pids"]["workers"]
    assert len(workers) == 2
    t = time.time()
    os.kill(read_state(run_dir)["pids"]["agent"], signal.SIGKILL)
    doc = wait_done(controller, run_id)
    took = read_state(run_dir)["ended"] - t
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers
    ), "orphaned workers run on"
    assert doc["status"] == "failed"
    assert doc["reason"].startswith("the torchrun agent was killed by SIGKILL; the keeper stopped")
    end = events(run_dir, "end")[-1]
    assert end["reason"] == "stopped"  # the orphans stopped gracefully, with a checkpoint
    assert check_checkpoint(run_dir / "checkpoints" / f"step-{end['steps']}") is None
    assert read_state(run_dir)["failure"]["kind"] == "agent"
    nothing_alive(run_dir)
    record("SIGKILL the torchrun agent", f"failed: {doc['reason'].split(';')[0]}; workers "
           f"stopped with a checkpoint at step {end['steps']}", took)  # fmt: skip


def test_5_killed_during_a_checkpoint_write(controller, folder, tiny_model, data, reference):
    preset = fault_preset(folder, "torn", tiny_model, data)
    run_id = start(controller, preset, "kill-after-shard:rank=1:step=4")
    doc = wait_done(controller, run_id)
    run_dir = Path(doc["path"])
    took = read_state(run_dir)["ended"] - fired_at(run_dir, "kill-after-shard", 1, 4)
    assert doc["status"] == "failed" and "rank 1" in doc["reason"] and "SIGKILL" in doc["reason"]
    torn = run_dir / "checkpoints" / ".tmp-step-4"
    assert list(torn.glob("*.safetensors")) and not (torn / "COMPLETE").exists()
    assert find_usable(run_dir / "checkpoints") == (run_dir / "checkpoints" / "step-2", [])
    nothing_alive(run_dir)
    record("killed during a checkpoint write (after its shard)",
           "failed; the torn step-4 is never a candidate", took)  # fmt: skip

    t = time.time()
    controller.resume(run_id)
    resumed = wait_done(controller, run_id)
    assert resumed["status"] == "completed", resumed["reason"]
    start_event = attempt_events(run_dir, "start")[-1]
    assert start_event["start_step"] == 2 and start_event["resumed_from"].endswith("step-2")
    assert not torn.exists()  # cleared by the next checkpoint write
    assert bitwise_equal(final_weights(run_dir), reference)
    nothing_alive(run_dir)
    record("… resume after it", "completed from step-2, weights bitwise equal", time.time() - t)


def _strip_dcp_metadata(shard: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_file(load_file(shard), shard, metadata={"format": "pt"})


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (Path.touch, (self.marker,))


def test_6_corrupted_checkpoints_fall_back(controller, folder, killed, reference) -> None:
    # The killed run has step-2 and step-4; damage step-4 in four ways.
    damaged = {}
    for how in ("truncated", "no-dcp-metadata", "no-trainer-json", "pickle"):
        run_dir = copy_run(killed["pristine"], controller.root, f"corrupt-{how}")
        step4 = run_dir / "checkpoints" / "step-4"
        shard = max(step4.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        if how == "truncated":
            os.truncate(shard, shard.stat().st_size // 2)
        elif how == "no-dcp-metadata":
            _strip_dcp_metadata(shard)
        elif how == "no-trainer-json":
            (step4 / "trainer.json").unlink()
        else:
            import pickle

            (step4 / "__0_0.distcp").write_bytes(pickle.dumps(_Payload(folder / "pwned")))
        path, skipped = find_usable(run_dir / "checkpoints")
        assert path == run_dir / "checkpoints" / "step-2"
        damaged[how] = (run_dir, skipped[0])
    assert str(damaged["truncated"][0]) in damaged["truncated"][1]
    assert "truncated" in damaged["truncated"][1] and ".safetensors" in damaged["truncated"][1]
    assert "missing its checkpoint metadata" in damaged["no-dcp-metadata"][1]
    assert "step-4/trainer.json: missing" in damaged["no-trainer-json"][1]
    assert "__0_0.distcp: a pickle file in a checkpoint; refused" in damaged["pickle"][1]
    assert not (folder / "pwned").exists()  # never unpickled

    run_dir = damaged["truncated"][0]
    t = time.time()
    controller.resume(run_dir.name)
    doc = wait_done(controller, run_dir.name)
    assert doc["status"] == "completed", doc["reason"]
    warning = attempt_events(run_dir, "warning")[0]["message"]
    assert "step-4/shard-" in warning and "truncated" in warning
    assert warning.endswith("resuming from step-2")
    assert attempt_events(run_dir, "start")[-1]["resumed_from"].endswith("step-2")
    assert bitwise_equal(final_weights(run_dir), reference)
    assert not (folder / "pwned").exists()
    nothing_alive(run_dir)
    record("corrupted checkpoint (truncated shard; also: no DCP metadata, no trainer.json, "
           "a pickle file)", f"warning names the file; resumed from step-2, exact: {warning}",
           time.time() - t)  # fmt: skip


def test_7_disk_full_while_writing_a_checkpoint(controller, folder, tiny_model, data) -> None:
    preset = fault_preset(folder, "full", tiny_model, data)
    run_id = start(controller, preset, "enospc:rank=1:step=4")
    doc = wait_done(controller, run_id)
    run_dir = Path(doc["path"])
    took = read_state(run_dir)["ended"] - fired_at(run_dir, "enospc", 1, 4)
    assert doc["status"] == "failed"
    assert doc["reason"].startswith("checkpoint step-4: no space left on device writing")
    assert "the previous checkpoint step-2 is kept" in doc["reason"]
    assert "free space" in read_state(run_dir)["failure"]["hint"]
    checkpoints = run_dir / "checkpoints"
    assert check_checkpoint(checkpoints / "step-2") is None
    assert not (checkpoints / ".tmp-step-4").exists()  # the partial write is removed
    nothing_alive(run_dir)
    record("disk full (ENOSPC) writing a checkpoint", f"failed: {doc['reason']}", took)


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """The (host, port) of every listening TCP socket of these processes."""
    out = []
    for pid in filter(None, pids):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            out += [c.laddr[:2] for c in psutil.Process(pid).net_connections("inet")
                    if c.status == psutil.CONN_LISTEN]  # fmt: skip
    return out


def test_8_rendezvous_port_taken_and_two_runs_at_once(
    controller, folder, tiny_model, data, twins
) -> None:
    preset = fault_preset(folder, "ports", tiny_model, data, max_steps=4)
    env = {**os.environ, "HOMELAB_DP_RUNS": str(controller.root)}
    before = set(controller.root.iterdir())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t = time.time()
        out = cli(env, "run", str(preset), "--master-port", str(port), "--detach")
        took_cli = time.time() - t
        assert out.returncode == 2, out.stderr
        assert f"error: --master-port {port}: 127.0.0.1:{port} is already in use" in out.stderr
        assert "hint: leave out --master-port" in out.stderr
        assert set(controller.root.iterdir()) == before  # nothing started
    record("rendezvous port taken (--master-port)", "exit 2 before anything starts", took_cli)

    # Taken between the check and torchrun's bind: the run fails fast, with the reason.
    with socket.socket() as racer:
        racer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = _free_port()
        t = time.time()
        run_id = start(controller, preset, rendezvous=Rendezvous(master_port=port))
        racer.bind(("127.0.0.1", port))
        racer.listen()
        doc = wait_done(controller, run_id, timeout=60)
        took_race = time.time() - t
    assert doc["status"] == "failed"
    assert doc["reason"] == f"127.0.0.1:{port} is already in use: the rendezvous could not start"
    nothing_alive(Path(doc["path"]), workers=False)  # none started
    record(
        "rendezvous port taken by another process at launch", f"failed: {doc['reason']}", took_race
    )

    docs, dirs, sockets = twins["docs"], twins["dirs"], twins["sockets"]
    for doc, listening in zip(docs, sockets, strict=True):
        assert doc["status"] == "completed", doc["reason"]
        assert listening and {host for host, _ in listening} == {"127.0.0.1"}, listening
    assert not {p for _, p in sockets[0]} & {p for _, p in sockets[1]}
    assert bitwise_equal(final_weights(dirs[0]), final_weights(dirs[1]))  # no interference
    for d in dirs:
        nothing_alive(d)
    record("two runs started at once", "both completed, bitwise equal; every listening socket "
           "on 127.0.0.1, no port shared", twins["seconds"],
           listening=[len(s) for s in sockets])  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_9_out_of_memory_on_one_rank_and_auto_fit(controller, folder, tiny_model, data) -> None:
    preset = fault_preset(folder, "oom", tiny_model, data, max_steps=6)
    env = {**os.environ, "HOMELAB_DP_RUNS": str(controller.root), FAULT_ENV: "oom:rank=1:step=3"}
    t = time.time()
    out = subprocess.run([str(EXE), "run", str(preset), "--auto-fit", "--json"], env=env,
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    took_total = time.time() - t
    assert out.returncode == 0, out.stderr
    seen = [json.loads(line) for line in out.stdout.splitlines()]
    first, second = [e for e in seen if e["type"] == "start"]
    error = next(e for e in seen if e.get("kind") == "OutOfMemoryError")
    retry = next(e for e in seen if e["type"] == "retry")
    assert error["kind"] == "OutOfMemoryError" and error["rank"] == 1
    proposal = error["proposal"]
    assert proposal["micro_batch"] < first["micro_batch"]
    assert proposal["micro_batch"] * 2 * proposal["grad_accum"] == first["effective_batch"]
    assert "same effective batch" in error["hint"] and "activation_checkpointing" in error["hint"]
    assert (second["micro_batch"], second["grad_accum"]) == (
        proposal["micro_batch"], proposal["grad_accum"])  # fmt: skip
    assert second["effective_batch"] == first["effective_batch"] and second["start_step"] == 2
    assert seen[-1]["type"] in ("end", "state") and controller.status(first["run_id"])[
        "status"] == "completed"  # fmt: skip
    run_dir = controller.run_dir(first["run_id"])
    stopped = retry["time"] - fired_at(run_dir, "oom", 1, 3)  # both ranks down, verdict made
    assert stopped < END_LIVENESS_S, f"{stopped:.1f} s"  # liveness guard
    nothing_alive(run_dir)
    record("out of memory on one rank", f"every rank stopped; proposal: micro-batch "
           f"{proposal['micro_batch']} × accumulation {proposal['grad_accum']} (same effective "
           f"batch {first['effective_batch']})", stopped)  # fmt: skip
    record("… `run --auto-fit`", "retried with the proposal by itself from step-2: completed",
           took_total)  # fmt: skip


def test_10_a_result_save_longer_than_the_watchdog_and_the_collective_timeout(
    controller, folder, tiny_model, data
) -> None:
    """Rank 0 spends 20 s writing the result (``slow-result``: a sleep inside the work, as a
    large save or an adapter merge on the CPU would), beyond ``train.watchdog_s`` (6) and
    ``train.collective_timeout_s`` (12): the run still completes. Rank 0 beats ``saving-result``
    on a timer, rank 1 ``waiting``, and neither waits in a collective for more than a second."""
    watchdog_s, timeout_s, slow_s, steps = 6, 12, 20, 4
    preset = fault_preset(folder, "slow-result", tiny_model, data, max_steps=steps,
                          watchdog_s=watchdog_s, collective_timeout_s=timeout_s)  # fmt: skip
    run_id = start(controller, preset, f"slow-result:rank=0:step={steps}:seconds={slow_s}")
    run_dir = controller.run_dir(run_id)
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    deadline = time.time() + 240  # liveness guard: this run takes 40-50 s with its 20 s save
    while current_state(run_dir).get("status") in ACTIVE and time.time() < deadline:
        for rank, beat in read_heartbeats(run_dir).items():
            seen[rank].add(beat["phase"])
        time.sleep(0.2)
    doc = wait_done(controller, run_id)
    assert doc["status"] == "completed", doc["reason"]
    took = read_state(run_dir)["ended"] - fired_at(run_dir, "slow-result", 0, steps)
    assert took >= slow_s, f"{took:.1f} s: the slow save did not run"
    assert events(run_dir, "end")[-1]["reason"] == "completed"
    assert (run_dir / "final" / "config.json").is_file()
    assert "saving-result" in seen[0] and "waiting" in seen[1], seen
    assert not events(run_dir, "error"), events(run_dir, "error")
    nothing_alive(run_dir)
    record("rank 0 saves the result for 20 s (watchdog 6 s, collective timeout 12 s)",
           f"completed; phases seen {sorted(seen[0])} / {sorted(seen[1])}", took)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _cleanup(folder: Path) -> Iterator[None]:
    yield
    shutil.rmtree(folder, ignore_errors=True)
