"""Lean DDP: gradients are views into the all-reduce buckets, and one process has no wrapper.

Two gloo ranks on the CPU (spawned processes, the project's own load, wrap, optimizer and
micro-step) train the demo model for three steps under the live-tensor probe. The baseline is
the same run wrapped as DDP wraps by default (its reducer keeps a second, flat copy of the
gradients); the lean run's optimizer step must hold one trainable-gradient copy less, its
peak must be lower, and its gradients must tile DDP's buckets exactly. Training equivalence (N ranks == one process) is
`test_equivalence.py`'s; resume across strategies and world sizes is `test_resume.py`'s.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
STEPS, MICRO, SEQ = 3, 2, 32

pytestmark = pytest.mark.slow


def _resolved(world: int, accum: int, distribution: str = "ddp") -> Any:
    from homelab_dp.runs.run_spec import Resolved

    return Resolved(method="full", distribution=distribution, activation_checkpointing=False,  # type: ignore[arg-type]
                    device="cpu", world_size=world, dtype="fp32", micro_batch=MICRO,
                    grad_accum=accum, lr=1e-3)  # fmt: skip


def _preset(folder: Path, accum: int, distribution: str = "ddp") -> Any:
    from homelab_dp.presets.preset import preset_from_dict

    return preset_from_dict({
        "model": {"path": str(DEMO_MODEL)},
        "data": {"path": str(folder / "unused.jsonl"), "seq_len": SEQ},
        "train": {"method": "full", "distribution": distribution, "micro_batch": MICRO,
                  "grad_accum": accum, "max_steps": STEPS},
    })  # fmt: skip


def _bucket_tiling(strategy: Any) -> dict[str, Any]:
    """How the trainable gradients sit in memory: views of which flat buffers, packed how."""
    by_storage: dict[int, list[Any]] = {}
    for p in strategy.trainable:
        by_storage.setdefault(p.grad.untyped_storage().data_ptr(), []).append(p.grad)
    storages = []
    for grads in by_storage.values():
        spans = sorted((g.storage_offset(), g.numel()) for g in grads)
        packed = spans[0][0] == 0 and all(
            a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)
        )
        storages.append({"nbytes": grads[0].untyped_storage().nbytes(),
                         "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
                         "packed": packed,
                         "flat_bases": all(g._base is not None and g._base.dim() == 1
                                           for g in grads)})  # fmt: skip
    return {"params": len(strategy.trainable), "storages": storages}


CONFIGS = [(lean, accum) for accum in (1, 2) for lean in (True, False)]
"""Each rank trains every configuration in turn, in one process group: one spawn for all."""


def _train(root: Path, rank: int, world: int, lean: bool, accum: int) -> dict[str, Any]:
    """One configuration: load, wrap (lean or as DDP defaults), train STEPS steps probed."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from homelab_dp.train.loop.memtrack import MemoryProbe, model_state
    from homelab_dp.train.model.trainable_model import load_model
    from homelab_dp.train.objectives.sft import micro_step
    from homelab_dp.train.parallelism.strategy import Strategy, build_optimizer, wrap_model

    preset, resolved, device = _preset(root, accum), _resolved(world, accum), torch.device("cpu")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + rank)
    shape = (STEPS, accum, MICRO, SEQ)
    ids = torch.randint(0, 2048, shape, generator=gen)
    probe = MemoryProbe(device)  # a fresh probe: it counts only what this configuration makes
    probe.start()
    loaded = load_model(preset, resolved, device)
    probe.track({"weights": list(loaded.model.parameters())})
    if lean:
        strategy = wrap_model(loaded, resolved, device)
    else:  # what DDP does by default (and this project did before)
        model = loaded.model
        trainable = [p for p in model.parameters() if p.requires_grad]
        strategy = Strategy("ddp", DistributedDataParallel(model), model, trainable)
    optimizer = build_optimizer(strategy, preset.train, resolved.lr, device)
    probe.state = lambda: model_state(strategy.inner, optimizer)
    probe.mark("load")
    scale = world / (MICRO * SEQ * accum * world)
    for step in range(STEPS):
        for k in range(accum):
            with strategy.accumulate(final=k == accum - 1):
                x = ids[step, k].clone()
                micro_step(strategy, x, None, x.clone(), scale, autocast=contextlib.nullcontext,
                           loss_dtype=torch.float32, probe=probe)  # fmt: skip
        # As `train.loop.training_loop.optimizer_step` does, with the strategy's zero_grad.
        strategy.clip_grad_norm(1.0)
        optimizer.step()
        strategy.zero_grad(optimizer)
        probe.mark("optimizer")
    probe.stop()
    out = probe.to_json()
    out["trainable_bytes"] = sum(p.numel() * p.element_size() for p in strategy.trainable)
    out["static_graph"] = bool(strategy.ddp.static_graph)
    out["bucket_view"] = bool(strategy.ddp.gradient_as_bucket_view)
    out["unseen_bucket_bytes"] = strategy.unseen_bucket_bytes()
    out["tiling"] = _bucket_tiling(strategy) if lean else None
    out["weights"] = [float(p.detach().double().sum()) for p in strategy.trainable[:4]]
    return out


def _rank(rank: int, world: int, folder: str) -> None:
    """One rank: every configuration of CONFIGS in turn; one JSON file each."""
    import gc

    import torch.distributed as dist

    root = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'pg'}", rank=rank, world_size=world
    )
    for lean, accum in CONFIGS:
        out = _train(root, rank, world, lean, accum)
        name = f"{'lean' if lean else 'default'}-a{accum}-rank{rank}.json"
        (root / name).write_text(json.dumps(out), encoding="utf-8")
        gc.collect()  # the previous configuration's model, DDP buckets and state are gone
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two spawned ranks that trained every configuration (one spawn: imports cost seconds)."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("ddp-lean")
    mp.start_processes(_rank, args=(2, str(folder)), nprocs=2, start_method="spawn")
    return folder


def _results(folder: Path, lean: bool, accum: int, world: int = 2) -> list[dict[str, Any]]:
    name = "lean" if lean else "default"
    return [
        json.loads((folder / f"{name}-a{accum}-rank{r}.json").read_text()) for r in range(world)
    ]


@pytest.mark.parametrize("accum", [1, 2])
def test_two_ranks_grads_are_bucket_views_and_the_peak_drops_by_one_gradient_copy(
    accum: int, trained: Path
) -> None:
    lean, default = _results(trained, True, accum), _results(trained, False, accum)
    for r in lean:
        assert r["bucket_view"] and r["static_graph"] == (accum == 1)
        assert r["unseen_bucket_bytes"] == 0  # every gradient is a bucket view, counted as one
        tiling = r["tiling"]
        # Every gradient is a view of a flat buffer shared with the other gradients of its
        # bucket, packed end to end from offset 0; together they are the trainable bytes, once.
        storages = tiling["storages"]
        assert 1 <= len(storages) < tiling["params"]
        assert all(s["packed"] and s["flat_bases"] for s in storages)
        assert all(s["grad_bytes"] == s["nbytes"] for s in storages)
        assert sum(s["nbytes"] for s in storages) == r["trainable_bytes"]
    for r in default:
        assert not r["bucket_view"]
        assert r["unseen_bucket_bytes"] == r["trainable_bytes"]
    assert lean[0]["weights"] == lean[1]["weights"]  # the ranks stayed in step
    # The same training either way (fp32: the bucket arithmetic differs in rounding only).
    for a, b in zip(lean[0]["weights"], default[0]["weights"], strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))
    grad = lean[0]["trainable_bytes"]
    for a, b in zip(lean, default, strict=True):
        # AdamW's step (weights, gradients, m and v; fused: no temporary) drops by exactly the
        # reducer's second copy of the gradients; the run's peak (backward's, with m and v
        # alive from the first step) drops too, by at most that copy; backward peaks lower.
        opt = b["phases"]["optimizer"]["peak_bytes"] - a["phases"]["optimizer"]["peak_bytes"]
        assert abs(opt - grad) <= 0.01 * grad
        assert 0 < b["peak_bytes"] - a["peak_bytes"] <= 1.01 * grad
        assert a["phases"]["backward"]["peak_bytes"] < b["phases"]["backward"]["peak_bytes"]
        # DDP's one bucket rebuild (second or third forward) leaves no second copy behind.
        fwd = a["phases"]["forward"]["peak_bytes"] - b["phases"]["forward"]["peak_bytes"]
        assert fwd <= 0.01 * grad, fwd
