"""The time model on recorded hardware: step seconds, overlap, scaling and the advice in words
(`homelab_dp.planning.time_model`, `speed_plan`, `links`, `speed_calibration`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from homelab_dp.app.plan import gloo_measurement, make_plan, plan_link
from homelab_dp.byte_units import GiB
from homelab_dp.errors import HardwareSpecError
from homelab_dp.planning.links import (
    HOST_BOUNCE_EFFICIENCY,
    NVLINK_EFFICIENCY,
    gloo_cache_path,
    parse_network,
    read_cached_gloo,
    write_cached_gloo,
)
from homelab_dp.planning.memory.device_memory import comm_bytes_per_step
from homelab_dp.planning.memory.memory_calibration import torch_version
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import train_shape
from homelab_dp.planning.speed_calibration import (
    DEFAULT_GPU_FACTOR,
    SpeedStore,
    record_speed,
)
from homelab_dp.planning.time_model import comm_parts, cpu_threads, ddp_bucket_cap
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_view import view_of
from tests.conftest import DATA, ROOT, run_cli

QWEN = ROOT / "assets/configs/qwen2-0.5b"
SPEC = load_model_spec(QWEN)
PREDICTED_KEYS = {"step_seconds", "compute_seconds", "comm_seconds", "exposed_comm_seconds",
                  "offload_seconds", "tokens_per_s", "speedup_vs_one_device",
                  "scaling_efficiency", "bottleneck"}  # fmt: skip


def _preset(**train: object):
    seq_len = train.pop("seq_len", 256)
    return preset_from_dict({
        "model": {"path": str(QWEN)}, "data": {"path": "d", "seq_len": seq_len},
        "train": {"method": "full", "distribution": "ddp", "micro_batch": 1, "grad_accum": 1,
                  **train},
    })  # fmt: skip


def _cpu_preset():
    """`_preset` without activation checkpointing: the CPU tests price threads and gloo alone
    (this Qwen full fine-tune fits 8 GiB neither way, and the planner would pick whichever
    checkpointing setting gives the lower peak, which recomputes or not)."""
    return _preset(activation_checkpointing=False)


def _on(recording: str, monkeypatch: pytest.MonkeyPatch, **train: object):
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / f"{recording}.json"))
    return make_plan(_preset(**train), fetch=False).plan


def test_no_p2p_scales_worse_than_the_nvlink_bridge(monkeypatch: pytest.MonkeyPatch) -> None:
    nvlink = _on("2x3090-nvlink", monkeypatch)
    nop2p = _on("2x3090-nop2p", monkeypatch)
    a, b = nvlink.chosen.predicted, nop2p.chosen.predicted
    assert a is not None and b is not None
    # The same option, the same compute: only the link differs.
    assert (nvlink.chosen.method, nvlink.chosen.distribution) == ("full", "ddp")
    assert a.compute_seconds == pytest.approx(b.compute_seconds)
    assert a.comm_bytes_per_step == b.comm_bytes_per_step
    # 4 NVLink 3 links of 14.06 GB/s on a 3090 against PCIe 4.0 x16 bounced through the host
    link_a, link_b = a.assumptions["link"], b.assumptions["link"]
    assert link_a["value"] == pytest.approx(4 * 14.0625e9 * NVLINK_EFFICIENCY)
    assert link_b["value"] == pytest.approx(16 * 1.969e9 * HOST_BOUNCE_EFFICIENCY)
    assert link_a["kind"] == "nvlink" and link_b["kind"] == "host-bounce"
    # the same bytes (and collectives: the same latency) over the slower link
    extra = a.comm_bytes_per_step * (1 / link_b["value"] - 1 / link_a["value"])
    assert b.comm_seconds - a.comm_seconds == pytest.approx(extra)
    assert b.scaling_efficiency < a.scaling_efficiency
    assert b.speedup_vs_one_device < a.speedup_vs_one_device
    assert b.tokens_per_s < a.tokens_per_s
    assert b.bottleneck == "communication"


def test_more_accumulation_raises_the_scaling_efficiency(monkeypatch: pytest.MonkeyPatch) -> None:
    effs = []
    for accum in (1, 4, 16):
        p = _on("2x3090-nop2p", monkeypatch, grad_accum=accum)
        pred = p.chosen.predicted
        assert pred is not None
        effs.append(pred.scaling_efficiency)
        # DDP syncs once per optimizer step: the same bytes whatever the accumulation
        assert pred.comm_bytes_per_step == p.chosen.budget.comm_bytes_per_step
    assert effs[0] < effs[1] < effs[2]


def test_advice_names_the_communication_below_80_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _on("2x3090-nop2p", monkeypatch)
    pred = p.chosen.predicted
    assert pred is not None and pred.scaling_efficiency < 0.8
    (line, *_) = p.speed_advice
    assert line.startswith("These cards have no P2P: 2 cards ≈ ")
    assert "communication takes" in line and "without P2P" in line
    assert f"{pred.speedup_vs_one_device:.1f}× one card" in line
    # The accumulation it proposes does bring the predicted scaling it names
    g = int(line.split("grad_accum ")[1].split()[0])
    better = _on("2x3090-nop2p", monkeypatch, grad_accum=g).chosen.predicted
    assert better is not None and f"brings it to {better.speedup_vs_one_device:.1f}×" in line
    assert better.scaling_efficiency > pred.scaling_efficiency
    # plan --json: the new keys beside the old ones, the advice after the fit advice
    doc = p.to_json()
    assert set(doc["predicted"]) >= PREDICTED_KEYS
    assert doc["advice"][-len(p.speed_advice) :] == list(p.speed_advice)
    sources = {v["source"] for v in doc["predicted"]["assumptions"].values() if isinstance(v, dict)}
    assert sources <= {"table", "measured", "calibrated", "given"}
    for c in doc["candidates"]:
        assert c["predicted"] is None or set(c["predicted"]) >= PREDICTED_KEYS
    # A well-linked pair, compute-bound: no word about communication
    good = _on("2x3090-nvlink", monkeypatch, grad_accum=16)
    assert good.chosen.predicted.scaling_efficiency >= 0.8  # type: ignore[union-attr]
    assert not any("communication" in a for a in good.speed_advice)


def test_mixed_cards_the_slowest_sets_the_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    p = _on("3090+3060", monkeypatch, method="lora")
    pred = p.chosen.predicted
    assert pred is not None and pred.pace_device == "NVIDIA GeForce RTX 3060"
    assert pred.straggler_wait == pytest.approx(1 - 25.6 / 71.0)  # the 3090 waits 64%
    # two cards paced by a 3060 against one 3090 alone: slower than the 3090 by itself
    paced = 2 * 25.6 / 71.0 * pred.compute_seconds / pred.step_seconds
    assert pred.speedup_vs_one_device == pytest.approx(paced) and paced < 0.75
    assert any("sets the pace" in a and "64%" in a for a in p.speed_advice)
    assert any(
        a.startswith("One card with accumulation is faster than both") for a in p.speed_advice
    )


def test_comm_parts_are_the_memory_models_bytes_split_by_collective() -> None:
    hw = parse_gpus_spec("2x80GiB", 64 * GiB)
    for method, dist in [("full", "ddp"), ("full", "zero1"), ("full", "fsdp-grad-op"),
                         ("full", "fsdp-full"), ("lora", "ddp"), ("qlora", "fsdp-full")]:  # fmt: skip
        shape = train_shape(_preset(method=method, distribution=dist, grad_accum=3), hw, method,
                            dist, False)  # fmt: skip
        total = sum(p.bytes_per_step for p in comm_parts(SPEC, shape))
        assert total == pytest.approx(comm_bytes_per_step(SPEC, shape), rel=1e-6), (method, dist)
    # LoRA under FSDP also gathers its frozen base every micro-step (the memory model's bytes
    # count only the adapters' gradients)
    shape = train_shape(_preset(method="lora", distribution="fsdp-full"), hw, "lora",
                        "fsdp-full", False)  # fmt: skip
    parts = {p.name: p.bytes_per_step for p in comm_parts(SPEC, shape)}
    assert parts["all-gather (forward)"] == pytest.approx(0.5 * SPEC.params * 2)


def test_overlap_ddp_hides_all_but_the_last_bucket_zero1_hides_no_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long backward (large micro-batch on a well-linked pair): only DDP's last bucket shows,
    # and it holds the input embeddings (their gradient is the last backward writes): Qwen2
    # 0.5B's 136M embedding parameters, far more than a 25 MiB bucket.
    p = _on("2x3090-nvlink", monkeypatch, micro_batch=8, seq_len=1024)
    pred = p.chosen.predicted
    assert pred is not None
    last_share = SPEC.embedding_params / SPEC.params
    assert SPEC.embedding_params * 4 > 25 * 2**20 and 0.2 < last_share < 0.3
    assert pred.exposed_comm_seconds == pytest.approx(pred.comm_seconds * last_share, rel=0.05)
    # Without P2P (copies through host memory) nothing hides behind backward.
    nop2p = _on("2x3090-nop2p", monkeypatch, micro_batch=8, seq_len=1024).chosen.predicted
    assert nop2p is not None
    assert nop2p.exposed_comm_seconds == pytest.approx(nop2p.comm_seconds)
    z = _on("2x3090-nvlink", monkeypatch, micro_batch=8, seq_len=1024, distribution="zero1")
    zp = z.chosen.predicted
    assert zp is not None
    gather = 0.5 * SPEC.params * 4 / zp.assumptions["link"]["value"]
    assert zp.exposed_comm_seconds == pytest.approx(pred.exposed_comm_seconds + gather, rel=0.02)


def test_the_cpu_overlaps_nothing_and_shares_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu_threads(1) == 8 and cpu_threads(2) == 4 and cpu_threads(16) == 1
    p = make_plan(_preset(method="full"), "cpu:2:16GiB", fetch=False).plan
    pred = p.chosen.predicted
    assert pred is not None and pred.assumptions["threads_per_process"] == 4
    assert pred.exposed_comm_seconds == pytest.approx(pred.comm_seconds)
    # one process with 8 threads computes as fast as two with 4: the two only add the sync
    assert pred.speedup_vs_one_device == pytest.approx(
        pred.compute_seconds / (pred.compute_seconds + pred.comm_seconds)
    )
    assert pred.assumptions["link"]["kind"] == "gloo"


def test_ddp_buckets_overlap_on_cuda_and_are_one_on_the_cpu() -> None:
    # CUDA: DDP's 25 MiB buckets, several for a 0.5B model; the CPU: one bucket holds every
    # gradient, so one all-reduce (one latency) after backward, as the worker wraps DDP
    grads = SPEC.params * 4.0
    assert ddp_bucket_cap("cuda", grads) == 25 * 2**20
    assert ddp_bucket_cap("cpu", grads) >= grads and ddp_bucket_cap("cpu", 1e6) == 25 * 2**20
    shape = train_shape(_preset(method="full"), parse_gpus_spec("2x80GiB", 64 * GiB), "full",
                        "ddp", False)  # fmt: skip
    (cuda,) = comm_parts(SPEC, shape, "cuda")
    (cpu,) = comm_parts(SPEC, shape, "cpu")
    assert cuda.collectives == -(-grads // (25 * 2**20)) > 1 and cpu.collectives == 1
    assert cpu.bytes_per_step == cuda.bytes_per_step and cpu.exposed_share == 1.0


def test_a_measured_speed_replaces_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / "2x3090-nvlink.json"))
    p = make_plan(_preset(), fetch=False).plan
    assert p.chosen.predicted.assumptions["achieved_factor"] == {  # type: ignore[union-attr]
        "value": DEFAULT_GPU_FACTOR, "source": "table",
        "words": "assumed 35% of the card's peak (`homelab-dp measure` calibrates it)"}  # fmt: skip
    doc = p.to_json()
    # the run went at half the predicted speed, 40% of its step exposed communication
    tps = doc["predicted"]["tokens_per_s"] / 2
    step = 1.0
    assert record_speed(doc, tokens_per_s=tps, source="measure", step_seconds=step,
                        compute_seconds=0.6 * step) is not None  # fmt: skip
    again = make_plan(_preset(), fetch=False).plan
    factor = again.chosen.predicted.assumptions["achieved_factor"]  # type: ignore[union-attr]
    assert factor["source"] == "calibrated"
    per_device = tps / 2 * doc["predicted"]["flops_per_token"] / 0.6
    assert factor["value"] == pytest.approx(per_device / 71e12)
    # nothing is recorded for a plan without a fingerprint or made before the time model
    assert record_speed({**doc, "calibration": {"fingerprint": None}}, tokens_per_s=1.0) is None
    old = {k: v for k, v in doc.items() if k != "predicted"}
    assert record_speed(old, tokens_per_s=1.0) is None
    store = SpeedStore()
    assert len(store.records) == 1 and store.path.stat().st_mode & 0o777 == 0o600


def test_an_old_plan_without_the_new_keys_still_reads(tmp_path: Path) -> None:
    run = tmp_path / "old"
    shutil.copytree(DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a", run)
    plan = json.loads((run / "spec.json").read_text(encoding="utf-8"))["plan"]
    assert "predicted" not in plan
    view = view_of(run)
    assert view.predicted is None and view.method == "lora"
    assert record_speed(plan, tokens_per_s=100.0) is None


def test_network_names_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    ten = parse_network("10GbE")
    assert ten.bytes_per_s == pytest.approx(10e9 / 8 * 0.85) and ten.source == "table"
    assert parse_network("40").bytes_per_s == pytest.approx(40e9 / 8 * 0.85)
    assert parse_network("40").source == "given"
    with pytest.raises(HardwareSpecError):
        parse_network("fast")
    rc, out, err = run_cli(capsys, "plan", "--model", str(QWEN), "--gpus", "2x24GiB",
                           "--network", "3GbX")  # fmt: skip
    assert rc == 2 and out == ""
    assert err.startswith("error: --network '3GbX'") and "hint: use e.g. --network 10GbE" in err
    rc, out, _ = run_cli(capsys, "plan", "--model", str(QWEN), "--gpus", "2x24GiB",
                         "--network", "10GbE", "--json")  # fmt: skip
    link = json.loads(out)["predicted"]["assumptions"]["link"]
    assert rc == 0 and link["kind"] == "network" and link["value"] == ten.bytes_per_s


def test_gloo_is_measured_once_and_cached_private(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the session's cache may hold one
    hw = parse_gpus_spec("cpu:2", 8 * GiB)
    assumed = plan_link(hw, None, measure=False)  # nothing cached, nothing measured
    assert assumed.source == "table" and assumed.kind == "gloo"
    doc = gloo_measurement(True)  # the real thing: two gloo processes on this host
    assert doc is not None and doc["bytes_per_s"] > 1e6 and 0 < doc["latency_s"] < 1
    measured = plan_link(hw, None, measure=False)  # the cache answers now
    assert measured.source == "measured" and measured.bytes_per_s == doc["bytes_per_s"]
    host = __import__("socket").gethostname()
    path = gloo_cache_path(host, doc["torch"])
    assert path.is_relative_to(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    write_cached_gloo("h", "1", {"bytes_per_s": 5.0})
    assert read_cached_gloo("h", "1") == {"bytes_per_s": 5.0}


def test_one_cpu_measure_predicts_one_process_and_extrapolates_two(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a made-up gloo figure stays here
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    write_cached_gloo(__import__("socket").gethostname(), torch_version(),
                      {"bytes_per_s": 5e8, "latency_s": 1e-3})  # fmt: skip
    one = make_plan(_cpu_preset(), "cpu:1:8GiB", fetch=False).plan.to_json()
    assert one["predicted"]["assumptions"]["achieved_factor"]["source"] == "table"
    record_speed(one, tokens_per_s=2000.0, source="measure")  # what `measure` found: 2 threads
    again = make_plan(_cpu_preset(), "cpu:1:8GiB", fetch=False).plan.chosen.predicted
    assert again is not None and again.tokens_per_s == pytest.approx(2000.0)
    two = make_plan(_cpu_preset(), "cpu:2:8GiB", fetch=False).plan.chosen.predicted
    assert two is not None and two.assumptions["threads_per_process"] == 1
    assert two.assumptions["link"]["source"] == "measured"
    # each process computes its half with one thread, at the measured 2-thread process's speed
    # ÷ √2 (`CPU_THREAD_SCALING` 0.5 until two thread counts are measured), then all-reduces the
    # fp32 gradients over gloo without overlap, in one bucket (`ddp_bucket_cap`): one latency
    per_token = 1 / 2000.0
    assert two.compute_seconds == pytest.approx(two.tokens_per_step / 2 * per_token * 2**0.5)
    assert SPEC.params * 4 > 25 * 2**20  # on CUDA this would be several buckets
    sync = SPEC.params * 4 / 5e8 + two.assumptions["link"]["latency_s"]
    assert two.comm_seconds == pytest.approx(sync, rel=1e-3)
    assert two.tokens_per_s == pytest.approx(two.tokens_per_step / (two.compute_seconds + sync))
    # once a 2-process run recorded its own (1 thread per process) speed, that is used
    record_speed(make_plan(_cpu_preset(), "cpu:2:8GiB", fetch=False).plan.to_json(),
                 tokens_per_s=3000.0, step_seconds=1.0, compute_seconds=0.5)  # fmt: skip
    after = make_plan(_cpu_preset(), "cpu:2:8GiB", fetch=False).plan.chosen.predicted
    assert after is not None
    assert after.compute_seconds == pytest.approx(after.tokens_per_step / 2 / (3000.0 / 2 / 0.5))


def test_two_thread_counts_measured_fit_how_a_cpu_process_scales_with_threads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 2-process run (1 thread each) measured at 1,500 tokens/s a process after a 1-process
    measure (2 threads) at 2,000: the exponent is fitted, log(1500/2000) / log(1/2) = 0.415, and
    each thread count is priced from its own record."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    write_cached_gloo(__import__("socket").gethostname(), torch_version(),
                      {"bytes_per_s": 5e8, "latency_s": 1e-3})  # fmt: skip
    record_speed(make_plan(_cpu_preset(), "cpu:1:8GiB", fetch=False).plan.to_json(),
                 tokens_per_s=2000.0, source="measure")  # fmt: skip
    two = make_plan(_cpu_preset(), "cpu:2:8GiB", fetch=False).plan
    assert two.chosen.predicted is not None
    assumed = two.chosen.predicted.assumptions["achieved_factor"]["words"]
    assert "^0.50 (assumed)" in assumed  # one thread count: the stated default
    compute = two.chosen.predicted.compute_seconds / 2**0.5 * 2000 / 1500
    record_speed(two.to_json(), tokens_per_s=3000.0, step_seconds=compute, compute_seconds=compute)
    again = make_plan(_cpu_preset(), "cpu:2:8GiB", fetch=False).plan.chosen.predicted
    assert again is not None and again.compute_seconds == pytest.approx(compute, rel=1e-6)
    assert "^0.42 (fitted here)" in again.assumptions["achieved_factor"]["words"]
    one = make_plan(_cpu_preset(), "cpu:1:8GiB", fetch=False).plan.chosen.predicted
    assert one is not None and one.tokens_per_s == pytest.approx(2000.0)


def test_a_run_without_its_communication_measured_leaves_the_predicted_one_out() -> None:
    doc = {"calibration": {"fingerprint": "cpu | x | torch 1"}, "method": "full",
           "distribution": "ddp", "hardware": {"kind": "cpu"}, "model": SPEC.summary(),
           "training": {"world_size": 2, "activation_checkpointing": False},
           "predicted": {"flops_per_token": 1e9, "tokens_per_step": 1000,
                         "exposed_comm_seconds": 0.25, "assumptions": {"threads_per_process": 1}}}  # fmt: skip
    record_speed(doc, tokens_per_s=1000.0)  # a 1.0 s step, 0.25 s of it predicted communication
    (r,) = SpeedStore().records
    assert r.flops_per_s == pytest.approx(1000.0 / 2 * 1e9 / 0.75) and r.threads == 1
    # a prediction of more than half the step takes out half at most
    record_speed({**doc, "predicted": {**doc["predicted"], "exposed_comm_seconds": 0.9}},
                 tokens_per_s=1000.0)  # fmt: skip
    assert SpeedStore().records[-1].flops_per_s == pytest.approx(1000.0 / 2 * 1e9 / 0.5)


@pytest.mark.parametrize("damage", ["{not json", '{"records": 3}', '{"records": [{"x": 1}]}', ""])
def test_a_damaged_speed_file_plans_with_the_default_and_is_rewritten(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, damage: str
) -> None:
    """A torn or foreign speed.json never breaks a plan: it reads as empty (the default rate,
    the problem said), and the next record rewrites it whole and private."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    write_cached_gloo(__import__("socket").gethostname(), torch_version(),
                      {"bytes_per_s": 5e8, "latency_s": 1e-3})  # fmt: skip
    path = SpeedStore().path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(damage, encoding="utf-8")
    store = SpeedStore()
    assert store.records == [] and store.problem and str(path) in store.problem
    doc = make_plan(_preset(), "cpu:1:8GiB", fetch=False).plan.to_json()
    assert doc["predicted"]["assumptions"]["achieved_factor"]["source"] == "table"
    record_speed(doc, tokens_per_s=2000.0, source="measure")
    again = SpeedStore()
    assert again.problem is None and [r.source for r in again.records] == ["measure"]
    assert path.stat().st_mode & 0o777 == 0o600
