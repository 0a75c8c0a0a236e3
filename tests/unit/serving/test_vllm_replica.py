"""The vLLM replica without vLLM: its pure mappings, and that it starts (and fails) cleanly.

vllm is not installed here and there is no GPU, so the engine itself never runs in these tests:
they check what the replica hands vLLM (engine and sampling arguments, built from the real demo
model folder and tokenizer), how vLLM's cumulative outputs become protocol lines (stand-ins
with RequestOutput's fields), the shared HTTP side over a stand-in for vLLM's engine (real HTTP
on loopback: the token, the NDJSON stream, a 400, abort when a stream is closed early), which
module the supervisor starts for ``engine="vllm"``, and that a replica process without vllm
exits 2 with an ``error:`` line and no ready file.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from homelab_dp.errors import HomelabError
from homelab_dp.runs.model_ref import ModelRef, resolve_model
from homelab_dp.serving.front.replica_supervisor import ReplicaLaunch, Supervisor
from homelab_dp.serving.replica.prompt_templates import (
    INSTRUCTION,
    INSTRUCTION_STOP,
    Template,
    prompt_ids,
)
from homelab_dp.serving.replica.replica_protocol import BadRequest, prepare
from homelab_dp.serving.replica.result_model import load_tokenizer
from homelab_dp.serving.replica.vllm_replica import (
    VllmReplica,
    index_for_vllm,
    lora_rank,
    output_events,
    parse_args,
    sampling_kwargs,
    text_delta,
    vllm_settings,
)

ROOT = Path(__file__).resolve().parents[3]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
POSITIONS = 512  # the demo model's max_position_embeddings


@dataclass
class Completion:
    """The fields of vLLM's CompletionOutput the replica reads."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Output:
    """The fields of vLLM's RequestOutput the replica reads (cumulative, as vLLM streams)."""

    text: str
    tokens: int
    finished: bool = False
    finish_reason: str | None = None
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6, 7])

    @property
    def outputs(self) -> list[Completion]:
        return [Completion(self.text, list(range(self.tokens)), self.finish_reason)]


class StandInEngine:
    """Stands in for vLLM's AsyncLLMEngine: streams a fixed answer as cumulative outputs."""

    PIECES = ("He", "Hello", "Hello there")

    def __init__(self) -> None:
        self.params: list[Any] = []
        self.aborted: list[str] = []

    async def generate(self, prompt: dict, params: Any, request_id: str, lora_request: Any = None):
        self.params.append(params)
        for i, text in enumerate(self.PIECES, 1):
            last = i == len(self.PIECES)
            yield Output(text, i, last, "stop" if last else None, prompt["prompt_token_ids"])
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def stand_in_replica() -> tuple[VllmReplica, StandInEngine]:
    ref = resolve_model(str(DEMO_MODEL))
    engine = StandInEngine()
    vllm = SimpleNamespace(SamplingParams=dict)  # the replica's arguments as they are
    tokenizer = load_tokenizer(ref)
    settings = vllm_settings(ref, context=64)
    template = Template(INSTRUCTION, (INSTRUCTION_STOP,))
    return VllmReplica(engine, vllm, tokenizer, template, settings, "secret"), engine


def test_the_http_side_streams_vllm_outputs_as_protocol_lines() -> None:
    replica, engine = stand_in_replica()
    auth = {"Authorization": "Bearer secret"}

    async def talk() -> list[Any]:
        async with TestClient(TestServer(replica.app())) as client:
            denied = await client.post("/generate", json={"prompt": "Hi"})
            ok = await client.post(
                "/generate", json={"prompt": "Hi", "max_tokens": 5}, headers=auth
            )
            lines = [json.loads(x) for x in (await ok.text()).splitlines()]
            long = await client.post(
                "/generate", json={"prompt": "Hi", "max_tokens": 64}, headers=auth
            )
            ready = await (await client.get("/ready", headers=auth)).json()
            return [denied.status, ok.status, ok.headers["Content-Type"], lines, long.status,
                    (await long.json())["error"]["param"], ready]  # fmt: skip

    denied, status, kind, lines, long, param, ready = asyncio.run(talk())
    assert (denied, status, kind) == (401, 200, "application/x-ndjson")
    prompt = len(prompt_ids(replica.tokenizer, prompt="Hi"))
    assert lines == [
        {"text": "He"},
        {"text": "llo"},
        {"text": " there"},
        {"finish_reason": "stop",
         "usage": {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}},
    ]  # fmt: skip
    assert (long, param) == (400, "max_tokens")  # checked against --context 64, not 512
    assert engine.params[0]["max_tokens"] == 5 and engine.params[0]["stop"] == [INSTRUCTION_STOP]
    assert ready == {"ok": True, "in_flight": 0, "served": 1} and engine.aborted == []


def test_a_stream_closed_early_aborts_its_request() -> None:
    replica, engine = stand_in_replica()
    prepared = prepare({"prompt": "Hi", "max_tokens": 5}, replica.tokenizer, replica.template, 64)

    async def leave_after_one() -> Any:
        events = replica.events(prepared)
        first = await anext(events)
        await events.aclose()  # what the HTTP side does when the client has gone
        return first

    assert asyncio.run(leave_after_one()) == {"text": "He"}
    assert len(engine.aborted) == 1


def test_it_imports_without_vllm() -> None:
    code = "import sys, homelab_dp.serving.replica.vllm_replica; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_full_model_folder_as_it_is() -> None:
    settings = vllm_settings(resolve_model(str(DEMO_MODEL)))
    assert settings.engine_kwargs() == {
        "model": str(DEMO_MODEL),
        "tokenizer": str(DEMO_MODEL),
        "dtype": "auto",
        "max_model_len": POSITIONS,
        "gpu_memory_utilization": 0.9,
        "trust_remote_code": False,
        "disable_log_stats": True,
    }
    capped = vllm_settings(resolve_model(str(DEMO_MODEL)), context=100, gpu_memory_utilization=0.5)
    assert (capped.max_model_len, capped.gpu_memory_utilization) == (100, 0.5)
    assert vllm_settings(resolve_model(str(DEMO_MODEL)), context=10**6).max_model_len == POSITIONS
    run_ref = ModelRef(name="r", path=DEMO_MODEL, dtype="bf16", trust_remote_code=True)
    kwargs = vllm_settings(run_ref).engine_kwargs()
    assert kwargs["dtype"] == "bfloat16" and kwargs["trust_remote_code"] is True
    for share in (0.0, 1.5):
        with pytest.raises(HomelabError, match="--gpu-memory-utilization"):
            vllm_settings(run_ref, gpu_memory_utilization=share)


def test_an_adapter_runs_as_a_lora_on_its_base(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"base_model_name_or_path": str(DEMO_MODEL), "r": 12, "peft_type": "LORA"}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    kwargs = vllm_settings(resolve_model(str(adapter))).engine_kwargs()
    assert kwargs["model"] == kwargs["tokenizer"] == str(DEMO_MODEL)  # the base's
    assert kwargs["enable_lora"] is True and kwargs["max_loras"] == 1
    assert kwargs["max_lora_rank"] == 16  # r = 12 rounded up to a rank vLLM allows
    assert vllm_settings(resolve_model(str(adapter))).lora_path == str(adapter)
    assert [lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 320, 321, 512)] == [
        1, 8, 8, 16, 64, 320, 320, 512, 512,
    ]  # fmt: skip
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 1024}))
    with pytest.raises(HomelabError, match="r=1024"):
        vllm_settings(resolve_model(str(adapter)))


def test_sampling_arguments_from_a_body() -> None:
    tokenizer = load_tokenizer(resolve_model(str(DEMO_MODEL)))
    template = Template(INSTRUCTION, (INSTRUCTION_STOP,))
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, "temperature": 0.7, "top_p": 0.9, "stop": "\n\n", "seed": 3}
    prepared = prepare(body, tokenizer, template, 100)
    # The same tokens as the transformers replica's prompt.
    assert prepared.prompt_ids == prompt_ids(tokenizer, messages=messages, template=template)
    assert sampling_kwargs(prepared, [2, 1, 2]) == {
        "max_tokens": 100 - len(prepared.prompt_ids),  # up to the (capped) context
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n\n", INSTRUCTION_STOP],
        "stop_token_ids": [1, 2],
        "seed": 3,
    }
    greedy = sampling_kwargs(
        prepare({"prompt": "Hi", "top_p": 0, "max_tokens": 5}, tokenizer, template, 100)
    )
    assert greedy["top_k"] == 1 and greedy["top_p"] == 1.0  # vLLM wants top_p > 0
    assert (greedy["max_tokens"], greedy["temperature"], greedy["seed"]) == (5, 1.0, None)
    with pytest.raises(BadRequest) as bad:
        prepare({"prompt": "Hi", "max_tokens": 100}, tokenizer, template, 100)
    assert bad.value.param == "max_tokens"


def test_cumulative_outputs_become_protocol_lines() -> None:
    stream = [
        Output("", 0),
        Output("Hel", 1),
        Output("Hello", 2),
        Output("Hello wor\ufffd", 3),  # a character still incomplete: held back
        Output("Hello world", 4, finished=True, finish_reason="length"),
    ]
    sent, lines = "", []
    for output in stream:
        sent, new = output_events(sent, output)
        lines += new
    assert lines == [
        {"text": "Hel"},
        {"text": "lo"},
        {"text": " wor"},
        {"text": "ld"},
        {
            "finish_reason": "length",
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        },
    ]
    assert sent == "Hello world"
    for reason in ("stop", "abort", None):
        _, [last] = output_events("ok", Output("ok", 1, finished=True, finish_reason=reason))
        assert last["finish_reason"] == "stop"
    assert text_delta("abc", "abcd") == "d"
    assert text_delta("abc", "abX") == ""  # a text that does not extend the sent one waits


def test_the_supervisor_starts_vllm_replicas_with_their_arguments() -> None:
    launch = ReplicaLaunch("cuda:0", "GPU 0 (H100)", "GPU-123")
    sup = Supervisor(
        "/m", [launch], max_batch=4, engine="vllm", context=2048, gpu_memory_utilization=0.8
    )
    try:
        cmd = sup.command(sup.replicas[0])
        assert cmd[1:3] == ["-m", "homelab_dp.serving.replica.vllm_replica"]
        assert cmd[cmd.index("--context") + 1] == "2048"
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.8"
        assert "--max-batch" not in cmd  # vLLM schedules its own batches
        assert sup.environment(sup.replicas[0])["CUDA_VISIBLE_DEVICES"] == "GPU-123"
        args = parse_args(cmd[3:])
        assert (args.context, args.gpu_memory_utilization, args.device) == (2048, 0.8, "cuda:0")
        assert sup.context() is None  # the replicas' context: none has reported yet
    finally:
        sup.cleanup()
    plain = Supervisor("/m", [launch], max_batch=4)
    try:
        cmd = plain.command(plain.replicas[0])
        assert (
            cmd[2] == "homelab_dp.serving.replica.transformers_replica" and "--context" not in cmd
        )
    finally:
        plain.cleanup()
    with pytest.raises(ValueError, match="engine"):
        Supervisor("/m", [launch], engine="tgi")


def test_vllm_gets_card_indices_not_uuids() -> None:
    for visible in ("1", "0,1", "MIG-abc", ""):
        env = {"CUDA_VISIBLE_DEVICES": visible}
        index_for_vllm(env)
        assert env == {"CUDA_VISIBLE_DEVICES": visible}  # numbers already, or not ours to map
    env = {"CUDA_VISIBLE_DEVICES": "GPU-00000000-no-such-card"}
    with pytest.raises(HomelabError, match="CUDA_VISIBLE_DEVICES=GPU-"):
        index_for_vllm(env)  # no NVML here; where there is one, no card has this UUID
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-00000000-no-such-card"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
@pytest.mark.parametrize(
    ("device", "says"), [("cuda:0", "vllm cannot be imported"), ("cpu", "runs on cuda:0")]
)
def test_a_replica_that_cannot_start_exits_2(tmp_path: Path, device: str, says: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "homelab_dp.serving.replica.vllm_replica",
        "--model",
        str(DEMO_MODEL),
    ]
    cmd += ["--device", device, "--id", "0", "--state-dir", str(tmp_path)]
    env = {**os.environ, "HOMELAB_DP_REPLICA_TOKEN": "secret"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0]
    assert "hint: " in done.stdout and list(tmp_path.iterdir()) == []  # no replica-0.json
