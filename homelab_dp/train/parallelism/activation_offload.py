"""``train.offload_activations``: the activations saved for backward go to host memory, weights stay.

`torch.autograd.graph.save_on_cpu` copies *every* tensor autograd saves to pinned host memory
and back each micro-step, weights included: the frozen base weights a LoRA layer saves for its
input gradient, FSDP2's gathered parameters (the lm_head's among them), autocast's 16-bit copies
of the trainable weights. Those are on the card anyway (or are gathered/cast again at no PCIe
cost), so copying them only costs PCIe time and pinned host RAM. `ActivationOffload` installs
saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, the idea of torchtune's
``OffloadActivations``) that keep on the card, as autograd saved them:

* parameters (`torch.nn.Parameter`, FSDP2's unsharded ones too) and views of them (linear saves
  ``weight.t()``), and any tensor sharing the storage of a module's parameter or buffer;
* autocast's cast of a trainable parameter (its ``grad_fn`` is the cast of a leaf parameter);
* tensors below `MIN_OFFLOAD_BYTES` (norm statistics, scalars: a copy costs more than it frees);
* tensors that are not plain strided tensors (a DTensor, a sparse or quantized tensor).

Everything else is copied to host memory (pinned on CUDA, so the copy is asynchronous) as it is
saved and copied back to its device when backward unpacks it; a tensor saved again by another
operation of the same forward (a linear's input by the base layer and its LoRA adapter, RoPE's
cos/sin by every layer) reuses its first copy, so each activation crosses PCIe once each way. The planner models the same
split: `homelab_dp.planning.memory.device_memory.budget` counts only the activations as moved.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay where they are (torchtune's default ``min_offload_size``):
per-token statistics of a tiny batch, scalars, shapes."""


class ActivationOffload:
    """Saved-tensor hooks that move a forward's saved activations (not weights) to host memory.

    Use `context` around the forward; the hooks count what they moved (`moved_bytes`), what
    they kept (`kept_bytes`) and the saves that shared a copy (`shared_bytes`) since
    construction.
    """

    def __init__(self, model: nn.Module, *, pin: bool, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.pin = pin
        self.min_bytes = min_bytes
        self.moved_bytes = 0
        self.kept_bytes = 0
        self.shared_bytes = 0
        """Bytes of saves that reused an earlier host copy of the same tensor (not moved)."""
        self._copies: dict[tuple[Any, ...], tuple[StorageWeakRef, weakref.ref]] = {}
        # Storages of the module's parameters and buffers as they are now (DDP, one process,
        # FSDP2's sharded buffers); FSDP2's gathered parameters are new storages each
        # micro-step, caught as `nn.Parameter`s instead.
        self._weights = {
            t.untyped_storage().data_ptr()
            for t in [*model.parameters(), *model.buffers()]
            if type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
        }

    def is_weight(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a parameter, a buffer, a view of one or autocast's cast of one."""
        base = t._base if t._base is not None else t
        if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
            return True
        if t.untyped_storage().data_ptr() in self._weights:
            return True
        fn = base.grad_fn
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            source = fn.next_functions[0][0]
            return isinstance(getattr(source, "variable", None), nn.Parameter)
        return False

    def moves(self, t: torch.Tensor) -> bool:
        """Whether the hooks copy ``t`` to host memory (an activation large enough to matter)."""
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        return not self.is_weight(t)

    def _pack(self, t: torch.Tensor) -> Any:
        n = t.numel() * t.element_size()
        if not self.moves(t):
            self.kept_bytes += n
            return t
        # The same tensor saved again (a linear's input by the base layer and its LoRA adapter,
        # RoPE's cos/sin by every layer) shares the first host copy while that storage lives.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        seen = self._copies.get(key)
        if seen is not None and not seen[0].expired() and (host := seen[1]()) is not None:
            self.shared_bytes += n
            return (t.device, host)
        self.moved_bytes += n
        host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        self._copies[key] = (StorageWeakRef(t.untyped_storage()), weakref.ref(host))
        return (t.device, host)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=self.pin)
        return packed

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Within it, every tensor autograd saves goes through the hooks."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._copies.clear()  # a storage address may hold another tensor next forward
