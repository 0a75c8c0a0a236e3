"""A real replica process on the tiny model: the protocol the serve front relies on.

Started as the front starts it (`python -m homelab_dp.serving.replica.transformers_replica`, the token in the
environment, stdout and stderr into a log file), read over real HTTP. Greedy answers are
checked against transformers' own ``generate`` in this process; concurrent requests (one batch
in the replica) against the same requests sent alone.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

TOKEN = "test-secret-token"
CONTEXT = 128  # the tiny model's max_position_embeddings


def start_replica(model: Path, state: Path, k: int = 0, **popen: Any) -> subprocess.Popen:
    """A replica process as the front starts it (its log is state/replica-K.log)."""
    state.mkdir(parents=True, exist_ok=True)
    log = open(state / f"replica-{k}.log", "w")  # noqa: SIM115 - the child owns it
    cmd = [
        sys.executable,
        "-m",
        "homelab_dp.serving.replica.transformers_replica",
        "--model",
        str(model),
    ]
    cmd += ["--device", "cpu", "--id", str(k), "--state-dir", str(state), "--threads", "1"]
    env = {**os.environ, "HOMELAB_DP_REPLICA_TOKEN": TOKEN}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, **popen)


def wait_ready(state: Path, k: int = 0, proc: subprocess.Popen | None = None) -> dict:
    """replica-K.json once written (the log is printed if the process died first)."""
    path = state / f"replica-{k}.json"
    deadline = time.monotonic() + 180  # liveness guard: it takes a few seconds
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError((state / f"replica-{k}.log").read_text(encoding="utf-8")[-3000:])


def call(
    port: int, path: str, body: Any = None, token: str | None = TOKEN
) -> tuple[int, list[dict]]:
    """(status, the JSON lines of the answer) of a request to the replica."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is None:
        conn.request("GET", path, headers=headers)
    else:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers=headers)
    resp = conn.getresponse()
    lines = [json.loads(line) for line in resp.read().decode().splitlines() if line.strip()]
    conn.close()
    return resp.status, lines


def answer(lines: list[dict]) -> tuple[str, dict]:
    """The streamed text and the final event; every line but the last is a text delta."""
    *deltas, last = lines
    assert all(set(d) == {"text"} and d["text"] for d in deltas)
    return "".join(d["text"] for d in deltas), last


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.fixture(scope="module")
def replica(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    state = tmp_path_factory.mktemp("replica")
    proc = start_replica(tiny_model, state)
    info = wait_ready(state, proc=proc)
    yield {**info, "proc": proc, "state": state}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> Iterator[tuple[Any, Any]]:
    """transformers' own model and tokenizer, in this process (one torch thread, as the replica)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield (
        AutoModelForCausalLM.from_pretrained(tiny_model),
        AutoTokenizer.from_pretrained(tiny_model),
    )
    torch.set_num_threads(threads)


def hf_greedy(hf: tuple[Any, Any], ids: list[int], n: int) -> str:
    """transformers' own greedy answer to ``ids`` (up to n new tokens, stopping at eos)."""
    import torch

    model, tok = hf
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id
    )
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_ready_file_and_endpoint(replica: dict) -> None:
    assert replica["id"] == 0 and replica["pid"] == replica["proc"].pid
    assert replica["device"] == "cpu" and replica["context"] == CONTEXT
    assert replica["max_batch"] == 8 and replica["model"]
    status, [ready] = call(replica["port"], "/ready")
    assert status == 200 and ready["ok"] is True and ready["in_flight"] == 0


def test_prompt_streams_the_greedy_answer(replica: dict, hf: tuple[Any, Any]) -> None:
    prompt = "The capital of"
    ids = hf[1](prompt)["input_ids"]
    status, lines = call(
        replica["port"], "/generate", {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    )
    text, last = answer(lines)
    assert status == 200
    assert text == hf_greedy(hf, ids, 12)
    usage = last["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (last["finish_reason"], usage["completion_tokens"]) == ("length", 12) or (
        last["finish_reason"] == "stop" and usage["completion_tokens"] < 12
    )


def test_messages_use_the_chat_template(replica: dict, hf: tuple[Any, Any]) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of Foulek?"},
    ]
    ids = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "top_p": 1, "seed": None}
    status, lines = call(replica["port"], "/generate", body)
    text, last = answer(lines)
    assert status == 200 and last["usage"]["prompt_tokens"] == len(ids)
    assert text == hf_greedy(hf, ids, 10)


def test_concurrent_requests_equal_alone(replica: dict) -> None:
    bodies = [
        {"prompt": p, "max_tokens": n, "temperature": 0}
        for p, n in (("Hello", 16), ("The river flows through the capital of", 6), ("2 + 3", 11))
    ]
    alone = [call(replica["port"], "/generate", b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: call(replica["port"], "/generate", b), bodies))
    assert together == alone
    seeded = {"prompt": "Hello", "max_tokens": 16, "temperature": 1.0, "seed": 5}
    assert call(replica["port"], "/generate", seeded) == call(replica["port"], "/generate", seeded)


def test_stop_strings_end_the_text(replica: dict) -> None:
    _, lines = call(
        replica["port"], "/generate", {"prompt": "Hello", "max_tokens": 30, "temperature": 0}
    )
    full, _ = answer(lines)
    stop = full.split()[2]  # a word from the middle of the greedy answer
    _, lines = call(
        replica["port"],
        "/generate",
        {"prompt": "Hello", "max_tokens": 30, "temperature": 0, "stop": [stop]},
    )
    text, last = answer(lines)
    assert text == full[: full.index(stop)] and last["finish_reason"] == "stop"


def test_token_required(replica: dict) -> None:
    for token in (None, "wrong"):
        status, [body] = call(replica["port"], "/generate", {"prompt": "Hello"}, token=token)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert call(replica["port"], "/ready", token=None)[0] == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hello", "max_tokens": CONTEXT}, "max_tokens"),
        ({"prompt": "Hello", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "word " * 200}, "prompt"),
        ({"prompt": "Hello", "messages": [{"role": "user", "content": "Hi"}]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages"),
        ({"prompt": "Hello", "temperature": "hot"}, "temperature"),
        ({"prompt": "Hello", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "Hello", "stop": [1]}, "stop"),
        (b"{not json", None),
    ],
)
def test_bad_requests_are_400_with_param(replica: dict, body: Any, param: str | None) -> None:
    status, [error] = call(replica["port"], "/generate", body)
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param and error["error"]["code"] is None


def test_disconnect_cancels_and_it_keeps_serving(replica: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", replica["port"], timeout=60)
    body = json.dumps({"prompt": "Hello", "max_tokens": 120, "temperature": 0, "stop": []})
    conn.request("POST", "/generate", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
    resp = conn.getresponse()
    assert json.loads(resp.readline())  # the first event arrived: it is generating
    conn.close()
    deadline = time.monotonic() + 30
    while call(replica["port"], "/ready")[1][0]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call(replica["port"], "/ready")[1][0]["in_flight"] == 0
    log = (replica["state"] / "replica-0.log").read_text(encoding="utf-8")
    assert "client disconnected; its request is cancelled" in log
    status, lines = call(replica["port"], "/generate", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and lines[-1]["usage"]["completion_tokens"] == 2


def test_sigterm_ends_it(replica: dict) -> None:
    """(Runs last: it stops the module's replica.)"""
    proc = replica["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0  # liveness guard; it takes well under a second
    assert "stopping" in (replica["state"] / "replica-0.log").read_text()


def test_bad_model_exits_2_with_an_error_line(tmp_path: Path) -> None:
    proc = start_replica(tmp_path / "no-such-model", tmp_path)
    assert proc.wait(timeout=120) == 2
    log = (tmp_path / "replica-0.log").read_text(encoding="utf-8")
    assert [line for line in log.splitlines() if line.startswith("error: ")]
    assert not (tmp_path / "replica-0.json").exists()


def test_it_exits_when_its_parent_dies(tiny_model: Path, tmp_path: Path) -> None:
    """A parent python process starts the replica and is killed -9: the replica leaves, and
    takes its files and the emptied state folder with it (the dead front cannot)."""
    state = tmp_path / "state"
    state.mkdir()
    log = state / "replica-0.log"
    replica_cmd = [
        sys.executable,
        "-m",
        "homelab_dp.serving.replica.transformers_replica",
        "--model",
        str(tiny_model),
    ]
    replica_cmd += ["--id", "0", "--state-dir", str(state), "--threads", "1"]
    parent_code = (
        "import subprocess, sys\n"
        "with open(sys.argv[1], 'w') as log:\n"
        "    p = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n"
    )
    env = {**os.environ, "HOMELAB_DP_REPLICA_TOKEN": TOKEN}
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code, str(log), *replica_cmd],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    wait_ready(state)
    assert not gone(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30  # liveness guard: it polls its parent every second
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(child), "the replica outlived its parent"
    assert not state.exists()  # ready file and log removed, then the empty folder
