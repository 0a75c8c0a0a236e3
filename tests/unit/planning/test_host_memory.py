"""The host RAM model (`planning.memory.host_memory.host_budget`) and the plan's ``host`` block."""

from __future__ import annotations

import pytest

from homelab_dp.app.plan import host_available
from homelab_dp.byte_units import GiB
from homelab_dp.planning.memory.device_memory import TrainShape, budget
from homelab_dp.planning.memory.host_memory import (
    CHECKPOINT_BYTES_PER_PARAM,
    CUDA_HOST_RUNTIME_BYTES,
    host_budget,
)
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import plan, with_host
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.probe.hardware import HardwareReport, HostInfo
from homelab_dp.render.plan import host_line
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])
P = LLAMA3_8B.params


def _shape(method: str, distribution: str, n: int = 4, device: str = "cuda") -> TrainShape:
    return TrainShape(method=method, distribution=distribution, world_size=n, device=device,  # type: ignore[arg-type]
                      dtype="bf16" if device == "cuda" else "fp32", micro_batch=1, seq_len=512)  # fmt: skip


def _host(method: str, distribution: str, n: int = 4, device: str = "cuda", **kw):
    shape = _shape(method, distribution, n, device)
    return host_budget(LLAMA3_8B, shape, budget(LLAMA3_8B, shape), **kw)


def test_ddp_loads_a_full_copy_in_every_process_fsdp_one() -> None:
    ddp = _host("full", "ddp")
    per = CUDA_HOST_RUNTIME_BYTES + P * 4  # fp32 master weights, from_pretrained on the CPU
    assert ddp.phases["load"] == (per, 4 * per)
    assert ddp.peak_phase == "load" and ddp.total_bytes == 4 * per
    for dist in ("fsdp-grad-op", "fsdp-full"):
        fsdp = _host("full", dist)
        assert fsdp.phases["load"] == (per, per + 3 * CUDA_HOST_RUNTIME_BYTES)  # one copy
        # The result: rank 0 gathers the fp32 state dict.
        assert fsdp.phases["checkpoint"][0] == CUDA_HOST_RUNTIME_BYTES + P * 4
    # ZeRO-1 replicates the weights like DDP.
    assert _host("full", "zero1").phases["load"] == ddp.phases["load"]


def test_lora_loads_the_base_in_the_compute_dtype_and_merge_loads_it_again() -> None:
    lora = _host("lora", "fsdp-full", n=2)
    adapters = lora_bytes = LLAMA3_8B.lora_params(16) * 4
    assert lora.phases["load"][0] == CUDA_HOST_RUNTIME_BYTES + P * 2 + adapters
    assert "merge" not in lora.phases
    assert lora.phases["checkpoint"][0] == CUDA_HOST_RUNTIME_BYTES + lora_bytes  # adapters only
    merged = _host("lora", "ddp", n=2, merge=True)
    base = P * CHECKPOINT_BYTES_PER_PARAM + adapters
    assert merged.phases["merge"] == (CUDA_HOST_RUNTIME_BYTES + base,
                                      2 * CUDA_HOST_RUNTIME_BYTES + base)  # fmt: skip
    assert "merge" not in _host("full", "ddp", merge=True).phases  # nothing to merge


def test_qlora_holds_one_tensor_on_the_host() -> None:
    q = _host("qlora", "ddp", n=2)
    assert q.phases["load"][0] < CUDA_HOST_RUNTIME_BYTES + 2 * GiB


def test_cpu_processes_hold_their_own_tensors_and_rank_0_the_copies() -> None:
    shape = _shape("full", "fsdp-full", n=2, device="cpu")
    b = budget(LLAMA3_8B, shape)
    h = host_budget(LLAMA3_8B, shape, b)
    largest = LLAMA3_8B.embedding_params * 4
    load0, load_all = h.phases["load"]
    assert load0 == b.overhead + P * 4 + largest // 2  # the copy read, its shard in flight
    assert load_all - load0 == b.overhead + b.phases["load"]  # rank 1: its shards
    end = b.overhead + b.weights + b.optimizer
    assert h.phases["checkpoint"] == (end + P * 4, 2 * end + P * 4)
    ddp = host_budget(
        LLAMA3_8B,
        _shape("full", "ddp", 2, "cpu"),
        budget(LLAMA3_8B, _shape("full", "ddp", 2, "cpu")),
    )
    assert ddp.phases["checkpoint"][0] == ddp.phases["checkpoint"][1] / 2  # writes its own tensors


def test_fits_against_the_available_ram() -> None:
    h = _host("full", "ddp")
    assert _host("full", "ddp", available=None).fits  # not known: not checked
    assert _host("full", "ddp", available=h.total_bytes).fits
    tight = _host("full", "ddp", available=h.total_bytes - 1)
    assert not tight.fits
    doc = tight.to_json()
    assert {"per_process_bytes", "total_bytes", "available_bytes", "fits"} <= set(doc)
    assert doc["fits"] is False and doc["available_bytes"] == h.total_bytes - 1


def _preset(**train):
    return preset_from_dict({
        "model": {"path": "m"}, "data": {"path": "d", "seq_len": 512},
        "train": {"micro_batch": 1, "grad_accum": 8, **train},
    })  # fmt: skip


def test_a_plan_that_fits_the_cards_but_not_the_ram_does_not_fit() -> None:
    preset = _preset(method="lora")
    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    p = plan(LLAMA3_8B, preset, hw)
    assert (p.chosen.method, p.chosen.distribution) == ("lora", "ddp")
    assert p.fits and p.host is None and "host" in p.to_json()
    roomy = with_host(p, preset, 1024 * GiB)
    assert roomy.fits and roomy.reasons == p.reasons and roomy.advice == p.advice
    need = roomy.host.total_bytes
    short = with_host(p, preset, need // 2)
    doc = short.to_json()
    assert short.chosen.fits and not short.fits and doc["fits"] is False
    assert doc["host"]["fits"] is False and doc["host"]["total_bytes"] == need
    chosen = [r for r in doc["reasons"] if r.startswith("Chosen:")]
    assert len(chosen) == 1 and "host RAM does not: loading needs" in chosen[0]
    assert "2 processes × a full copy" in chosen[0]
    # FSDP of the same method fits the cards and loads one copy: the advice says so.
    assert any("train.distribution = 'fsdp-" in a for a in doc["advice"])
    # Unknown RAM (what-if cards): shown, not checked.
    unknown = with_host(p, preset, None)
    assert unknown.fits and unknown.to_json()["host"]["available_bytes"] is None


def test_a_plan_too_big_for_its_cards_keeps_its_words() -> None:
    preset = _preset(method="full", distribution="ddp")
    p = plan(LLAMA3_8B, preset, parse_gpus_spec("2x24GiB", 64 * GiB))
    assert not p.fits
    short = with_host(p, preset, GiB)
    assert not short.fits and short.reasons == p.reasons and short.advice == p.advice


def test_host_available_comes_from_the_probe_or_the_what_if() -> None:
    host = HostInfo("cpu", 8, 4, ram_total=64 * GiB, ram_available=40 * GiB)
    report = HardwareReport("cpu", host)
    cards = parse_gpus_spec("2x24GiB", 64 * GiB)
    assert host_available("2x24GiB", cards, None) is None
    cpu = parse_gpus_spec("cpu:2:32GiB", 64 * GiB)
    assert host_available("cpu:2:32GiB", cpu, None) == 32 * GiB
    assert host_available(None, cards, report) == 40 * GiB
    no_avail = HardwareReport("cpu", HostInfo("cpu", 8, 4, ram_total=64 * GiB))
    assert host_available(None, cards, no_avail) == 64 * GiB


@pytest.mark.parametrize("available", [None, 10 * GiB, 1000 * GiB])
def test_the_host_line_is_one_line(available) -> None:
    doc = _host("full", "ddp", available=available).to_json()
    line = host_line(doc).plain
    assert "\n" not in line and line.startswith("host RAM ") and "rank 0" in line
    assert ("not checked" in line) == (available is None)
    assert ("does NOT fit" in line) == (available == 10 * GiB)
