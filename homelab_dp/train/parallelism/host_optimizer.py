"""``train.offload = "optimizer"``: AdamW whose state lives, and whose step runs, in host memory.

The card keeps the (sharded) weights and gradients; AdamW's two moments (8 bytes a trainable
parameter, in fp32) and a host copy of the weights (4 bytes) live in host RAM, pinned on CUDA.
Each step copies every gradient and weight to the host (into pinned buffers kept from step to
step on CUDA; on the CPU the gradients' copies live only through the step), runs torch's own
AdamW arithmetic there (``torch.optim.adamw.adamw``, fused, exactly what
``torch.optim.AdamW(fused=True)`` computes on the CPU) and copies the updated weights back:
12 bytes a trainable parameter cross PCIe per step, and the card saves the 8 bytes of state
per parameter.

The state has AdamW's own keys (``step``, ``exp_avg``, ``exp_avg_sq``), and for an FSDP2 (DTensor)
parameter each moment is a DTensor of the parameter's placement whose local shard is a host
tensor, as FSDP2's own CPU offload keeps its shards: the DCP checkpoint helpers see an ordinary
AdamW, so a checkpoint loads with or without offload and on another world size.
``load_state_dict`` keeps loaded state in host memory (torch's moves it to the parameter's
device, which would put the whole state on the card at every resume).

Each kind of host tensor (the weights' copy, the gradients' copy, ``exp_avg``, ``exp_avg_sq``) is
one flat buffer per dtype, each parameter's tensor a view of it: torch's caching host allocator
rounds every pinned allocation up to a power of two, so four pinned tensors per parameter could
pin up to twice their bytes, tensor by tensor; one buffer per kind rounds once, as the planner
counts it (`homelab_dp.planning.memory.pinned_memory.host_adamw_pinned_bytes`).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain
from typing import Any

import torch
from torch.optim.adamw import adamw


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` (this rank's part) wrapped as ``param`` is: a DTensor of the same placement."""
    if not hasattr(param, "to_local"):
        return host
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(host, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())  # fmt: skip


class HostAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's defaults) stepping in host memory."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._views: dict[str, dict[torch.Tensor, torch.Tensor]] = {}
        """Per kind ("weights", "grads", "exp_avg", "exp_avg_sq"): each parameter's view of the
        kind's flat host buffer. The gradients' are kept only on CUDA (pinning every step is
        slow); on the CPU they live through the step."""

    def _flat(self, kind: str, pin: bool) -> dict[torch.Tensor, torch.Tensor]:
        """One zeroed host buffer per dtype for ``kind``, as views shaped like each trainable
        parameter's local tensor (made on first use, for every parameter of every group)."""
        if kind in self._views:
            return self._views[kind]
        params = list(
            dict.fromkeys(p for g in self.param_groups for p in g["params"] if p.requires_grad)
        )
        views: dict[torch.Tensor, torch.Tensor] = {}
        for dtype in dict.fromkeys(_local(p).dtype for p in params):
            mine = [p for p in params if _local(p).dtype == dtype]
            flat = torch.zeros(
                sum(_local(p).numel() for p in mine), dtype=dtype, device="cpu", pin_memory=pin
            )
            offset = 0
            for p in mine:
                local = _local(p)
                views[p] = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
        if kind != "grads" or pin:
            self._views[kind] = views
        return views

    def _state_for(self, p: torch.Tensor, pin: bool) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = _like(p, self._flat("exp_avg", pin)[p])
            state["exp_avg_sq"] = _like(p, self._flat("exp_avg_sq", pin)[p])
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW update of every parameter with a gradient, computed on the host."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not with_grad:
            return loss
        pin = _local(with_grad[0]).device.type == "cuda"
        host_weights, host_grads = self._flat("weights", pin), self._flat("grads", pin)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            weights, grads, avgs, avg_sqs, steps = [], [], [], [], []
            for p in params:
                host, grad = host_weights[p], host_grads[p]
                host.copy_(_local(p), non_blocking=True)
                grad.copy_(_local(p.grad), non_blocking=True)
                state = self._state_for(p, pin)
                weights.append(host)
                grads.append(grad)
                avgs.append(_local(state["exp_avg"]))
                avg_sqs.append(_local(state["exp_avg_sq"]))
                steps.append(state["step"])
            if pin:
                torch.cuda.current_stream().synchronize()  # the copies have landed
            beta1, beta2 = group["betas"]
            adamw(
                weights, grads, avgs, avg_sqs, [], steps, fused=True, amsgrad=False,
                beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False,
            )  # fmt: skip
            for p, host in zip(params, weights, strict=True):
                _local(p).copy_(host, non_blocking=True)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (an AdamW's, offloaded or not), keeping the state on the host."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        ids = chain.from_iterable(g["params"] for g in saved_groups)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(ids, params, strict=True))
        state: dict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for key, value in state_dict["state"].items():
            p = by_id[key]
            pin = _local(p).device.type == "cuda"
            mine = self._state_for(p, pin)
            for name, loaded in value.items():
                if name == "step":
                    mine["step"] = torch.as_tensor(float(loaded), dtype=torch.float32)
                elif loaded is not mine[name]:
                    _local(mine[name]).copy_(_local(loaded))
            state[p] = mine
        groups = [
            {**saved, "params": group["params"]}
            for group, saved in zip(self.param_groups, saved_groups, strict=True)
        ]
        self.__setstate__({"state": state, "param_groups": groups})
