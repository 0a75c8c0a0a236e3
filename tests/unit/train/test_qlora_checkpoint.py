"""A DDP QLoRA checkpoint holds the adapters and their optimizer state, not the frozen 4-bit
quantization state (bitsandbytes' ``weight.absmax``, ``quant_map``, ``nested_*``,
``quant_state.*``), and resumes from them: the real `train.loop.checkpoints` on one process (DCP's
safetensors writer in a one-rank gloo group), the tiny LLaMA quantized by bitsandbytes on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from homelab_dp.measure.memcheck import single_rank_group
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.checkpoints import load_checkpoint, save_checkpoint, shard_files
from homelab_dp.train.model.trainable_model import load_model
from homelab_dp.train.parallelism.strategy import build_optimizer, wrap_model

ROOT = Path(__file__).resolve().parents[3]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
QUANT_WORDS = ("absmax", "quant_map", "nested_", "quant_state")


def _step(strategy: object, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(seed))
    strategy.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # type: ignore[attr-defined]
    optimizer.step()
    optimizer.zero_grad()


def test_ddp_qlora_checkpoint_holds_no_quant_state_and_resumes(tmp_path: Path) -> None:
    preset = preset_from_dict({
        "model": {"path": str(DEMO_MODEL)},
        "data": {"path": str(tmp_path / "unused.jsonl"), "seq_len": 16},
        "train": {"method": "qlora", "distribution": "ddp", "micro_batch": 2, "max_steps": 1},
        "lora": {"r": 8},
    })  # fmt: skip
    resolved = Resolved(method="qlora", distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=2, grad_accum=1,
                        lr=1e-2)  # fmt: skip
    with single_rank_group(tmp_path):
        torch.manual_seed(0)
        loaded = load_model(preset, resolved, torch.device("cpu"))
        strategy = wrap_model(loaded, resolved, torch.device("cpu"))
        optimizer = build_optimizer(strategy, preset.train, resolved.lr, torch.device("cpu"))
        _step(strategy, optimizer, 0)
        path = save_checkpoint(tmp_path / "checkpoints", 1, strategy, optimizer, {"step": 1}, 2)
        keys: list[str] = []
        sizes = shard_files(path)
        for name in sizes:
            with safe_open(str(path / name), "pt") as s:
                keys += list(s.keys())
        assert not [k for k in keys if any(w in k for w in QUANT_WORDS)], keys
        adapters = {n for n, p in strategy.inner.named_parameters() if p.requires_grad}
        assert adapters and all(any(n in k for k in keys) for n in adapters)
        saved = {n: p.detach().clone() for n, p in strategy.inner.state_dict().items()}
        _step(strategy, optimizer, 1)  # moves the adapters and the optimizer state on

        load_checkpoint(path, strategy, optimizer)
        now = strategy.inner.state_dict()
        assert now.keys() == saved.keys()
        for name, value in saved.items():  # adapters back, the 4-bit base untouched
            assert torch.equal(now[name], value), name
        # One step from the checkpoint is the step the saved run took next.
        _step(strategy, optimizer, 1)
        again = {n: p.detach().clone() for n, p in strategy.inner.named_parameters()}
        # A fresh start (the base quantized again) resumes to the same step.
        torch.manual_seed(0)
        fresh = wrap_model(
            load_model(preset, resolved, torch.device("cpu")), resolved, torch.device("cpu")
        )
        opt = build_optimizer(fresh, preset.train, resolved.lr, torch.device("cpu"))
        load_checkpoint(path, fresh, opt)
        _step(fresh, opt, 1)
        for n, p in fresh.inner.named_parameters():
            assert torch.equal(p.detach(), again[n]), n
