"""A full fine-tune of a model with a trainable parameter that never gets a gradient resumes.

ERNIE 4.5's MoE router keeps ``e_score_correction_bias`` as a parameter the forward uses
outside autograd: a real AdamW step gives it no state, so the checkpoint holds none, and the
load used to fail on its missing ``optim.….step`` (found by the 2-process stop and resume of the
tiny ernie4_5_moe in tests/integration/test_hybrid_training.py). The real `train.loop.checkpoints`
on one process (DCP in a one-rank gloo group), the tiny ernie4_5_moe of `tests.tiny_hybrids`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from homelab_dp.measure.memcheck import single_rank_group
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.checkpoints import load_checkpoint, save_checkpoint
from homelab_dp.train.model.trainable_model import load_model
from homelab_dp.train.parallelism.strategy import build_optimizer, wrap_model


def _step(strategy: object, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(seed))
    strategy.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # type: ignore[attr-defined]
    optimizer.step()
    optimizer.zero_grad()


def test_a_parameter_without_gradients_resumes_without_optimizer_state(
    tmp_path: Path, tiny_hybrid: Callable[[str], Path]
) -> None:
    preset = preset_from_dict({
        "model": {"path": str(tiny_hybrid("ernie4_5_moe"))},
        "data": {"path": str(tmp_path / "unused.jsonl"), "seq_len": 16},
        "train": {"method": "full", "distribution": "ddp", "micro_batch": 2, "max_steps": 2},
    })  # fmt: skip
    resolved = Resolved(method="full", distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=2, grad_accum=1,
                        lr=1e-2)  # fmt: skip
    cpu = torch.device("cpu")
    with single_rank_group(tmp_path):
        strategy = wrap_model(load_model(preset, resolved, cpu), resolved, cpu)
        optimizer = build_optimizer(strategy, preset.train, resolved.lr, cpu)
        gradless = [n for n, p in strategy.inner.named_parameters() if "e_score" in n]
        assert gradless and all(
            p.requires_grad for n, p in strategy.inner.named_parameters() if n in gradless
        )
        _step(strategy, optimizer, 0)
        path = save_checkpoint(tmp_path / "checkpoints", 1, strategy, optimizer, {"step": 1}, 2)
        _step(strategy, optimizer, 1)
        after = {n: p.detach().clone() for n, p in strategy.inner.named_parameters()}

        fresh = wrap_model(load_model(preset, resolved, cpu), resolved, cpu)
        opt = build_optimizer(fresh, preset.train, resolved.lr, cpu)
        assert load_checkpoint(path, fresh, opt)["step"] == 1
        _step(fresh, opt, 1)
        for n, p in fresh.inner.named_parameters():  # the step the saved run took next
            assert torch.equal(p.detach(), after[n]), n
