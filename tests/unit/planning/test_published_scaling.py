"""The time model against published two-card runs (issue 33 point 4): every case within ±20%.

Each case is a full DDP fine-tune in fp32 that someone ran on one card and on two, with and
without a fast link between them. What the model is given is what a user's machine gives it:
the model, the batch, the cards and their link, and one card's measured speed (the published
one-card time, as `homelab-dp measure` would record it). What it predicts is the two cards'
speed-up over one card, which depends only on the link and overlap constants
(`homelab_dp.planning.links`, `homelab_dp.planning.time_model`). `HOST_BOUNCE_EFFICIENCY` was
fitted on the first no-P2P case (`FITTED`); every other case checks the model. The table with
its predictions is in docs/planning.md ("Checked against published runs").
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning.flops import peak_flops
from homelab_dp.planning.links import pair_link
from homelab_dp.planning.memory.train_shape import TrainShape
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import PlanDevice, PlanHardware
from homelab_dp.planning.speed_calibration import ComputeRate
from homelab_dp.planning.time_model import predict, step_flops_per_token
from homelab_dp.probe.hardware import GpuLink

# transformers' configs of the released GPT-2 checkpoints (the fields the planner reads).
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
        "n_positions": 1024}  # fmt: skip
GPT2_MEDIUM = {**GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16}

STAS = "https://github.com/huggingface/transformers/issues/9371 (stas00, 2021-01-26)"
MOYIX = "https://github.com/huggingface/transformers/issues/9371 (moyix, 2021-01-27)"
TITAN = ("TITAN RTX", (7, 5), (3, 16), 2)  # name, compute capability, PCIe, NVLink links
RTX3090 = ("NVIDIA GeForce RTX 3090", (8, 6), (4, 16), 4)


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: dict
    card: tuple[str, tuple[int, int], tuple[int, int], int]
    nvlink: bool
    """False: neither NVLink nor P2P (NCCL_P2P_DISABLE=1, or a GeForce pair without bridge)."""
    micro_batch: int
    seq_len: int
    one_card_step_s: float
    """One card's seconds per step of ``micro_batch`` × ``seq_len`` (the published time)."""
    speedup: float
    """Two cards' tokens/s ÷ one card's, from the published times."""


# run_clm.py, per_device_train_batch_size 4, fp32. stas00: 200 steps on one card (102 s) and
# on each of two (101 s with NVLink, 131 s with NCCL_P2P_DISABLE=1), block 1024. moyix: 400
# steps on one card, 200 on each of two (the same samples), blocks 256 and 512 (train_runtime
# in seconds: one card, DDP, DDP without NVLink).
CASES = [
    Published("2× TITAN RTX, NVLink, GPT-2 124M, 4×1024", STAS, GPT2, TITAN, True, 4, 1024,
              102 / 200, 2 * 102 / 101),
    Published("2× TITAN RTX, no P2P, GPT-2 124M, 4×1024", STAS, GPT2, TITAN, False, 4, 1024,
              102 / 200, 2 * 102 / 131),
    Published("2× RTX 3090, NVLink, GPT-2 124M, 4×512", MOYIX, GPT2, RTX3090, True, 4, 512,
              58.0856 / 400, 58.0856 / 32.3616),
    Published("2× RTX 3090, no NVLink, GPT-2 124M, 4×512", MOYIX, GPT2, RTX3090, False, 4, 512,
              58.0856 / 400, 58.0856 / 49.1999),
    Published("2× RTX 3090, NVLink, GPT-2 124M, 4×256", MOYIX, GPT2, RTX3090, True, 4, 256,
              30.423 / 400, 30.423 / 18.6943),
    Published("2× RTX 3090, no NVLink, GPT-2 124M, 4×256", MOYIX, GPT2, RTX3090, False, 4, 256,
              30.423 / 400, 30.423 / 35.4208),
    Published("2× RTX 3090, NVLink, GPT-2 355M, 4×512", MOYIX, GPT2_MEDIUM, RTX3090, True, 4,
              512, 152.6255 / 400, 152.6255 / 82.1935),
    Published("2× RTX 3090, no NVLink, GPT-2 355M, 4×512", MOYIX, GPT2_MEDIUM, RTX3090, False,
              4, 512, 152.6255 / 400, 152.6255 / 124.1163),
    Published("2× RTX 3090, NVLink, GPT-2 355M, 4×256", MOYIX, GPT2_MEDIUM, RTX3090, True, 4,
              256, 79.6724 / 400, 79.6724 / 47.7543),
    Published("2× RTX 3090, no NVLink, GPT-2 355M, 4×256", MOYIX, GPT2_MEDIUM, RTX3090, False,
              4, 256, 79.6724 / 400, 79.6724 / 89.3616),
]  # fmt: skip
FITTED = CASES[1].name
TOLERANCE = 0.20


def predicted_speedup(case: Published) -> float:
    """The time model's two-card speed-up for ``case``, given one card's published speed."""
    spec = spec_from_config(case.model)
    shape = TrainShape(method="full", distribution="ddp", world_size=2, device="cuda",
                       dtype="fp32", micro_batch=case.micro_batch, seq_len=case.seq_len)  # fmt: skip
    name, capability, pcie, links = case.card
    card = PlanDevice(name, 24 * GiB, capability, pcie_gen=pcie[0], pcie_width=pcie[1])
    hw = PlanHardware("cuda", (card, card), source="published")
    pair = (
        GpuLink(0, 1, "nvlink", nvlink_links=links, p2p=True)
        if case.nvlink
        else GpuLink(0, 1, "pcie", p2p=False)
    )
    link = pair_link(pcie, pcie, capability, pair)
    assert link.kind == ("nvlink" if case.nvlink else "host-bounce")
    # One card's measured rate, as a calibration records it: model FLOP/s ÷ the card's peak.
    peak = peak_flops(name)
    assert peak is not None
    flops = step_flops_per_token(spec, shape) * case.micro_batch * case.seq_len
    factor = flops / case.one_card_step_s / peak
    rate = ComputeRate(factor, None, "calibrated", "one card's published time")
    pred = predict(spec, shape, hw, link=link, rate=rate)
    # the calibration reproduces the one card's time: only the communication is predicted
    assert pred.compute_seconds == pytest.approx(case.one_card_step_s)
    return pred.speedup_vs_one_device


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_time_model_meets_a_published_two_card_run(case: Published) -> None:
    got = predicted_speedup(case)
    error = got / case.speedup - 1
    print(f"\n{case.name}: published ×{case.speedup:.2f}, predicted ×{got:.2f} ({error:+.0%})")
    assert abs(error) <= TOLERANCE, (case.name, case.speedup, got)


def test_the_cases_hold_both_links_on_both_rigs_and_check_more_than_they_fit() -> None:
    assert len(CASES) >= 5 and len({c.name for c in CASES}) == len(CASES)
    assert {(c.card[0], c.nvlink) for c in CASES} == {
        (card[0], nvlink) for card in (TITAN, RTX3090) for nvlink in (True, False)
    }
    assert sum(c.name != FITTED for c in CASES) >= 4
