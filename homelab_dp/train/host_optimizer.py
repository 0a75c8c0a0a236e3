"""``train.offload = "optimizer"``: AdamW whose state lives, and whose step runs, in host memory.

The card keeps the (sharded) weights and gradients; AdamW's two moments (8 bytes a trainable
parameter, in fp32) and a host copy of the weights (4 bytes) live in host RAM, pinned on CUDA.
Each step copies every gradient and weight to the host (into pinned buffers kept from step to
step on CUDA; on the CPU the gradients' copies live only through the step), runs torch's own
AdamW arithmetic there (``torch.optim.adamw.adamw``, foreach, exactly what
``torch.optim.AdamW(foreach=True)`` computes on the CPU) and copies the updated weights back:
12 bytes a trainable parameter cross PCIe per step, and the card saves the 8 bytes of state
per parameter.

The state has AdamW's own keys (``step``, ``exp_avg``, ``exp_avg_sq``), and for an FSDP2 (DTensor)
parameter each moment is a DTensor of the parameter's placement whose local shard is a host
tensor, as FSDP2's own CPU offload keeps its shards: the DCP checkpoint helpers see an ordinary
AdamW, so a checkpoint loads with or without offload and on another world size.
``load_state_dict`` keeps loaded state in host memory (torch's moves it to the parameter's
device, which would put the whole state on the card at every resume).
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
        self._host_weights: dict[torch.Tensor, torch.Tensor] = {}
        self._host_grads: dict[torch.Tensor, torch.Tensor] = {}
        """Pinned gradient buffers, kept on CUDA (pinning host memory every step is slow)."""

    def _host(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)

    def _state_for(self, p: torch.Tensor, pin: bool) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            local = _local(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = _like(p, self._host(local.shape, local.dtype, pin))
            state["exp_avg_sq"] = _like(p, self._host(local.shape, local.dtype, pin))
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW update of every parameter with a gradient, computed on the host."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            pin = _local(params[0]).device.type == "cuda"
            weights, grads, avgs, avg_sqs, steps = [], [], [], [], []
            for p in params:
                local = _local(p)
                if p not in self._host_weights:
                    self._host_weights[p] = self._host(local.shape, local.dtype, pin)
                host = self._host_weights[p]
                host.copy_(local, non_blocking=True)
                grad = self._host_grads.get(p) if pin else None
                if grad is None:
                    grad = self._host(local.shape, local.dtype, pin)
                    if pin:
                        self._host_grads[p] = grad
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
                weights, grads, avgs, avg_sqs, [], steps, foreach=True, amsgrad=False,
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
