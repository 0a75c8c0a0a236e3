"""MFU: model FLOPs per token, the cards' 16-bit peaks by name, the event field and its display."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from homelab_dp.planning.flops import (
    causal_span,
    flops_per_token,
    linear_matmul_params,
    mfu,
    peak_flops,
)
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.render.run_view import live_panel, step_line
from homelab_dp.render.runs import status_lines
from homelab_dp.runs.run_events import StepEvent, parse_event
from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec
from homelab_dp.runs.run_view import RunView
from tests.unit.planning.test_model_spec import PUBLISHED

LLAMA3_8B = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])
QWEN2_05B = spec_from_config(PUBLISHED["Qwen2-0.5B"][0])  # tied embeddings


def test_llama3_8b_full_is_6n_plus_the_causal_attention_term() -> None:
    n = linear_matmul_params(LLAMA3_8B)
    # Decoder linears (q, k, v, o, gate, up, down) and the lm_head; the embedding is a lookup.
    assert n == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
    assert n == pytest.approx(7.50e9, rel=1e-3)  # 8.03e9 params less the 0.53e9 embedding
    span = causal_span(2048)
    assert span == 1024.5
    full = flops_per_token(
        LLAMA3_8B, method="full", activation_checkpointing=False, attention_span=span
    )
    attention = 3 * 2 * 2 * 32 * 4096 * 1024.5  # forward and a 2x backward, 32 query heads
    assert full == 6 * n + attention
    # The well-known ~6 x 8e9: 45.0 GFLOP of linears and 1.6 GFLOP of attention at 2k tokens.
    assert full == pytest.approx(46.6e9, rel=0.01)
    assert attention / full == pytest.approx(0.0346, rel=0.01)


def test_lora_skips_the_base_weight_gradient_and_adds_its_adapters() -> None:
    span = causal_span(1024)
    kw = {"activation_checkpointing": False, "attention_span": span}
    full = flops_per_token(LLAMA3_8B, method="full", **kw)
    lora = flops_per_token(LLAMA3_8B, method="lora", lora_r=16, **kw)
    n, adapters = linear_matmul_params(LLAMA3_8B), LLAMA3_8B.lora_params(16)
    attention = 12 * 32 * 4096 * span
    assert lora == 4 * n + 6 * adapters + attention
    assert lora < full and lora / full == pytest.approx(0.675, abs=0.01)
    # QLoRA multiplies dequantized 16-bit weights: the same FLOPs; fewer targets, fewer FLOPs.
    assert flops_per_token(LLAMA3_8B, method="qlora", lora_r=16, **kw) == lora
    q_v = flops_per_token(
        LLAMA3_8B, method="lora", lora_r=16, lora_targets=["q_proj", "v_proj"], **kw
    )
    assert q_v == 4 * n + 6 * LLAMA3_8B.lora_params(16, ["q_proj", "v_proj"]) + attention


def test_checkpointing_recomputes_one_forward_of_the_decoder_layers() -> None:
    span = causal_span(512)
    layers_fwd = 2 * (linear_matmul_params(LLAMA3_8B) - 128256 * 4096)  # not the lm_head
    attn_fwd = 4 * 32 * 4096 * span
    for method, adapters_fwd in (("full", 0), ("lora", 2 * LLAMA3_8B.lora_params(8))):
        off, on = (
            flops_per_token(
                LLAMA3_8B, method=method, activation_checkpointing=ac, attention_span=span, lora_r=8
            )
            for ac in (False, True)
        )
        assert on - off == layers_fwd + attn_fwd + adapters_fwd


def test_tied_embeddings_still_multiply_by_the_vocabulary() -> None:
    assert QWEN2_05B.lm_head_params == 0
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    assert linear_matmul_params(QWEN2_05B) == 24 * per_layer + 151936 * 896


def test_an_unresolved_method_is_refused() -> None:
    with pytest.raises(ValueError, match="auto"):
        flops_per_token(
            LLAMA3_8B, method="auto", activation_checkpointing=False, attention_span=1.0
        )


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A800 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L40", 181.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA RTX A6000", 154.8),
        ("NVIDIA RTX 6000 Ada Generation", 364.2),
        ("NVIDIA GeForce RTX 5090", 209.5),
        ("NVIDIA GeForce RTX 5070 Ti", 87.9),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA GeForce RTX 4070 Ti", 80.2),
        ("NVIDIA GeForce RTX 4070", 58.4),
        ("NVIDIA GeForce RTX 3090", 71.0),
        ("NVIDIA GeForce RTX 3090 Ti", 80.0),
        ("NVIDIA GeForce RTX 2080 Ti", 53.8),
        ("NVIDIA TITAN RTX", 130.5),
        ("Tesla V100-PCIE-32GB", 112.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("Tesla V100S-PCIE-32GB", 130.0),
        ("Tesla T4", 65.0),
        ("Tesla P100-PCIE-16GB", 18.7),
        ("Tesla P40", 11.76),
    ],
)
def test_peak_by_nvml_name(name: str, tflops: float) -> None:
    assert peak_flops(name) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA GeForce RTX 4090 D",  # fewer SMs than a 4090: not its peak
        "NVIDIA GeForce RTX 4070 Ti SUPER",
        "NVIDIA GeForce RTX 3060 Ti",
        "NVIDIA GeForce RTX 4090 Laptop GPU",
        "Quadro RTX 6000",  # Turing, not the RTX 6000 Ada
        "NVIDIA A10",  # not an A100
        "Some Future Card",
        "",
    ],
)
def test_an_unknown_or_variant_card_has_no_peak(name: str) -> None:
    assert peak_flops(name) is None


def test_mfu_is_achieved_over_the_peak_of_every_card() -> None:
    h200 = peak_flops("NVIDIA H200")
    assert mfu(3000.0, 46.6e9, h200, 1) == pytest.approx(3000 * 46.6e9 / 989.5e12)
    assert mfu(3000.0, 46.6e9, h200, 2) == pytest.approx(mfu(3000.0, 46.6e9, h200, 1) / 2)
    assert mfu(3000.0, 46.6e9, None, 1) is None  # the CPU or an unknown card


def test_step_event_round_trip_with_and_without_mfu() -> None:
    e = StepEvent(time=1.0, step=3, tokens_per_s=1000.0, mfu=0.412)
    back = parse_event(json.loads(json.dumps(e.to_json())))
    assert isinstance(back, StepEvent) and back.mfu == 0.412 and back == e
    old = {"type": "step", "time": 1.0, "step": 3, "tokens_per_s": 1000.0}  # before the field
    parsed = parse_event(old)
    assert isinstance(parsed, StepEvent) and parsed.mfu is None and parsed.step == 3


def _view(*steps: dict) -> RunView:
    view = RunView()
    view.apply({"type": "start", "time": 0.0, "run_id": "r", "method": "lora",
                "distribution": "ddp", "total_steps": 10, "world_size": 2})  # fmt: skip
    for s in steps:
        view.apply({"type": "step", "time": 1.0, "total_steps": 10, "tokens_per_s": 5000.0, **s})
    return view


def _panel_text(view: RunView) -> str:
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(live_panel(view))
    return out.getvalue()


def test_a_cpu_run_shows_mfu_na() -> None:
    view = _view({"step": 1, "mfu": None}, {"step": 2})  # the CPU writes null; old lines lack it
    assert view.mfu is None
    assert "tok/s 5,000 samples/s – MFU n/a eta" in step_line(view)
    assert "MFU n/a" in _panel_text(view)


def test_a_cuda_run_shows_its_latest_mfu() -> None:
    view = _view({"step": 1, "mfu": 0.3}, {"step": 2, "mfu": 0.412})
    assert view.mfu == 0.412
    assert "MFU 41%" in step_line(view) and "MFU 41%" in _panel_text(view)
    assert "MFU 4.1%" in step_line(_view({"step": 1, "mfu": 0.0412}))
    # A step without the figure (a resume on a card not in the table) does not keep the old one.
    assert _view({"step": 1, "mfu": 0.412}, {"step": 2}).mfu is None


def test_status_shows_mfu_when_its_document_has_it() -> None:
    doc = {"run_id": "r", "status": "running", "method": "lora", "distribution": "ddp",
           "world_size": 2, "step": 2, "total_steps": 10, "tokens_per_s": 5000.0}  # fmt: skip
    assert "speed     5,000 tokens/s" in status_lines(doc)
    assert "speed     5,000 tokens/s, MFU 41%" in status_lines({**doc, "mfu": 0.412})
    assert "speed     5,000 tokens/s, MFU n/a" in status_lines({**doc, "mfu": None})


# -- the worker's side: train.metrics ------------------------------------------------------------


def test_the_worker_counts_real_tokens_against_the_cards_peak(in_repo: Path) -> None:
    import torch

    from homelab_dp.planning.model_spec import load_model_spec
    from homelab_dp.train.loop.rank_stats import StepFlops, device_peak_flops

    assert device_peak_flops(torch.device("cpu")) is None
    preset = open_preset("tiny-demo", ["lora.r=4"])
    resolved = Resolved("lora", "ddp", True, "cpu", 2, "fp32", 1, 1, 1e-4)
    spec = RunSpec("r", preset, resolved, Launch(nproc_per_node=2))
    flops = StepFlops.for_run(spec, torch.device("cpu"), seq_len=256, world_size=2)
    tiny = load_model_spec(in_repo / "assets/models/tiny-llama")
    assert flops.flops_per_token == flops_per_token(
        tiny, method="lora", activation_checkpointing=True, attention_span=128.5, lora_r=4
    )
    assert flops.peak is None and flops.mfu(100.0) is None  # the CPU: "MFU n/a"
    # On a card: real tokens/s of both ranks, over the peak of both ranks' cards.
    h100 = StepFlops(flops.flops_per_token, peak_flops("NVIDIA H100 PCIe"), 2)
    expected = 100.0 * flops.flops_per_token / (2 * 756.5e12)
    assert h100.mfu(100.0) == pytest.approx(expected) and h100.mfu(None) is None
