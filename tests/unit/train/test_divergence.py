"""A diverging run ends (`homelab_dp.train.loop.divergence`): the fp16 GradScaler's skipped steps
counted with torch's real GradScaler (on the CPU), the loss and weight checks on real tensors.
The run itself ending with an error and its last good checkpoint: tests/integration/
test_divergence.py."""

from __future__ import annotations

import math

import pytest
import torch

from homelab_dp.train.loop.divergence import (
    SKIP_LIMIT,
    NonFiniteError,
    SkippedSteps,
    check_loss,
    require_finite_weights,
    weights_finite,
)


def _step(scaler, model, optimizer, x, skips, step):
    optimizer.zero_grad()
    scaler.scale(model(x).sum()).backward()
    scaler.unscale_(optimizer)
    return skips.step(scaler, optimizer, step)


def test_skips_are_counted_from_the_real_scaler_and_reset_by_a_clean_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    skips = SkippedSteps()
    huge = torch.full((1, 4), 1e35)  # a gradient × 2**12 overflows fp32, × 2**11 does not
    results = [_step(scaler, model, optimizer, huge, skips, s) for s in range(1, 9)]
    assert results == [True] * 5 + [False] * 3  # 2**16 .. 2**12 skipped, halving each time
    assert skips.consecutive == 0 and skips.total == 5 and scaler.get_scale() == 2.0**11
    assert _step(scaler, model, optimizer, huge * 1e3, skips, 9)  # one more skip: a new run
    assert skips.consecutive == 1 and skips.total == 6


def test_a_run_that_overflows_at_every_scale_ends_at_the_limit():
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    skips = SkippedSteps()
    inf = torch.full((1, 4), math.inf)
    for s in range(1, SKIP_LIMIT):
        assert _step(scaler, model, optimizer, inf, skips, s)
    with pytest.raises(NonFiniteError) as err:
        _step(scaler, model, optimizer, inf, skips, SKIP_LIMIT)
    assert f"skipped {SKIP_LIMIT} optimizer steps in a row up to step {SKIP_LIMIT}" in str(
        err.value
    )
    assert "fp16 overflow" in str(err.value) and "bf16" in err.value.hint
    assert err.value.exit_code == 1


def test_the_real_model_in_fp16_with_an_overflowing_forward_is_ended():
    """tiny-llama in fp16 on the CPU under the real GradScaler: a forward that overflows makes
    every step skip; the counter ends it at the limit instead of looping."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.unit.train.test_lean_dtypes import TINY, _residual_outliers

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float16)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    _residual_outliers(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    skips = SkippedSteps(limit=5)  # the same rule, fewer forwards
    ids = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError):
        for s in range(1, 6):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            skips.step(scaler, optimizer, s)
    assert skips.consecutive == 5 and skips.total == 5


def test_loss_check():
    check_loss(2.5, 3, lr=1e-3, dtype="fp32")
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(NonFiniteError) as err:
            check_loss(bad, 7, lr=1e30, dtype="fp32")
        assert "step 7" in err.value.message and "1e+30" in err.value.hint
    with pytest.raises(NonFiniteError) as err:
        check_loss(math.nan, 2, lr=1e-4, dtype="fp16")
    assert "bf16" in err.value.hint


def test_weights_check_on_a_real_model():
    from transformers import AutoModelForCausalLM

    from tests.unit.train.test_lean_dtypes import TINY

    model = AutoModelForCausalLM.from_pretrained(TINY)
    assert weights_finite(model)
    require_finite_weights(model, 4)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = math.nan
    assert not weights_finite(model)
    with pytest.raises(NonFiniteError) as err:
        require_finite_weights(model, 4)
    assert "after step 4" in err.value.message
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)  # frozen: not trained
    assert weights_finite(model)
