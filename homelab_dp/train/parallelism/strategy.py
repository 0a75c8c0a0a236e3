"""Data-parallel strategies, optimizers and the learning-rate schedule.

- ``ddp``: ``DistributedDataParallel``; gradients all-reduced (averaged) once per optimizer step.
  The gradients are views into DDP's all-reduce buckets (``gradient_as_bucket_view``), so the
  reducer keeps no second copy of them; buffers are not broadcast before every forward (see
  `wrap_model`). On one process there is nothing to reduce: the model is not wrapped at all.
- ``zero1``: DDP plus ``ZeroRedundancyOptimizer`` (optimizer state sharded, ZeRO-1); on one
  process the plain optimizer (nothing to shard).
- ``fsdp-grad-op``: FSDP2 ``fully_shard`` per decoder layer and on the root with
  ``reshard_after_forward=False`` (gradients and optimizer state sharded, ZeRO-2-like).
- ``fsdp-full``: the same with ``reshard_after_forward=True`` (parameters sharded too, ZeRO-3-like).
  Both take the model as ``load_model(sharded=True)`` built it, on the meta device, and shard it
  before any weight exists; `train.model.trainable_model.materialize` then sends each rank its shards from rank 0
  (QLoRA: `train.model.quantized_load.stream_weights` reads, quantizes and sends them tensor by tensor,
  the 4-bit weights being parameters in the compute dtype that FSDP2 shards like any other).
- Offload, FSDP2 only (``Resolved.offload``): "params" is FSDP2's ``CPUOffloadPolicy`` (shards,
  gradients in pinned host memory, each shard rounded up to a power of two by torch's caching
  host allocator, and optimizer state in host memory; AdamW steps on the CPU); "optimizer" keeps
  the shards on the card and the optimizer state and step in host memory
  (`train.parallelism.host_optimizer.HostAdamW`). Activations: `train.loop.rank_setup` wraps the forward in
  `train.parallelism.activation_offload.ActivationOffload`'s saved-tensor hooks
  (``Resolved.offload_activations``).

Every strategy averages gradients over ranks, so the worker multiplies its globally normalised
loss by the world size. On CUDA, FSDP2 computes in bf16/fp16 with fp32 gradient reduction
(``MixedPrecisionPolicy``); DDP keeps fp32 weights and the worker autocasts.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from homelab_dp.errors import HomelabError
from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.time_model import ddp_bucket_cap
from homelab_dp.presets.preset import TrainSection
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.lora import is_experts
from homelab_dp.train.model.loss import router_aux_coef
from homelab_dp.train.model.trainable_model import LoadedModel, compute_dtype, materialize
from homelab_dp.train.parallelism.comm_timing import CommTimer, attach_ddp, attach_fsdp
from homelab_dp.train.parallelism.host_optimizer import HostAdamW
from homelab_dp.vocabulary import SHARDED


@dataclass
class Strategy:
    """A wrapped model and how to accumulate, clip and checkpoint it."""

    kind: str
    """ddp | zero1 | fsdp-grad-op | fsdp-full."""
    model: nn.Module
    """What the forward pass is called on: the DDP wrapper, the fully_shard-ed model, or for
    ddp/zero1 on one process the model itself (no wrapper)."""
    inner: nn.Module
    """The unwrapped Hugging Face / peft model (for FSDP2 the same object as ``model``)."""
    trainable: list[nn.Parameter] = field(default_factory=list)
    grad_accum: int = 1
    """Micro-steps per optimizer step (see `zero_grad`)."""
    offload: str = "none"
    """What lives in host memory (`Resolved.offload`): none | optimizer | params."""
    aux_coef: float = 0.0
    """The MoE router's auxiliary-loss weight (`train.model.loss.router_aux_coef`): 0 for a dense
    model or one whose config does not ask for the aux loss; else every forward returns the
    router logits and `train.loop.training_loop.micro_step` adds ``aux_coef`` × the aux loss."""
    aux_sum: torch.Tensor | None = None
    """The unweighted aux losses of this rank's micro-steps since `take_aux_loss` (detached)."""
    aux_count: int = 0
    comm: CommTimer = field(default_factory=lambda: CommTimer("none", torch.device("cpu")))
    """Times the gradient communication of each optimizer step (`train.parallelism.comm_timing`): DDP's
    bucket all-reduces or FSDP2's gathers and reduce-scatters; reads nothing on one process.
    Its step ends in `zero_grad`; the step log reads it (``comm.read()``)."""

    @property
    def is_fsdp(self) -> bool:
        return self.kind.startswith("fsdp")

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The DDP wrapper, or None (FSDP2, or ddp/zero1 on one process)."""
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    @property
    def grads_in_buckets(self) -> bool:
        """Whether the gradients are views into DDP's buckets (once the first step made them)."""
        ddp = self.ddp
        return ddp is not None and ddp.gradient_as_bucket_view

    @contextlib.contextmanager
    def accumulate(self, final: bool) -> Iterator[None]:
        """Context for one micro-step: gradients are synchronised only on the final one."""
        ddp = self.ddp
        if self.is_fsdp:
            self.model.set_requires_gradient_sync(final)  # type: ignore[operator]
            yield
        elif final or ddp is None:  # one process: nothing to synchronise
            yield
        else:
            with ddp.no_sync():
                yield

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients after an optimizer step.

        Bucket views are zeroed in place: the buckets stay allocated in DDP's reducer whatever
        we do, and a gradient set to None would make the next step's backward (and every
        ``no_sync`` micro-step of an accumulation) allocate a second, fresh copy before the
        reducer copies it into its bucket. One exception without accumulation: until DDP has
        rebuilt its buckets (before the second forward, the third with a static graph) they
        are freed, or the views would keep the old buckets alive beside the new ones (one more
        gradient copy). With accumulation that copy stays (transient, before any activation):
        freed gradients would cost the same copy through a whole accumulation. Any other
        gradient is freed (set to None).
        """
        ddp = self.ddp
        rebuilding = ddp is not None and not getattr(ddp, "_has_rebuilt_buckets", True)
        in_place = self.grads_in_buckets and not (rebuilding and self.grad_accum == 1)
        optimizer.zero_grad(set_to_none=not in_place)
        self.comm.end_step()  # the step's collectives are all done: its records close here

    def unseen_bucket_bytes(self) -> int:
        """Bytes of DDP buckets that no parameter's ``.grad`` shows (for the memory probe).

        Without bucket views the reducer holds one flat copy of every trainable gradient. With
        them the buckets are the gradients, counted as such while every ``.grad`` is set; if
        some are None (before the first step, or after ``zero_grad(set_to_none=True)``), the
        buckets are still alive and unseen. No wrapper, no buckets.
        """
        if self.ddp is None:
            return 0
        if self.grads_in_buckets and all(p.grad is not None for p in self.trainable):
            return 0
        return sum(p.numel() * p.element_size() for p in self.trainable)

    def add_aux(self, aux: torch.Tensor) -> None:
        """Count one micro-step's (detached, unweighted) router aux loss for the log."""
        aux = aux.detach().to(torch.float64)
        self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.aux_count += 1

    def take_aux_loss(self) -> float | None:
        """The mean aux loss of every rank's micro-steps since the last call, then reset; None
        without an aux loss. A collective (one all-reduce) when the model has one: every rank
        calls it at the same point (the step log)."""
        if not self.aux_coef:
            return None
        device = self.aux_sum.device if self.aux_sum is not None else torch.device("cpu")
        both = torch.stack([
            self.aux_sum if self.aux_sum is not None else torch.zeros((), dtype=torch.float64),
            torch.tensor(float(self.aux_count), dtype=torch.float64),
        ]).to(device)  # fmt: skip
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)
        self.aux_sum, self.aux_count = None, 0
        total, count = both.tolist()
        return total / count if count else None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm (before clipping); clips to ``max_norm`` when it is > 0."""
        grads = [p.grad for p in self.trainable if p.grad is not None]
        if not grads:
            return torch.zeros(())
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a partial DTensor, reduce it over ranks
            norm = norm.full_tensor()
        if max_norm > 0:
            params = [p for p in self.trainable if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


def wrap_model(
    loaded: LoadedModel, resolved: Resolved, device: torch.device, grad_accum: int | None = None
) -> Strategy:
    """Wrap the model for ``resolved.distribution`` on an initialised process group.

    ``grad_accum``: the accumulation this process group really runs (another world size than
    the plan's changes it to keep the effective batch); default the plan's.
    """
    model = loaded.model
    kind = resolved.distribution
    accum = resolved.grad_accum if grad_accum is None else grad_accum
    aux = router_aux_coef(model)
    if kind in ("ddp", "zero1"):
        if world_size() == 1:  # nothing to all-reduce: no reducer, no buckets, no hooks
            return Strategy(kind, model, model, _trainable(model), accum, aux_coef=aux)
        ids = [device.index] if device.type == "cuda" else None
        unfused = is_unfused_moe(model)
        wrapped = DistributedDataParallel(
            model,
            device_ids=ids,
            # The gradients live in the all-reduce buckets: no second flat copy of them.
            gradient_as_bucket_view=True,
            # CUDA: 25 MiB buckets that overlap backward; the CPU: one (`ddp_bucket_cap`).
            bucket_cap_mb=ddp_bucket_cap(device.type, _grad_bytes(model)) / 2**20,
            # No buffer broadcast before every forward: the supported families' buffers
            # (rotary inv_freq, Gemma's embed_scale; no running statistics) are computed from
            # the config, identical on every rank, and never change in training.
            **_no_forward_buffer_sync(),
            # Same parameters every iteration. Not with accumulation: torch's static graph
            # queues its first-iteration all-reduce even under no_sync, and the reducer then
            # fails ("expect_autograd_hooks_ INTERNAL ASSERT FAILED", torch 2.13). MoE
            # models too: fused 3-D experts take part in every forward (each layer routes
            # every token somewhere), but a list of expert MLPs (`is_unfused_moe`) leaves
            # the experts no token chose without a gradient, so DDP must look for them.
            static_graph=accum == 1 and not unfused,
            find_unused_parameters=unfused,
        )
        # Before the first backward: DDP's own all-reduce, each bucket's launch and completion
        # marked (`train.parallelism.comm_timing`), read only on logged steps.
        timer = attach_ddp(wrapped, device)
        return Strategy(kind, wrapped, model, _trainable(model), accum, aux_coef=aux, comm=timer)
    if kind not in SHARDED:
        raise HomelabError(f"resolved.distribution: unknown {kind!r}", "use ddp|zero1|fsdp-*")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and resolved.dtype in ("bf16", "fp16"):
        # QLoRA's packed 4-bit weights are stored in this same dtype: the cast leaves them be.
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype(resolved), reduce_dtype=torch.float32)
    # train.offload = "params": the shards, their gradients and the optimizer state in (pinned)
    # host memory, copied to the card for each all-gather; the optimizer steps on the CPU.
    offload = OffloadPolicy()
    if resolved.offload == "params":
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    reshard = kind == "fsdp-full"
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard, "mp_policy": mp,
              "offload_policy": offload}  # fmt: skip
    for layer in loaded.decoder_layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if loaded.on_meta:  # built on meta (`load_model(sharded=True)`): rank 0 sends the shards
        fill = loaded.materializer or materialize
        fill(loaded, device, host_shards=resolved.offload == "params")
    # torch's default gathers and reduce-scatters, marked around each call (`train.parallelism.comm_timing`).
    timer = attach_fsdp([*loaded.decoder_layers, model], device)
    return Strategy(kind, model, model, _trainable(model), accum, offload=resolved.offload,
                    aux_coef=aux, comm=timer)  # fmt: skip


def is_unfused_moe(model: nn.Module) -> bool:
    """Whether ``model`` holds routed experts as separate modules with trainable weights (a
    ModuleList of expert MLPs): an expert no token chose has no gradient in that step."""
    return any(
        is_experts(m)
        and isinstance(m, nn.ModuleList)
        and any(p.requires_grad for p in m.parameters())
        for m in model.modules()
    )


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's switch for the per-forward buffer broadcast: ``forward_sync_buffers`` from torch
    2.13 (``broadcast_buffers`` is deprecated there), ``broadcast_buffers`` before."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: False}


def world_size() -> int:
    """Processes in the default group (1 when none is initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradients DDP all-reduces (the trainable parameters')."""
    return sum(p.numel() * p.element_size() for p in _trainable(model))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _param_groups(strategy: Strategy, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; norms and biases (1-d) are not decayed."""
    if weight_decay == 0:
        return [{"params": strategy.trainable, "weight_decay": 0.0}]
    decay = [p for p in strategy.trainable if p.ndim >= 2]
    other = [p for p in strategy.trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if other:
        groups.append({"params": other, "weight_decay": 0.0})
    return groups


def build_optimizer(
    strategy: Strategy, train: TrainSection, lr: float, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW (fused), bitsandbytes 8-bit AdamW, or SGD with momentum.

    AdamW is torch's fused kernel on CUDA and on the CPU alike: one pass over each parameter and
    no host read of the step count (the foreach path reads every parameter's step with
    ``.item()`` and makes a pass per elementwise op; on the CPU, 4.2M fp32 parameters: 15.8 →
    2.9 ms of CPU time a step, benchmarks/step_profile.py's figures in docs/benchmarks.md).
    ``zero1`` wraps the same optimizer class in ``ZeroRedundancyOptimizer`` (on 2+ processes).
    Offload (FSDP2): with "params" the shards are in host memory, so AdamW is the CPU's (fused
    too: offloading changes no bit of a step); with "optimizer" it is
    `train.parallelism.host_optimizer.HostAdamW`, whose state and step are in host memory while the shards
    stay on the card.
    """
    kwargs: dict[str, Any] = {"lr": lr}
    if strategy.offload != "none" and train.optimizer != "adamw":
        raise HomelabError(
            f"train.optimizer = {train.optimizer!r} cannot run with train.offload = "
            f"{strategy.offload!r}: the offloaded step is AdamW's",
            hint="set train.optimizer = 'adamw', or train.offload = 'none'",
        )
    if train.optimizer == "adamw" and strategy.offload == "optimizer":
        return HostAdamW(_param_groups(strategy, train.weight_decay), lr=lr)
    if train.optimizer == "adamw":
        cls: type = torch.optim.AdamW
        kwargs.update(fused=True)
    elif train.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        if strategy.is_fsdp:
            raise HomelabError(
                "train.optimizer: adamw8bit cannot update FSDP2's sharded (DTensor) parameters",
                hint="use optimizer = 'adamw' with fsdp, or distribution = 'ddp' / 'zero1'",
            )
        cls = bnb.optim.AdamW8bit
    elif train.optimizer == "sgd":
        cls = torch.optim.SGD
        kwargs.update(momentum=0.9, foreach=True)
    else:
        raise HomelabError(f"train.optimizer: unknown {train.optimizer!r}", "adamw|adamw8bit|sgd")
    groups = _param_groups(strategy, train.weight_decay)
    if strategy.kind == "zero1" and world_size() > 1:  # one process: nothing to shard
        from torch.distributed.optim import ZeroRedundancyOptimizer

        first = groups[0]
        zero = ZeroRedundancyOptimizer(
            first["params"], optimizer_class=cls, weight_decay=first["weight_decay"], **kwargs
        )
        for group in groups[1:]:
            zero.add_param_group(group)
        return zero
    return cls(groups, **kwargs)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based).

    Linear warm-up reaching the peak on step ``warmup - 1``, then a cosine decay that reaches
    ``min_ratio`` on the last step.
    """
    if step < warmup:
        return (step + 1) / warmup
    span = total - warmup - 1
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_factor`; stepped once per optimizer step."""
    warmup, ratio = train.warmup_steps, train.min_lr_ratio
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, total_steps, ratio)
    )


def set_lr_for_step(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, step: int
) -> None:
    """Put the schedule's lr for ``step`` into every param group, exactly as LambdaLR computes it.

    A resumed run needs this: loading a scheduler's state does not touch the optimizer's lr.
    """
    scheduler.last_epoch = step
    groups = optimizer.param_groups
    for group, base, fn in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # type: ignore[attr-defined]


class SampleOrder:
    """The global sample order: a permutation of the blocks per epoch, seeded by seed and epoch.

    It never depends on the world size. Position p of the endless stream is block
    ``perm(p // n)[p % n]``; optimizer step i consumes positions [i·E, (i+1)·E).
    """

    def __init__(self, n_blocks: int, seed: int) -> None:
        self.n = n_blocks
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}
        self._lists: dict[int, list[int]] = {}

    def perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._perms = {epoch: torch.randperm(self.n, generator=gen)}  # keep one epoch
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Block indices at stream positions [start, start + count), a 1-D int64 tensor: a
        slice of each epoch's permutation the range touches, no read per position."""
        pieces, p, end = [], start, start + count
        while p < end:
            epoch, at = divmod(p, self.n)
            take = min(end - p, self.n - at)
            pieces.append(self.perm(epoch)[at : at + take])
            p += take
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)

    def blocks(self, start: int, count: int) -> list[int]:
        """Block indices at stream positions [start, start + count)."""
        return self.indices(start, count).tolist()

    def rows(self, start: int, count: int) -> list[int]:
        """`blocks` from each epoch's permutation read to the host once (the training loop's
        block indices, no read a step)."""
        out, p, end = [], start, start + count
        while p < end:
            epoch, at = divmod(p, self.n)
            if epoch not in self._lists:
                self._lists = {epoch: self.perm(epoch).tolist()}  # keep one epoch
            take = min(end - p, self.n - at)
            out += self._lists[epoch][at : at + take]
            p += take
        return out


def rank_slices(step: int, micro: int, world: int, accum: int, rank: int) -> list[range]:
    """Stream positions of each micro-step of ``rank`` in optimizer step ``step``.

    Micro-step k of rank r takes the ``micro`` positions from i·E + (k·W + r)·M: a fixed
    assignment, so the token-normalised loss makes the result independent of W, M and A.
    """
    base = step * BatchShape(micro, world, accum).effective
    return [
        range(base + (k * world + rank) * micro, base + (k * world + rank + 1) * micro)
        for k in range(accum)
    ]
