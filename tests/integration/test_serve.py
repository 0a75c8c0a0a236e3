"""`homelab-dp serve` end to end: real HTTP against real replica processes of the demo model.

One server (2 CPU replicas, bound off loopback with an API key) is shared by the module's tests
and stopped by the last one with SIGTERM. Each server and bad command line runs with its own TMPDIR, so
"nothing started" and "nothing left" are checked as "no replica state folder there".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.app.serve import is_loopback
from homelab_dp.serving.front.openai_server import ready_line

from .conftest import DEMO_MODEL, ROOT, stop_server, wait_ready

KEY = "test-key-123"
READY_S = 120.0  # liveness guard: the ready line comes in about 10 s on 2 cores


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    line: str
    tmp: Path
    stderr: Path


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "homelab_dp.cli", "serve", *args]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "tmpdir").mkdir()
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    args = [str(DEMO_MODEL), "--gpus", "cpu:2", "--port", "0", "--host", "0.0.0.0"]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            serve_command(*args, "--api-key", KEY),
            stdout=o,
            stderr=e,
            cwd=ROOT,
            env=dict(os.environ, TMPDIR=str(tmp / "tmpdir")),
        )
    try:
        line = wait_ready(proc, out, err, READY_S)
        port = int(re.search(r":(\d+)/v1 ", line).group(1))
        yield Server(proc, port, line, tmp / "tmpdir", err)
    finally:
        stop_server(proc)


def call(
    server: Server,
    method: str,
    path: str,
    body: Any = None,
    *,
    key: str | None = KEY,
    raw: bytes | None = None,
) -> tuple[int, bytes]:
    """One HTTP request to the server: (status, body)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(server: Server, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    status, data = call(server, "POST", path, body, **kw)
    return status, json.loads(data)


def health(server: Server) -> dict[str, Any]:
    return json.loads(call(server, "GET", "/health")[1])


def events(data: bytes) -> list[Any]:
    """The server-sent events of a streamed answer ("[DONE]" kept as a string)."""
    out = []
    for block in data.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def check_usage(doc: dict[str, Any], max_tokens: int) -> None:
    usage = doc["usage"]
    assert usage["prompt_tokens"] > 0
    assert 0 <= usage["completion_tokens"] <= max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_ready_line_and_models(server: Server) -> None:
    assert server.line == (
        f"serving tiny-llama on http://0.0.0.0:{server.port}/v1 with 2 replicas (cpu, cpu)\n"
    )
    status, doc = call(server, "GET", "/v1/models")
    assert status == 200
    models = json.loads(doc)
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        ("tiny-llama", "model", "homelab-dp")
    ]
    doc = health(server)
    assert doc["status"] == "ok"
    assert [(r["id"], r["device"], r["state"]) for r in doc["replicas"]] == [
        (0, "cpu", "ready"),
        (1, "cpu", "ready"),
    ]


def test_completions_and_chat(server: Server) -> None:
    body = {"model": "tiny-llama", "prompt": "The capital of", "max_tokens": 12, "temperature": 0}
    status, doc = post(server, "/v1/completions", body)
    assert status == 200, doc
    assert doc["object"] == "text_completion" and doc["model"] == "tiny-llama"
    choice = doc["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["text"]
    check_usage(doc, 12)
    # Greedy is greedy on either replica: the same answer again.
    assert post(server, "/v1/completions", body)[1]["choices"][0]["text"] == choice["text"]

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}]
    status, doc = post(
        server, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 10}
    )
    assert status == 200, doc
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(doc["choices"][0]["message"]["content"], str)
    check_usage(doc, 10)


def test_streaming_completions_and_chat(server: Server) -> None:
    body = {"prompt": "The capital of", "max_tokens": 12, "temperature": 0}
    whole = post(server, "/v1/completions", body)[1]
    status, data = call(server, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200
    got = events(data)
    assert got[-1] == "[DONE]"
    chunks, last = got[:-2], got[-2]
    assert all(c["object"] == "text_completion" for c in got[:-1])
    assert all(c["choices"][0]["finish_reason"] is None and "usage" not in c for c in chunks)
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert last["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in got[:-1]) == whole["choices"][0]["text"]

    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": True}
    status, data = call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200
    got = events(data)
    assert got[-1] == "[DONE]" and got[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["object"] for c in got[:-1]} == {"chat.completion.chunk"}
    assert got[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    check_usage(got[-2], 8)


def test_both_replicas_take_requests(server: Server) -> None:
    before = [r["requests"] for r in health(server)["replicas"]]
    body = {"prompt": "Once upon a time", "max_tokens": 16}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(server, "/v1/completions", body), range(8)))
    assert [status for status, _ in answers] == [200] * 8
    after = [r["requests"] for r in health(server)["replicas"]]
    taken = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(taken) == 8 and min(taken) >= 1, taken


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ', None),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "temperature": 5}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "n": 3}, "n"),
        ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 600}, "max_tokens"),
        # The prompt plus max_tokens beyond the context: the replica's 400, passed through.
        ("/v1/completions", {"prompt": "the sea " * 200, "max_tokens": 400}, None),
    ],
)
def test_bad_requests_are_400_and_the_server_keeps_serving(server, path, body, param) -> None:
    raw = body if isinstance(body, bytes) else None
    status, data = call(server, "POST", path, None if raw else body, raw=raw)
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


def test_another_model_is_404(server: Server) -> None:
    status, doc = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert status == 404 and doc["error"]["code"] == "model_not_found"


def test_off_loopback_every_request_needs_the_key(server: Server) -> None:
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "Hi"}),
        ("GET", "/health", None),
    ]:
        for key in (None, "wrong"):
            status, data = call(server, method, path, body, key=key)
            assert status == 401
            assert json.loads(data)["error"]["code"] == "invalid_api_key"
    assert call(server, "GET", "/v1/models")[0] == 200


def test_a_killed_replica_loses_no_request(server: Server) -> None:
    first = health(server)
    victim = first["replicas"][0]
    before = sum(r["requests"] for r in first["replicas"])
    body = {"prompt": "Tell me about the rivers.", "max_tokens": 64, "temperature": 0.8}
    with ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(post, server, "/v1/completions", {**body, "seed": i}) for i in range(16)
        ]
        deadline = time.monotonic() + 30
        while health(server)["replicas"][0]["in_flight"] == 0:
            assert time.monotonic() < deadline
        os.kill(victim["pid"], signal.SIGKILL)
        answers = [f.result() for f in futures]
    assert [status for status, _ in answers] == [200] * 16, answers
    for _, doc in answers:
        check_usage(doc, 64)
    states = []
    deadline = time.monotonic() + READY_S
    while True:
        now = health(server)["replicas"][0]
        states.append(now["state"])
        if now["state"] == "ready" and now["pid"] != victim["pid"]:
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.2)
    assert "restarting" in states
    after = health(server)
    assert after["status"] == "ok"
    # The requests the victim held were sent again: more tries than requests.
    assert sum(r["requests"] for r in after["replicas"]) > before + 16
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


def taken_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--host", "0.0.0.0"], "--api-key"),
        (["--gpus", "cpu:2", "--replicas", "3"], "--replicas 3"),
        (["--port", "TAKEN"], "--port"),
        # vllm is not installed here (and CPU replicas could not run it anyway).
        (["--gpus", "cpu:1", "--engine", "vllm"], "--engine vllm"),
        (["--gpus", "cpu:1", "--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
    ],
)
def test_bad_command_lines_start_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    holder = taken_port()
    args = [str(holder.getsockname()[1]) if a == "TAKEN" else a for a in args]
    try:
        done = subprocess.run(
            serve_command(str(DEMO_MODEL), "--port", "0", *args),  # a later --port wins
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, TMPDIR=str(tmp_path)),
            timeout=60,
        )
    finally:
        holder.close()
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and "\nhint: " in done.stderr
    assert says in done.stderr.splitlines()[0]
    assert done.stdout == "" and list(tmp_path.glob("homelab-dp-serve-*")) == []  # no replica


def test_what_counts_as_loopback_and_the_ready_line() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.5", "example.org"]))
    assert ready_line("m", "::", 80, ["GPU 0 (A)", "GPU 1 (B)"]) == (
        "serving m on http://[::]:80/v1 with 2 replicas (GPU 0 (A), GPU 1 (B))"
    )
    assert ready_line("m", "127.0.0.1", 80, ["cpu"]).endswith("with 1 replica (cpu)")


def test_an_unknown_model_is_an_error(tmp_path: Path) -> None:
    done = subprocess.run(
        serve_command(str(tmp_path / "nope"), "--port", "0"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: ")


def test_a_model_no_replica_can_load_ends_the_server(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(DEMO_MODEL, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    done = subprocess.run(
        serve_command(str(broken), "--gpus", "cpu:2", "--port", "0"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("cannot load the model") == 2  # each replica's log line, once
    assert done.stderr.rstrip().splitlines()[-2] == "error: every replica failed; nothing to serve"
    assert list(tmp_path.glob("homelab-dp-serve-*")) == []


def test_ctrl_c_stops_everything_with_130(tmp_path: Path) -> None:
    out = tmp_path / "stdout.txt"
    with open(out, "wb") as o:
        proc = subprocess.Popen(
            serve_command(str(DEMO_MODEL), "--gpus", "cpu:1", "--port", "0"),
            stdout=o,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            env=dict(os.environ, TMPDIR=str(tmp_path)),
        )
    try:
        deadline = time.monotonic() + READY_S
        while "serving" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        replica = next(p for p in Path("/proc").glob("[0-9]*") if _child_of(p, proc.pid))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert not replica.exists()
        assert list(tmp_path.glob("homelab-dp-serve-*")) == []
    finally:
        stop_server(proc)


def _child_of(proc_dir: Path, parent: int) -> bool:
    """Whether /proc/PID is a child process of ``parent`` (its replica)."""
    try:
        fields = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return int(fields[1]) == parent


def test_sigterm_stops_everything(server: Server) -> None:
    """Last: stops the shared server."""
    pids = [r["pid"] for r in health(server)["replicas"]]
    assert all(pids)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.stderr.read_text()
    assert time.monotonic() - started < 10
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert list(server.tmp.glob("homelab-dp-serve-*")) == []  # the state folder is gone
