"""What the keeper does once a run has ended: benchmarks of a completed run
(``train.bench_tasks``, through `homelab-dp bench` in a child process), then the user's
notification command (``--notify CMD``, else ``notify.command`` in ``<data home>/config.toml``).

The command is the user's own, run by the shell exactly as they typed it; nothing of the run is
ever put into it. What the run says (id, state, a one-line summary, its folder) reaches it only
through its environment (``HOMELAB_DP_RUN_ID``, ``HOMELAB_DP_RUN_STATE``,
``HOMELAB_DP_RUN_SUMMARY``, ``HOMELAB_DP_RUN_DIR``) and its stdin (the summary line). A notifier
or a benchmark that fails is written to the keeper's log and never changes the run's state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomllib

from homelab_dp.runs.folder.run_index import data_home

CONFIG_NAME = "config.toml"
"""The user's config file in the per-user data folder (``[notify] command = "..."``)."""
DESKTOP = "desktop"
"""``--notify desktop``: notify-send, where it is installed."""
NOTIFY_TIMEOUT_S = 60.0
"""A notifier that takes longer is killed (the keeper must exit)."""
BENCH_TIMEOUT_S = 6 * 3600.0
"""A benchmark at the end of a run gets hours; more is a hang."""


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
    """The notifier's environment: this process's, plus the run's id, state, summary and folder."""
    return {
        **os.environ,
        "HOMELAB_DP_RUN_ID": run_dir.name,
        "HOMELAB_DP_RUN_STATE": status,
        "HOMELAB_DP_RUN_SUMMARY": summary,
        "HOMELAB_DP_RUN_DIR": str(run_dir),
    }


def notify(command: str, run_dir: Path, status: str, summary: str) -> bool:
    """Run the user's notification command once; True when it exited 0. Never raises for the
    command's own failure (it is logged)."""
    env = notify_env(run_dir, status, summary)
    if command == DESKTOP:
        exe = shutil.which("notify-send")
        if exe is None:
            log("--notify desktop: notify-send is not installed; no notification")
            return False
        argv: list[str] | str = [exe, f"homelab-dp: run {status}", summary]
    else:
        argv = command  # the user's command as typed; run data only in env and stdin
    try:
        done = subprocess.run(
            argv,
            shell=isinstance(argv, str),
            input=summary + "\n",
            env=env,
            text=True,
            capture_output=True,
            timeout=NOTIFY_TIMEOUT_S,
            check=False,
            start_new_session=True,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"the notifier failed: {exc}")
        return False
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip()[-500:]
        log(f"the notifier exited {done.returncode}: {tail}")
        return False
    log(f"notified ({status})")
    return True


def run_bench(run_dir: Path, tasks: list[str]) -> bool:
    """`homelab-dp bench RUN --tasks ... --json` in a child process (the CLI's own command, not
    an import: it loads lm_eval and torch); its output goes to the keeper's log. True when it
    exited 0; a failing benchmark is logged and the run stays completed."""
    argv = [sys.executable, "-m", "homelab_dp.cli", "bench", str(run_dir), "--tasks",
            ",".join(tasks), "--json"]  # fmt: skip
    log(f"benchmarks: {' '.join(argv[3:])}")
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=BENCH_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"the benchmarks failed: {exc}")
        return False
    if done.returncode != 0:
        log(f"the benchmarks exited {done.returncode}: {(done.stderr or '').strip()[-1500:]}")
        return False
    return True
