"""Hostile and clumsy requests, checked without a server: every one is a 4xx naming its field,
never an exception out of the parser; the replica's own checks agree with the front's; a row that
fails in the engine fails alone; and what a replica's environment holds.

Each class of issue 28 (points 1-3, 10) has a case here; the live server's side is
`test_serve_hostile`.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.planning import serve_plan
from homelab_dp.serving.front import openai_api as api
from homelab_dp.serving.front.replica_supervisor import ReplicaLaunch, Supervisor
from homelab_dp.serving.front.request_guards import parse_bearer
from homelab_dp.serving.replica import replica_protocol as rb

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"


def refused(call: Any, *args: Any) -> api.ApiError:
    with pytest.raises(api.ApiError) as info:
        call(*args)
    return info.value


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", **fields}


# -- 1. sampling parameters the engine cannot honour: a 400 naming the field, front and replica


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 1e-40}, "temperature"),  # logits / T overflow float32: NaN probs
        ({"temperature": 5e-324}, "temperature"),
        ({"temperature": serve_plan.MIN_TEMPERATURE / 2}, "temperature"),
        ({"seed": 2**64}, "seed"),  # torch.Generator.manual_seed overflows
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": "all"}, "top_p"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"stop": "x" * (serve_plan.MAX_STOP_CHARS + 1)}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),  # accepted by OpenAI, not done here
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"logit_bias": {"5": 100}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logprobs": 5}, "logprobs"),
    ],
)
def test_parameters_the_engine_cannot_honour_are_400(fields: dict, param: str) -> None:
    error = refused(api.parse_completion, completion(**fields))
    assert (error.status, error.param) == (400, param), error.message


def test_defaults_of_unsupported_knobs_pass() -> None:
    """What OpenAI clients send by default must keep working."""
    g = api.parse_completion(
        completion(
            presence_penalty=0,
            frequency_penalty=0.0,
            logit_bias={},
            logprobs=None,
            temperature=serve_plan.MIN_TEMPERATURE,
            seed=2**64 - 1,
            top_p=0,
        )
    )
    assert g.temperature == serve_plan.MIN_TEMPERATURE and g.seed == 2**64 - 1
    assert api.parse_completion(completion(seed=-(2**63), temperature=0)).temperature == 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "Hi", "temperature": NaN}',
        b'{"prompt": "Hi", "temperature": Infinity}',
        b'{"prompt": "Hi", "top_p": -Infinity}',
    ],
)
def test_nan_and_infinity_are_not_json(raw: bytes) -> None:
    assert refused(api.parse_json, raw).status == 400
    with pytest.raises(rb.BadRequest):
        rb.decode_json(raw)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 1e-40}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ["x" * (serve_plan.MAX_STOP_CHARS + 1)]}, "stop"),
        ({"prompt": "a\ud800b"}, "prompt"),
    ],
)
def test_the_replica_refuses_what_the_front_refuses(fields: dict, param: str) -> None:
    with pytest.raises(rb.BadRequest) as info:
        rb.parse_body(completion(**fields))
    assert info.value.param == param


# -- 2. the prompt's size is bounded before anything tokenizes it


def test_a_prompt_too_large_for_the_context_is_refused_before_tokenizing() -> None:
    context = 512
    limit = serve_plan.PROMPT_CHARS_PER_TOKEN * context
    api.check_prompt_size(api.parse_completion(completion(prompt="a" * limit)), context)
    error = refused(
        api.check_prompt_size, api.parse_completion(completion(prompt="a" * (limit + 1))), context
    )
    assert (error.status, error.param) == (400, "prompt")
    # Bytes too: 4-byte characters reach the byte bound first.
    wide = "\U0001f600" * (serve_plan.PROMPT_BYTES_PER_TOKEN * context // 4 + 1)
    chat = api.parse_chat({"messages": [{"role": "user", "content": wide}]})
    assert refused(api.check_prompt_size, chat, context).param == "messages"
    # The replica: before its tokenizer is called (a tokenizer that raises is never reached).
    with pytest.raises(rb.BadRequest) as info:
        rb.check_size(rb.parse_body(completion(prompt="a" * (limit + 1))), context)
    assert info.value.param == "prompt"


# -- 3. malformed input: 400 JSON, never an exception


def test_json_nested_deep_is_a_400() -> None:
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert refused(api.parse_json, raw).status == 400
    with pytest.raises(rb.BadRequest):
        rb.decode_json(raw)


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        (completion(prompt="\ud800"), "prompt"),
        (completion(prompt=["\udfff"]), "prompt"),
        (completion(stop=["\ud800"]), "stop"),
        (completion(model="\ud800"), "model"),
        ({"messages": [{"role": "user", "content": "hi \udc80"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(doc: dict, param: str) -> None:
    raw = json.dumps(doc).encode()  # "\ud800" escaped, as a hostile client sends it
    parse = api.parse_chat if "messages" in doc else api.parse_completion
    error = refused(parse, api.parse_json(raw))
    assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer k3y", True),
        ("bearer k3y", True),
        ("BEARER   k3y", True),
        ("Bearer k3y ", True),
        ("Bearer k3", False),
        ("Basic k3y", False),
        ("k3y", False),
        ("", False),
        ("Bearer k3yé", False),
        ("Bearer \udcc3\udca9", False),  # bytes that are not UTF-8, as aiohttp hands them over
    ],
)
def test_the_bearer_scheme_is_case_insensitive_and_odd_bytes_are_refused(header, ok) -> None:
    assert parse_bearer(header, "k3y") is ok


# -- 10 and 22.7: what a replica's environment holds


def test_replica_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOMELAB_DP_API_KEY", "user-secret")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    launches = [ReplicaLaunch("cuda:0", "GPU 1", cuda_visible="1"), ReplicaLaunch("cpu", "cpu")]
    sup = Supervisor(str(DEMO_MODEL), launches)
    try:
        gpu, cpu = (sup.environment(r) for r in sup.replicas)
        assert "HOMELAB_DP_API_KEY" not in gpu and "HOMELAB_DP_API_KEY" not in cpu
        assert gpu["CUDA_VISIBLE_DEVICES"] == "1" and gpu["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert cpu["CUDA_VISIBLE_DEVICES"] == ""
        assert gpu["HOMELAB_DP_REPLICA_TOKEN"] == sup.token
        assert gpu["HOMELAB_DP_FRONT_PID"] == str(__import__("os").getpid())
    finally:
        sup.cleanup()


# -- 1 (isolation): one failing row never fails another, with the real engine


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import torch

    from homelab_dp.runs.model_ref import resolve_model
    from homelab_dp.serving.replica.generation_engine import Engine
    from homelab_dp.serving.replica.prompt_templates import eos_ids
    from homelab_dp.serving.replica.result_model import load_for_inference

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_for_inference(resolve_model(str(DEMO_MODEL)), "cpu")
    eos = eos_ids(loaded.tokenizer, loaded.model)
    yield Engine(loaded.model, loaded.tokenizer, context=loaded.context, eos_ids=eos)
    torch.set_num_threads(threads)


def _requests(engine: Any, hostile: dict[str, Any]) -> list[Any]:
    from homelab_dp.serving.replica.generation_engine import Request
    from homelab_dp.serving.replica.prompt_templates import prompt_ids

    ids = prompt_ids(engine.tokenizer, prompt="The capital of")
    good = [Request(list(ids), 8, temperature=t, seed=3) for t in (0.0, 0.7, 1.0)]
    bad = Request(list(ids), 8, **hostile)
    return [good[0], bad, good[1], good[2]]


# What slips past a looser check and truly fails in generation: logits / T overflow (NaN
# probabilities: torch.multinomial raises), a seed torch.Generator cannot take, no prompt.
HOSTILE = [
    {"temperature": 1e-40},
    {"temperature": 0.7, "seed": 2**64},
    {"temperature": math.nan},
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_a_failing_row_fails_alone_in_the_engine(engine: Any, hostile: dict) -> None:
    alone = [engine.generate([r])[0] for r in _requests(engine, {})]
    batch = _requests(engine, hostile)
    events: list[list[dict]] = [[] for _ in batch]
    for req, got in zip(batch, events, strict=True):
        req.emit = got.append
    results = engine.generate(batch)
    assert results[1].finish_reason == "error"
    assert "error" in events[1][-1] and events[1][-1]["error"]["type"] == "server_error"
    for i in (0, 2, 3):
        assert results[i].finish_reason in ("stop", "length")
        assert results[i].token_ids == alone[i].token_ids  # the same answer as alone
        assert "finish_reason" in events[i][-1]


def test_a_failing_batch_is_retried_row_by_row(engine: Any) -> None:
    """A failure of the whole batched step (not one row's): each request is tried again alone,
    and only the one that fails alone too gets an error."""
    from homelab_dp.serving.replica.generation_engine import Batcher, Request
    from homelab_dp.serving.replica.prompt_templates import prompt_ids

    ids = prompt_ids(engine.tokenizer, prompt="Hello")
    # A token id past the vocabulary: the embedding lookup of the whole batch raises.
    bad_ids = [*ids, engine.model.config.vocab_size + 5]
    batcher = Batcher(engine, max_batch=4, gather_s=0.5)
    done: list[threading.Event] = []
    events: list[list[dict]] = []
    requests = []
    for prompt in (ids, bad_ids, ids):
        got: list[dict] = []
        finished = threading.Event()

        def emit(event: dict, got: list = got, finished: threading.Event = finished) -> None:
            got.append(event)
            if "finish_reason" in event or "error" in event:
                finished.set()

        requests.append(Request(list(prompt), 4, emit=emit))
        events.append(got)
        done.append(finished)
    batcher.start()
    try:
        for req in requests:
            batcher.submit(req)
        for finished in done:
            assert finished.wait(120)  # liveness guard
    finally:
        batcher.stop()
    assert "finish_reason" in events[0][-1] and "finish_reason" in events[2][-1]
    assert "error" in events[1][-1]
    assert sum("error" in e for got in events for e in got) == 1


# -- 10: the API key off the command line


def test_the_api_key_file_is_read_and_must_be_private(tmp_path: Path, capsys: Any) -> None:
    from homelab_dp.app.serve import api_key
    from homelab_dp.errors import HomelabError

    path = tmp_path / "key"
    path.write_text("s3cret\nignored\n")
    path.chmod(0o600)
    assert api_key(path, None) == "s3cret"
    path.chmod(0o644)
    with pytest.raises(HomelabError, match="other users can read") as info:
        api_key(path, None)
    assert "chmod 600" in (info.value.hint or "")
    with pytest.raises(HomelabError, match="no such file"):
        api_key(tmp_path / "missing", None)
    assert capsys.readouterr().err == ""
    assert api_key(None, "on-the-command-line") == "on-the-command-line"
    err = capsys.readouterr().err
    assert err.startswith("warning: --api-key is visible") and "HOMELAB_DP_API_KEY" in err


def test_a_missing_key_file_exits_2_before_anything_starts(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "homelab_dp.cli", "serve", str(DEMO_MODEL), "--gpus", "cpu:1"]
        + ["--port", "0", "--api-key-file", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: --api-key-file") and "hint:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("homelab-dp-serve-*"))  # no replica was started
