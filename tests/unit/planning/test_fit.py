"""The micro-batch finder: largest micro-batch that fits, effective batch kept (or rounded up)."""

from __future__ import annotations

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.planning.batch_shape import accumulation_for
from homelab_dp.planning.micro_batch_search import search_micro_batch
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.planning.plan_hardware import parse_gpus_spec
from homelab_dp.planning.planner import (
    SAFETY_MARGIN,
    evaluate,
    plan,
)
from homelab_dp.planning.planner import plan_largest_micro_batch as plan_finder
from homelab_dp.presets.preset import preset_from_dict
from tests.unit.planning.test_planner import LLAMA3_8B, SMOLLM_135M


def _preset(**train):
    seq_len = train.pop("seq_len", 1024)
    return preset_from_dict(
        {"model": {"path": "m"}, "data": {"path": "d", "seq_len": seq_len}, "train": train}
    )


@pytest.mark.parametrize(
    ("effective", "micro", "world", "accum"),
    [(32, 2, 2, 8), (32, 16, 2, 1), (32, 3, 2, 6), (10, 4, 1, 3), (5, 8, 1, 1)],
)
def test_accumulation_is_the_ceiling(effective: int, micro: int, world: int, accum: int) -> None:
    assert accumulation_for(effective, micro, world) == accum


def test_largest_micro_batch_that_keeps_the_effective_batch() -> None:
    fit = search_micro_batch(lambda m, a: 100 + 10 * m, 175, 32, 2)
    # 7 fits (170 <= 175) but 7 × 2 does not divide 32; 4 is the largest that does.
    assert (fit.micro_batch, fit.grad_accum, fit.fits, fit.exact) == (4, 4, True, True)
    assert fit.effective_batch == 32 and fit.total_bytes == 140 and fit.limit_bytes == 175
    assert fit.larger_inexact == 7
    assert "7 would fit too, but would round the effective batch up to 42" in fit.describe()
    assert [m for m, _, _ in fit.tried] == list(range(1, 17))  # never beyond E / world


def test_rounding_up_when_allowed() -> None:
    fit = search_micro_batch(lambda m, a: 100 + 10 * m, 175, 32, 2, exact=False)
    assert (fit.micro_batch, fit.grad_accum, fit.fits) == (7, 3, True)
    assert fit.effective_batch == 42 and not fit.exact  # ceil(32 / 14) = 3
    assert "rounded up" in fit.describe() and "asked for 32" in fit.describe()


def test_exact_effective_batch_at_the_largest_divisor() -> None:
    fit = search_micro_batch(lambda m, a: 100 + 10 * m, 185, 32, 2)
    assert (fit.micro_batch, fit.grad_accum, fit.effective_batch, fit.exact) == (8, 2, 32, True)
    assert fit.larger_inexact is None and fit.describe().endswith("as the preset asked.")


def test_memory_is_not_monotonic_in_the_micro_batch() -> None:
    # Accumulation keeps every gradient alive (+50); the largest micro-batch needs none.
    fit = search_micro_batch(lambda m, a: 10 * m + (50 if a > 1 else 0), 85, 8, 1)
    assert [ok for _, _, ok in fit.tried] == [True, True, True, False, False, False, False, True]
    assert (fit.micro_batch, fit.grad_accum, fit.exact) == (8, 1, True)


def test_nothing_fits() -> None:
    fit = search_micro_batch(lambda m, a: 1000 + m, 500, 16, 2)
    assert (fit.micro_batch, fit.grad_accum, fit.fits) == (1, 8, False)
    assert fit.total_bytes == 1001 and "not even a micro-batch of 1" in fit.describe()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        search_micro_batch(lambda m, a: 0, 1, 0, 1)


def test_plan_grows_the_micro_batch_and_keeps_the_effective_batch() -> None:
    spec, hw = spec_from_config(SMOLLM_135M), parse_gpus_spec("2x24GiB", 64 * GiB)
    # Effective batch 64 (the chunked loss head leaves room for micro-batch 16 at 1024 tokens).
    preset = _preset(micro_batch=2, grad_accum=16, method="full", distribution="ddp")
    p = plan_finder(spec, preset, hw)
    assert p.fit is not None and p.fit.fits and p.fits
    assert p.micro_batch == p.fit.micro_batch > 2
    assert p.effective_batch == 64 and p.micro_batch * 2 * p.grad_accum == 64
    limit = SAFETY_MARGIN * hw.min_memory
    assert p.chosen.budget.total <= limit
    # The next micro-batch that keeps 64 (32, accumulation 1) does not fit; a larger one that
    # fits only by rounding the batch up is named.
    assert (p.micro_batch, p.grad_accum) == (16, 2)
    c = evaluate(spec, preset, hw, "full", "ddp", p.chosen.activation_checkpointing,
                 micro_batch=32, grad_accum=1)  # fmt: skip
    assert c.budget.total > limit
    assert p.fit.larger_inexact is not None and 16 < p.fit.larger_inexact < 32
    j = p.to_json()
    assert j["micro_batch_finder"]["micro_batch"] == p.micro_batch
    assert j["training"]["effective_batch"] == 64
    assert any(r.startswith("Micro-batch finder:") for r in j["reasons"])


def test_plan_shrinks_the_micro_batch_when_the_preset_does_not_fit() -> None:
    spec, hw = spec_from_config(LLAMA3_8B), parse_gpus_spec("2x24GiB", 64 * GiB)
    # Without offload (with it, QLoRA-FSDP full offloading its parameters fits at 16) and
    # without the tiled MLP (with it, 16 × 2,048 tokens in 8 tiles fit).
    preset = _preset(micro_batch=16, grad_accum=2, method="qlora", seq_len=2048, offload="none",
                     offload_activations=False, tiled_mlp="off")  # fmt: skip
    assert not plan(spec, preset, hw).fits
    p = plan_finder(spec, preset, hw)
    assert p.fits and p.micro_batch < 16
    assert p.effective_batch >= 64 and p.fit is not None
    assert p.fit.exact == (p.effective_batch == 64)


def test_lr_scaling_refers_to_the_asked_batch() -> None:
    spec, hw = spec_from_config(SMOLLM_135M), parse_gpus_spec("3x24GiB", 64 * GiB)
    preset = _preset(micro_batch=2, grad_accum=2, method="full", distribution="ddp",
                     lr=1e-4, lr_scaling="linear", seq_len=512)  # fmt: skip
    p = plan_finder(spec, preset, hw)  # asked 12 on 3 cards: micro-batches 1, 2 and 4 keep it
    assert p.fit is not None and p.fit.exact and p.micro_batch == 4 and p.grad_accum == 1
    assert p.lr.reference_batch == 12 and p.lr.applied == pytest.approx(1e-4)


def test_nothing_fits_even_at_micro_batch_one() -> None:
    spec, hw = spec_from_config(LLAMA3_8B), parse_gpus_spec("4GiB", 64 * GiB)
    p = plan_finder(spec, _preset(micro_batch=4, grad_accum=1), hw)
    assert p.fit is not None and not p.fit.fits and not p.fits
    assert p.micro_batch == 1 and p.grad_accum == 4


def test_plan_command_finds_the_micro_batch(in_repo, capsys) -> None:
    import json

    from homelab_dp.cli import main

    assert main(["plan", "tiny-demo", "--find-micro-batch", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    found = doc["micro_batch_finder"]
    assert doc["training"]["micro_batch"] == found["micro_batch"] == 8  # 16 per step on 2 ranks
    assert doc["training"]["grad_accum"] == found["grad_accum"] == 1
    assert found["exact"] and doc["training"]["effective_batch"] == 16
    assert main(["plan", "tiny-demo", "--json"]) == 0  # without the flag: as the preset says
    plain = json.loads(capsys.readouterr().out)
    assert plain["micro_batch_finder"] is None and plain["training"]["micro_batch"] == 4


def test_run_auto_fit_prepares_the_found_micro_batch(in_repo) -> None:
    """`run --auto-fit` and the TUI's auto-fit: one app function, planned once before the run."""
    from homelab_dp.app.runs import make_controller

    prepared = make_controller().prepare("tiny-demo", overrides=["train.grad_accum=4"],
                                         auto_fit=True)  # fmt: skip
    fit = prepared.fit
    assert fit is not None and (fit.micro_batch, fit.grad_accum) == (16, 1)  # 4 × 2 × 4 = 32
    assert "16 is the largest micro-batch that fits" in fit.describe()
    r = prepared.resolved
    assert (r.micro_batch, r.grad_accum, r.effective_batch) == (16, 1, 32)
    t = prepared.preset.train  # the spec's preset says what the worker runs
    assert (t.micro_batch, t.grad_accum, t.reference_batch) == (16, 1, 0)
