"""The eval and serve rows of benchmarks/gpu_validate.py, on the tiny-demo run it just made.

``step_eval`` runs ``homelab-dp eval RUN --data assets/data/tiny-instruct.jsonl --json``;
``step_serve`` starts ``homelab-dp serve RUN --replicas 1 --port 0`` in its own process
session, sends it concurrent completions and one streamed chat completion over plain urllib,
stops it with SIGTERM and checks that no replica process is left. Standard library only: a
failure becomes a row, never an exception out of a step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the script is run as a file: no package to import it from at run time
    from gpu_validate import Report, Runner

ROOT = Path(__file__).resolve().parents[1]
EVAL_DATA = ROOT / "assets" / "data" / "tiny-instruct.jsonl"
CLI = "import sys; from homelab_dp.cli.main import main; sys.exit(main(sys.argv[1:]))"
SERVING = re.compile(r"^serving \S+ on (https?://\S+/v1) with ")
CONCURRENT = 8
READY_CAP_S = 120.0
STOP_CAP_S = 20.0


def run_id_of(events: list[dict[str, Any]]) -> str | None:
    """The run's id from its JSON events (the ``state`` event that starts it, or ``start``)."""
    return next((e["run_id"] for e in events if e.get("run_id")), None)


def serving_url(text: str) -> str | None:
    """The API's base URL (``http://HOST:PORT/v1``) from serve's ``serving ... on URL with ...``
    line in ``text``, or None before it was printed."""
    for line in text.splitlines():
        m = SERVING.match(line.strip())
        if m:
            return m.group(1)
    return None


def throughput(usages: list[dict[str, Any]], seconds: float) -> tuple[float, float]:
    """(requests/s, generated tokens/s) of ``usages`` (OpenAI usage objects) answered in
    ``seconds`` of wall time."""
    if seconds <= 0:
        return 0.0, 0.0
    generated = sum(int(u.get("completion_tokens") or 0) for u in usages)
    return len(usages) / seconds, generated / seconds


def pids_alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still processes (signal 0 finds them)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:  # someone else's process took the number: not ours, gone
            continue
        alive.append(pid)
    return alive


def guarded(report: Report, name: str, step: Callable[..., Any], *args: Any) -> Any:
    """``step(*args)``'s result; an exception it lets out becomes a failed row named ``name``
    (and None)."""
    try:
        return step(*args)
    except Exception as exc:  # the script goes on to the next step
        report.add(name, "failed", f"{type(exc).__name__}: {exc}")
        return None


def tail(text: str) -> str:
    """The last non-empty line, short (a row's detail)."""
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# ----------------------------------------------------------------------------- eval


def step_eval(r: Runner, report: Report, run_id: str | None, cpu: bool) -> None:
    """``homelab-dp eval RUN --json`` on the card (or one CPU process): a row with device,
    dtype, loss, perplexity and tokens/s."""
    name = "eval (tiny-demo run)"
    if not run_id:
        report.add(name, "skipped", "no tiny-demo run to evaluate")
        return
    if r.left() < 30:
        report.add(name, "skipped", "out of the time budget")
        return
    args = ["eval", run_id, "--data", str(EVAL_DATA), "--json"]
    t = time.monotonic()
    out = r.cli(*(args + (["--gpus", "cpu:1"] if cpu else [])), cap_s=180)
    try:
        doc = json.loads(out.stdout)
        ppl = doc.get("perplexity")
        detail = (f"{doc['device']} {doc['dtype']} × {doc['world_size']}: loss {doc['loss']:.3f}, "
                  f"perplexity {f'{ppl:.2f}' if ppl else 'overflow'}, "
                  f"{doc['tokens_per_s']:,.0f} tokens/s ({doc['real_tokens']:,} tokens, "
                  f"{doc['samples']} samples, {doc['seconds']:.1f} s forward), "
                  f"{time.monotonic() - t:.0f} s end to end")  # fmt: skip
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        report.add(name, f"failed (exit {out.returncode})", tail(out.stderr) or tail(out.stdout))
        return
    report.add(name, "ok", detail)


# ----------------------------------------------------------------------------- serve


def request(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
    """GET (no body) or POST a JSON body; the JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def streamed_chat(base: str, timeout: float = 60.0) -> tuple[int, bool]:
    """One streamed chat completion: (the chunks of data received, whether ``data: [DONE]``
    ended the stream)."""
    body = {"messages": [{"role": "user", "content": "Add up these numbers. 4, 8, 15"}],
            "max_tokens": 32, "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{base}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    chunks, done = 0, False
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                json.loads(line[6:])  # every chunk is a JSON object
                chunks += 1
    return chunks, done


def wait_ready(proc: subprocess.Popen[bytes], out: Path, cap_s: float) -> str | None:
    """serve's URL once its ready line is on stdout; None when it exited or ``cap_s`` passed."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        url = serving_url(out.read_text(encoding="utf-8", errors="replace"))
        if url or proc.poll() is not None:
            return url
        time.sleep(0.5)
    return None


def stop(proc: subprocess.Popen[bytes]) -> tuple[bool, int | None]:
    """SIGTERM, then SIGKILL to its whole session after STOP_CAP_S: (whether it exited on
    SIGTERM within the cap, its exit code)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return True, proc.wait(timeout=STOP_CAP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return False, proc.wait(timeout=10)


def exercise(base: str) -> dict[str, Any]:
    """/health, CONCURRENT completions at once, one streamed chat: the figures."""
    health = request(base.removesuffix("/v1") + "/health", timeout=10)
    prompts = [f"Add up these numbers. {i}, {2 * i + 1}, {3 * i + 7}" for i in range(CONCURRENT)]
    bodies = [{"prompt": p, "max_tokens": 32, "temperature": 0} for p in prompts]
    t = time.monotonic()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda b: request(f"{base}/completions", b), bodies))
    seconds = time.monotonic() - t
    usages = [a["usage"] for a in answers]
    chunks, done = streamed_chat(base)
    return {"health": health, "usages": usages, "seconds": seconds, "chunks": chunks, "done": done}


def step_serve(r: Runner, report: Report, run_id: str | None, cpu: bool) -> None:
    """``homelab-dp serve RUN --replicas 1 --port 0``: ready line, /health, concurrent and
    streamed requests, a clean SIGTERM with no replica left behind."""
    name = "serve (tiny-demo run)"
    if not run_id:
        report.add(name, "skipped", "no tiny-demo run to serve")
        return
    if importlib.util.find_spec("aiohttp") is None:
        report.add(name, "skipped", "aiohttp missing: carry its wheel (see the docstring)")
        return
    if r.left() < 60:
        report.add(name, "skipped", "out of the time budget")
        return
    out, err = r.work / "serve.out", r.work / "serve.err"
    cmd = [sys.executable, "-c", CLI, "serve", run_id, "--replicas", "1", "--port", "0"]
    cmd += ["--gpus", "cpu:1"] if cpu else []
    t = time.monotonic()
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, env=r.env, cwd=ROOT, stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    figures: dict[str, Any] = {}
    problem, ready_s = "", 0.0
    try:
        base = wait_ready(proc, out, min(READY_CAP_S, max(10.0, r.left() - 30)))
        ready_s = time.monotonic() - t
        if base is None:
            state = f"exit {proc.returncode}" if proc.poll() is not None else "no ready line"
            problem = f"{state} after {ready_s:.0f} s: {tail(err.read_text(errors='replace'))}"
        else:
            figures = exercise(base)
    except Exception as exc:  # a request that failed: the row says which, the server still stops
        problem = f"{type(exc).__name__}: {exc}"
    finally:
        clean, code = stop(proc)
    pids = [
        int(x["pid"]) for x in (figures.get("health") or {}).get("replicas", []) if x.get("pid")
    ]
    deadline = time.monotonic() + 5  # the front waits for its replicas; a moment's grace anyway
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = pids_alive(pids)
    exit_text = (f"SIGTERM: exit {code}" if clean else "SIGTERM ignored: killed") + (
        f", replica pid(s) {left} left" if left else f", replica pid(s) {pids} gone"
    )
    if problem:
        report.add(name, "failed", f"{problem}; {exit_text}")
        return
    replicas = figures["health"].get("replicas") or [{}]
    rps, tps = throughput(figures["usages"], figures["seconds"])
    ok = (
        figures["done"] and clean and code == 0 and not left and figures["health"]["status"] == "ok"
    )
    report.add(name, "ok" if ok else "failed",
               f"{replicas[0].get('device')}: ready in {ready_s:.0f} s; {CONCURRENT} concurrent "
               f"completions in {figures['seconds']:.2f} s = {rps:.1f} requests/s, {tps:,.0f} "
               f"generated tokens/s; stream {figures['chunks']} chunks, "
               f"{'[DONE]' if figures['done'] else 'no [DONE]'}; {exit_text}")  # fmt: skip
