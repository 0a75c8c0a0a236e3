"""What the keeper does once a run has ended: benchmarks of a completed run
(``train.bench_tasks``, through `homelab-dp bench` in a child process), then the user's
notification command (``--notify CMD``, else ``notify.command`` in ``<data home>/config.toml``).

The command is the user's own, run by the shell exactly as they typed it; nothing of the run is
ever put into it. What the run says (id, state, a one-line summary, its folder) reaches it only
through its environment (``HOMELAB_DP_RUN_ID``, ``HOMELAB_DP_RUN_STATE``,
``HOMELAB_DP_RUN_SUMMARY``, ``HOMELAB_DP_RUN_DIR``) and its stdin (the summary line). A notifier
or a benchmark that fails is written to the keeper's log and never changes the run's state.

Both children are bounded (`run_bounded`): their output is read as it comes and only its last
`OUTPUT_TAIL_BYTES` kept (a command printing hundreds of MB never grows the keeper); each runs in
its own process group, killed whole when it outlives its timeout (a child it put in the
background dies with it); the keeper stops reading once the command itself has exited, so a
child left in the background never holds it. What the run says is cleaned before it reaches
the environment (`clean_text`: no NUL, no line breaks, no unencodable characters, bounded).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import tomllib

from homelab_dp.user_files.paths import data_home

CONFIG_NAME = "config.toml"
"""The user's config file in the per-user data folder (``[notify] command = "..."``)."""
DESKTOP = "desktop"
"""``--notify desktop``: notify-send, where it is installed."""
NOTIFY_TIMEOUT_S = 60.0
"""A notifier that takes longer is killed (the keeper must exit)."""
BENCH_TIMEOUT_S = 6 * 3600.0
"""A benchmark at the end of a run gets hours; more is a hang."""
OUTPUT_TAIL_BYTES = 4096
"""The most of a child's output the keeper keeps (the end of it, for its log)."""
DRAIN_S = 0.5
"""Once the command has exited, how long output still in the pipe is read (a child it left
in the background may hold the pipe open: it is not waited for)."""
KILL_GRACE_S = 5.0
"""At a timeout: seconds between SIGTERM and SIGKILL to the child's process group."""
BENCH_GRACE_S = 60.0
"""The benchmarks' grace: `homelab-dp bench` stops its torchrun workers (in sessions of their
own) on SIGTERM."""
TEXT_LIMIT = 2000
"""The most characters of one value of the run put in the notifier's environment."""


def config_path() -> Path:
    """``<data home>/config.toml`` (``$XDG_DATA_HOME/homelab-dp/config.toml``)."""
    return data_home() / CONFIG_NAME


def configured_command() -> str | None:
    """``notify.command`` of the user's config file; None when there is no file or no such key.
    A file that cannot be read is logged and treated as no command (the run is over anyway)."""
    path = config_path()
    if not path.is_file():
        return None
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        log(f"{path}: not read ({exc}); no notification from the config file")
        return None
    command = (
        (doc.get("notify") or {}).get("command") if isinstance(doc.get("notify"), dict) else None
    )
    return command if isinstance(command, str) and command.strip() else None


def log(message: str) -> None:
    """One line in the keeper's log (its stderr is ``logs/keeper.log``)."""
    print(f"keeper: {message}", file=sys.stderr, flush=True)


def clean_text(text: str, limit: int = TEXT_LIMIT) -> str:
    """``text`` as one environment value: NUL and other control characters and line breaks as
    spaces, characters UTF-8 cannot encode (lone surrogates) replaced, at most ``limit``
    characters (a preset's string reaches the summary through the run's reason)."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Bounded:
    """What `run_bounded` saw: the exit code (None: killed at its timeout) and the last
    `OUTPUT_TAIL_BYTES` of the output, with how many bytes there were in all."""

    def __init__(self, returncode: int | None, tail: bytes, total: int) -> None:
        self.returncode = returncode
        self.tail = tail
        self.total = total

    @property
    def text(self) -> str:
        """The tail as text (undecodable bytes replaced, NULs dropped)."""
        return self.tail.decode("utf-8", "replace").replace("\0", "").strip()


def run_bounded(
    argv: list[str] | str,
    *,
    timeout: float,
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
    shell: bool = False,
    grace: float = KILL_GRACE_S,
) -> Bounded:
    """Run ``argv`` in a new session (its own process group), stdout and stderr read together
    as they come with only the last `OUTPUT_TAIL_BYTES` kept; at ``timeout`` the whole group
    gets SIGTERM, and SIGKILL ``grace`` seconds later (`_kill_group`). Returns once the command
    has exited (its output drained for at most `DRAIN_S`): a background child holding the pipe
    does not hold the caller. OSError and ValueError (a NUL in the command) are the caller's to
    catch."""
    proc = subprocess.Popen(
        argv,
        shell=shell,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    if proc.stdin is not None:
        # A small message: the pipe's buffer holds it; a command that never reads is fine.
        with contextlib.suppress(OSError):
            proc.stdin.write(stdin[:65536])
        with contextlib.suppress(OSError):
            proc.stdin.close()
    fd = proc.stdout.fileno()
    tail: deque[bytes] = deque()
    kept = total = 0
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    killed = False
    while True:
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > DRAIN_S:
            break
        if now >= deadline:
            _kill_group(proc, grace)
            killed = True
            break
        ready, _, _ = select.select([fd], [], [], min(0.1, deadline - now))
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # EOF: every holder of the pipe has closed it
            if proc.poll() is None:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill_group(proc, grace)
                    killed = True
            break
        total += len(chunk)
        tail.append(chunk)
        kept += len(chunk)
        while kept - len(tail[0]) >= OUTPUT_TAIL_BYTES:
            kept -= len(tail.popleft())
    proc.stdout.close()
    rc = None if killed else proc.wait()
    return Bounded(rc, b"".join(tail)[-OUTPUT_TAIL_BYTES:], total)


def _kill_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """End the child's whole process group (it leads its own session): SIGTERM, then once the
    child has exited or ``grace`` seconds have passed, SIGKILL to whatever of the group is
    left; then reap the child. The child is reaped last, so its pid (the group's id) cannot be
    reused by another process while the group is signalled."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                break  # exited (a zombie until reaped below)
        except ChildProcessError:
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def summary_line(run_id: str, state: dict[str, Any], figures: dict[str, Any]) -> str:
    """The one-line summary: "RUN completed: step 60/60, loss 1.2345, eval loss 1.4000, 42 s (why)"."""
    parts = [f"step {figures.get('step', 0)}/{figures.get('total_steps', 0)}"]
    if figures.get("loss") is not None:
        parts.append(f"loss {figures['loss']:.4f}")
    ev = figures.get("eval") or {}
    if ev.get("loss") is not None:
        parts.append(f"eval loss {ev['loss']:.4f}")
    if figures.get("duration_s") is not None:
        parts.append(f"{figures['duration_s']:.0f} s")
    reason = state.get("reason")
    why = f" ({reason})" if reason else ""
    return f"{run_id} {state.get('status')}: {', '.join(parts)}{why}".replace("\n", " ")


def notify_env(run_dir: Path, status: str, summary: str) -> dict[str, str]:
    """The notifier's environment: this process's, plus the run's id, state, summary and folder
    (each `clean_text`)."""
    return {
        **os.environ,
        "HOMELAB_DP_RUN_ID": clean_text(run_dir.name),
        "HOMELAB_DP_RUN_STATE": clean_text(status),
        "HOMELAB_DP_RUN_SUMMARY": clean_text(summary),
        "HOMELAB_DP_RUN_DIR": clean_text(str(run_dir), limit=4096),
    }


def notify(command: str, run_dir: Path, status: str, summary: str) -> bool:
    """Run the user's notification command once (`run_bounded`); True when it exited 0. Never
    raises for the command's own failure (it is logged)."""
    summary, status = clean_text(summary), clean_text(status)
    env = notify_env(run_dir, status, summary)
    if command == DESKTOP:
        exe = shutil.which("notify-send")
        if exe is None:
            log("--notify desktop: notify-send is not installed; no notification")
            return False
        argv: list[str] | str = [exe, f"homelab-dp: run {status}", summary]
    else:
        argv = command  # the user's command as typed; run data only in env and stdin
    ok = run_logged(argv, "the notifier", tail=500, shell=isinstance(argv, str),
                    stdin=(summary + "\n").encode(), env=env, timeout=NOTIFY_TIMEOUT_S)  # fmt: skip
    if ok:
        log(f"notified ({status})")
    return ok


def run_logged(argv: list[str] | str, what: str, *, tail: int, **bounded: Any) -> bool:
    """`run_bounded` (``bounded``: its keywords, ``timeout`` among them) with its failures
    logged under ``what`` ("the notifier"): not runnable (OSError; a NUL in the command itself),
    killed at the timeout (its whole process group), or a non-zero exit with the last ``tail``
    characters of its output. True when it exited 0; never raises for the command's failure."""
    try:
        done = run_bounded(argv, **bounded)
    except (OSError, ValueError) as exc:
        log(f"{what} failed: {clean_text(str(exc), 500)}")
        return False
    if done.returncode is None:
        log(f"{what} was killed after {bounded['timeout']:.0f} s (its whole process group)")
        return False
    if done.returncode != 0:
        log(f"{what} exited {done.returncode}: {done.text[-tail:]}")
        return False
    return True


def run_bench(run_dir: Path, tasks: list[str], *, trust_code: bool = False) -> bool:
    """`homelab-dp bench RUN --tasks ... --json` in a child process (the CLI's own command, not
    an import: it loads lm_eval and torch; ``trust_code``: the preset's
    ``train.bench_trust_code``, as ``--trust-task-code``), bounded as the notifier is
    (`run_bounded`); the end of its output goes to the keeper's log. True when it exited 0; a
    failing benchmark is logged and the run stays completed."""
    argv = [sys.executable, "-m", "homelab_dp.cli", "bench", str(run_dir), "--tasks",
            ",".join(tasks), "--json"] + ["--trust-task-code"] * trust_code  # fmt: skip
    log(f"benchmarks: {clean_text(' '.join(argv[3:]), 4096)}")
    return run_logged(argv, "the benchmark run", tail=1500, timeout=BENCH_TIMEOUT_S,
                      grace=BENCH_GRACE_S)  # fmt: skip
