"""The serving plan: per-replica memory, copies per card on recorded cards, the model that does
not fit one card, and the replica choice (`planning.serve_plan`, `app.serve`)."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from homelab_dp.app.serve import plan_serve
from homelab_dp.byte_units import GiB
from homelab_dp.errors import HomelabError
from homelab_dp.planning.memory.device_memory import CPU_RUNTIME_BYTES, CUDA_CONTEXT_BYTES
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.planning.serve_plan import CANNOT_HELP, ServeDevice, plan_serving
from homelab_dp.probe.fake_nvml import FAKE_ENV
from homelab_dp.render.serve_plan import render_serve_plan, serve_plan_text
from tests.conftest import DATA, ROOT

LLAMA3_8B = ROOT / "assets" / "configs" / "meta-llama-3-8b"
QWEN_05B = ROOT / "assets" / "configs" / "qwen2-0.5b"
TINY = ROOT / "assets" / "models" / "tiny-llama"


@pytest.fixture
def cards(monkeypatch: pytest.MonkeyPatch):
    """Probe a recorded machine: ``cards("3090+3060")``."""

    def use(recording: str) -> None:
        monkeypatch.setenv(FAKE_ENV, str(DATA / "nvml" / f"{recording}.json"))

    return use


def text_of(renderable: object) -> str:
    console = Console(width=140, file=io.StringIO(), color_system=None)
    with console.capture() as captured:
        console.print(renderable)
    return captured.get()


def test_llama3_8b_kv_cache_weights_and_total() -> None:
    spec = load_model_spec(LLAMA3_8B)
    plan = plan_serving(spec, [ServeDevice(0, "24 GiB card", 24 * GiB)],
                        weight_bytes_per_param=2, context=4096, concurrent=8, kind="cuda")  # fmt: skip
    assert plan.kv_cache_bytes == 2 * 32 * 8 * 128 * 4096 * 8 * 2 == 4 * GiB
    assert plan.kv_bytes_per_sequence == 512 * 1024**2
    assert plan.weights_bytes == spec.params * 2 == 16_060_522_496
    assert plan.logits_bytes == 2 * 8 * 128_256 * 4  # last positions only, fp32
    # One layer of a 4096-token prefill: 2h + q + k + v + attention output + 3 × intermediate.
    assert plan.prefill_bytes == 4096 * (2 * 4096 + 4096 + 2 * 1024 + 4096 + 3 * 14336) * 2
    tensors = plan.weights_bytes + plan.kv_cache_bytes + plan.activation_bytes
    assert plan.overhead_bytes == int(CUDA_CONTEXT_BYTES + 0.10 * tensors)
    assert plan.per_replica_bytes == tensors + plan.overhead_bytes
    assert 21 * GiB < plan.per_replica_bytes < 22 * GiB
    assert [d.copies_fit for d in plan.devices] == [1]
    # What is left beside the copy, counted in whole sequences of cache and logits.
    spare = plan.devices[0].spare_sequences
    per_seq = (plan.kv_bytes_per_sequence + 2 * 128_256 * 4) * 1.10
    assert spare == int((24 * GiB - plan.per_replica_bytes) // per_seq) == 3
    assert plan.to_json()["per_replica_bytes"]["total"] == plan.per_replica_bytes


def test_copies_per_card_on_recorded_cards(cards) -> None:
    cards("3090+3060")
    planned = plan_serve(str(LLAMA3_8B))
    plan = planned.plan
    assert [(d.index, d.copies_fit) for d in plan.devices] == [(0, 1), (1, 0)]
    assert plan.replicas == 1 and plan.fits
    [replica] = planned.replicas
    assert replica.device == "cuda:0" and replica.threads is None
    assert replica.label == "GPU 0 (NVIDIA GeForce RTX 3090)"
    assert replica.cuda_visible == "GPU-c3e81f07-62ab-4d9c-b5f4-0a9d37e2c816"
    assert planned.dtype == "bf16" and plan.context == 4096  # min(4096, 8192 positions)
    assert any("No copy fits on GPU 1 (NVIDIA GeForce RTX 3060)" in r for r in plan.reasons)

    small = plan_serve(str(QWEN_05B), replicas="2").plan
    assert [d.copies_fit for d in small.devices] == [
        d.memory_bytes // small.per_replica_bytes for d in small.devices
    ]
    assert small.devices[0].copies_fit > 1
    text = " ".join(small.reasons)
    assert "copies on one card share its compute and do not add throughput" in text
    assert "more concurrent sequences" in text


def test_two_cards_two_replicas_by_uuid(cards) -> None:
    cards("2x3090-nvlink")
    planned = plan_serve(str(LLAMA3_8B), replicas="auto")
    assert [r.cuda_visible for r in planned.replicas] == [
        "GPU-0b9e7a41-3c2d-4f58-9e6a-71d2c8b43f10",
        "GPU-7d4a2c96-e15b-4a03-8f27-c94b0e6d1a58",
    ]
    assert [r.label for r in plan_serve(str(LLAMA3_8B), replicas="1").replicas] == [
        "GPU 0 (NVIDIA GeForce RTX 3090)"
    ]
    out = text_of(render_serve_plan(planned))
    assert "copies fit" in out and "replica?" in out and "KV cache" in out
    assert "8 KV heads × 128 head dim × 4096 tokens × 8 sequences × 2 bytes" in out


def test_8b_bf16_does_not_fit_a_12gib_card() -> None:
    spec = load_model_spec(LLAMA3_8B)
    plan = plan_serving(spec, [ServeDevice(0, "12 GiB card", 12 * GiB)],
                        weight_bytes_per_param=2, context=4096, concurrent=8, kind="cuda")  # fmt: skip
    assert not plan.fits and plan.replicas == 0
    assert plan.devices[0].copies_fit == 0
    assert plan.max_concurrent == 0  # the 15 GiB of weights alone are too big
    assert any(r.startswith("The model does not fit one card") for r in plan.reasons)
    assert "Replicas" + CANNOT_HELP[len("replicas") :] + "." in plan.reasons
    assert any(
        "quantize it (a 4-bit or 8-bit copy) or shard it across cards" in r for r in plan.reasons
    )
    assert "DOES NOT FIT ONE CARD" in text_of(serve_plan_text(spec, plan))


def test_serving_a_model_no_card_holds_is_refused_but_planned(cards) -> None:
    cards("2x2080ti")  # 11 GiB cards
    with pytest.raises(HomelabError) as err:
        plan_serve(str(LLAMA3_8B))
    assert "replicas cannot help a model that does not fit one card" in err.value.message
    assert "quantize" in err.value.hint
    # `serve --plan` shows the plan instead, as `plan` does for a run that does not fit.
    planned = plan_serve(str(LLAMA3_8B), gpus="12GiB", what_if_ok=True)
    assert planned.replicas == [] and not planned.plan.fits
    assert planned.plan.devices[0].name == "card 0 (what-if 12.0 GiB)"
    out = text_of(render_serve_plan(planned))
    assert "DOES NOT FIT" in out and "Replicas cannot help" in out


def test_fewer_sequences_would_fit_says_how_many() -> None:
    spec = load_model_spec(LLAMA3_8B)
    plan = plan_serving(spec, [ServeDevice(0, "20 GiB card", 20 * GiB)],
                        weight_bytes_per_param=2, context=4096, concurrent=8, kind="cuda")  # fmt: skip
    assert not plan.fits and 1 <= plan.max_concurrent < 8
    again = plan_serving(spec, [ServeDevice(0, "20 GiB card", 20 * GiB)],
                         weight_bytes_per_param=2, context=4096, concurrent=plan.max_concurrent,
                         kind="cuda")  # fmt: skip
    assert again.fits
    assert any(f"With {plan.max_concurrent} concurrent" in r for r in plan.reasons)
    assert not any("Replicas cannot help" in r for r in plan.reasons)  # the weights do fit


def test_bad_replicas_and_what_if_serving(cards) -> None:
    cards("3090+3060")
    with pytest.raises(HomelabError, match=r"--replicas 3: only 2 GPU"):
        plan_serve(str(TINY), replicas="3")
    with pytest.raises(HomelabError, match=r"--replicas 2: only 1 GPU"):
        plan_serve(str(LLAMA3_8B), replicas="2")  # the 3060 cannot hold a copy
    for bad in ("0", "two", "-1"):
        with pytest.raises(HomelabError, match="--replicas"):
            plan_serve(str(TINY), replicas=bad)
    with pytest.raises(HomelabError, match="what-if cards can be planned, not served"):
        plan_serve(str(TINY), gpus="2x24GiB")
    assert plan_serve(str(TINY), gpus="2x24GiB", what_if_ok=True).plan.replicas == 2
    with pytest.raises(HomelabError, match="no such folder"):
        plan_serve("no-such-model-or-run")
    with pytest.raises(HomelabError, match="context"):
        plan_serve(str(TINY), context=10**6)


def test_cpu_processes(cards) -> None:
    cards("3090+3060")  # the recorded host: 26 GiB of RAM available
    planned = plan_serve(str(TINY), gpus="cpu:2")
    plan = planned.plan
    assert plan.kind == "cpu" and planned.dtype == "fp32" and plan.bytes_per_param == 4
    assert [d.memory_bytes for d in plan.devices] == [27917553664 // 2] * 2
    tensors = plan.weights_bytes + plan.kv_cache_bytes + plan.activation_bytes
    assert plan.overhead_bytes == int(CPU_RUNTIME_BYTES + 0.05 * tensors)
    assert plan.context == 512  # the tiny model's positions, under 4096
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert [(r.device, r.label, r.cuda_visible, r.threads) for r in planned.replicas] == [
        ("cpu", "cpu", None, threads)
    ] * 2
    assert len(plan_serve(str(TINY), gpus="cpu:2", replicas="1").replicas) == 1
    with pytest.raises(HomelabError, match=r"--replicas 3: only 2 CPU process"):
        plan_serve(str(TINY), gpus="cpu:2", replicas="3")
    # RAM given with the spec is shared by the processes; too little for a replica each.
    with pytest.raises(HomelabError, match="more than any CPU process here has"):
        plan_serve(str(TINY), gpus="cpu:2:1GiB")


def test_no_gpu_serves_from_one_cpu_process(cards) -> None:
    cards("no-driver")
    planned = plan_serve(str(TINY))
    assert planned.source == "probe: no GPU" and planned.plan.kind == "cpu"
    assert len(planned.replicas) == 1 and planned.replicas[0].device == "cpu"
    assert planned.plan.reasons[0].startswith("No GPU found")
