"""The NF4 quantization a QLoRA base is trained on, and evaluated, chatted with and served on.

One definition for the worker (`train/`) and the replicas (`serving/replica/`), which may not
import each other: the same quantization on both sides is what makes `eval` of a QLoRA result
give the run's own eval loss (the adapter was trained against exactly this base).

**Fused experts** (`quantize_experts`: the worker's QLoRA load, and eval, chat and serving of a
QLoRA MoE result alike, so that the base a result is evaluated and served on is the base it
trained on):

bitsandbytes' ``Linear4bit`` replaces ``nn.Linear`` only, but transformers 5 stores a MoE
layer's routed experts as 3-D parameters of one module (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``; gpt-oss transposed, with biases) — nearly all of a MoE model's
weights. `quantize_experts` quantizes them with bitsandbytes' own ``quantize_4bit`` (NF4, double
quantization, the blocksize ``Linear4bit`` uses: `nf4_quantization.nf4_settings`), one expert at
a time, so that one expert can be dequantized alone. Each 3-D weight becomes:

- ``<name>_nf4``: a frozen parameter ``[E, packed]`` (two 4-bit values a byte, viewed as the
  storage dtype: uint8, or the compute dtype under FSDP2 so that it shards like the rest);
- buffers ``<name>_absmax [E, blocks]`` (uint8, the double-quantized block scales),
  ``<name>_absmax2 [E, blocks/256]`` and ``<name>_offset [E]`` (float32, their statistics),
  and the two code books ``<name>_code`` (NF4, 16) and ``<name>_code2`` (256), shared by all
  experts (bitsandbytes' tables: the same for every tensor).

Biases stay 16-bit parameters. The experts' forward is transformers' own dispatch
(``config._experts_implementation``): `quantize_experts` registers ``homelab_nf4`` in
``ALL_EXPERTS_FUNCTIONS``, which runs the same math as transformers' grouped implementation
(gate, activation, routing weights, the deterministic per-token sum) but dequantizes only the
experts the micro-batch routes to, in the compute dtype, a group of them per bitsandbytes call
(`dequant_group_size`: as many as 1 Mi values hold, at least one; the plan counts the group).
The rows are gathered once a layer in expert order and each expert's matmul reads its slice.
The matmul is a custom autograd function that saves nothing: like bitsandbytes' ``MatMul4Bit``
it dequantizes each group again in backward, so no dequantized weight outlives its matmul, and
the frozen weights get no gradient while the input does (LoRA upstream needs it). One host
sync a layer remains (the per-expert row counts; `nf4_experts_forward` says why).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import BitsAndBytesConfig


def nf4_config(
    compute: torch.dtype,
    storage: torch.dtype | None = None,
    *,
    skip_modules: Sequence[str] | None = None,
) -> BitsAndBytesConfig:
    """QLoRA's quantization: NF4 with double quantization, computing in ``compute``; packed
    weights stored as ``storage`` (uint8 by default; the compute dtype under FSDP2, so that it
    shards them as parameters of that dtype). ``skip_modules``: what the family keeps 16-bit
    (``planning.model_layers.nf4_skip_modules(model_type)``, the rule the plan counts by; None:
    transformers' defaults); the worker and the replicas pass the same, so a QLoRA result is
    evaluated and served on the base it was trained on."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage or torch.uint8,
        llm_int8_skip_modules=list(skip_modules) if skip_modules is not None else None,
    )


def folder_model_type(folder: str | Path) -> str:
    """The ``model_type`` of the model folder's config.json ("" when it cannot be read)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else ""


NF4_BLOCKSIZE = 64
"""Values per absmax block: bitsandbytes' default, which ``Linear4bit`` (as ``from_pretrained``
with `nf4_config` makes it) quantizes with; `BitsAndBytesConfig` has no field for it."""

NESTED_BLOCKSIZE = 256
"""absmax values per block of the double quantization (bitsandbytes' ``quantize_4bit`` fixes it)."""


def nf4_settings() -> dict[str, Any]:
    """The quantization `nf4_config` asks of bitsandbytes, as ``quantize_4bit`` arguments
    (``nested_blocksize`` only described: bitsandbytes applies it itself)."""
    config = nf4_config(torch.float32)
    return {
        "quant_type": config.bnb_4bit_quant_type,
        "compress_statistics": config.bnb_4bit_use_double_quant,
        "blocksize": NF4_BLOCKSIZE,
        "nested_blocksize": NESTED_BLOCKSIZE,
    }


@functools.cache
def nf4_works(device_type: str) -> bool:
    """Whether bitsandbytes quantizes to NF4 and back on ``device_type`` (cpu | cuda): a tiny
    tensor is tried, so a bitsandbytes without kernels for this device answers False."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        # bitsandbytes is optional where nothing is quantized: imported only when asked.
        import bitsandbytes.functional as bnbf

        x = torch.ones(64, 64, device=device_type)
        packed, state = bnbf.quantize_4bit(x, quant_type="nf4")
        back = bnbf.dequantize_4bit(packed, state)
    except (ImportError, RuntimeError, NotImplementedError, AttributeError, ValueError):
        return False
    return bool(torch.allclose(back.float(), x.float()))


EXPERTS_IMPLEMENTATION = "homelab_nf4"
"""The name `quantize_experts` registers in transformers' ``ALL_EXPERTS_FUNCTIONS``."""

FUSED_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
"""The 3-D weights of transformers' experts modules (``up_proj`` where there is no gate)."""

_STATE_SUFFIXES = ("absmax", "absmax2", "offset", "code", "code2")


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (``use_experts_implementation``)
    holding its experts as 3-D weights, or one `quantize_experts` already quantized."""
    if not hasattr(module, "is_transposed") or not hasattr(module, "_is_expert_parallel"):
        return False
    return any(
        (name in module._parameters and module._parameters[name].ndim == 3)
        or f"{name}_nf4" in module._parameters
        for name in FUSED_WEIGHTS
    )


def quantized_bytes_per_expert(rows: int, cols: int, storage: torch.dtype = torch.uint8) -> int:
    """Bytes one quantized ``rows x cols`` expert weight holds: packed values (padded to the
    storage dtype), uint8 absmax a 64-block, float32 absmax statistics a 256-absmax block and
    its float32 offset (the code books, shared, not counted)."""
    s = nf4_settings()
    n = rows * cols
    packed = -(-n // 2)
    packed = -(-packed // storage.itemsize) * storage.itemsize
    blocks = -(-n // s["blocksize"])
    blocks2 = -(-blocks // s["nested_blocksize"])
    return packed + blocks + 4 * blocks2 + 4


def quantize_experts(
    model: nn.Module, compute_dtype: torch.dtype, storage: torch.dtype | None = None
) -> int:
    """Replace every fused experts module's 3-D weights by frozen NF4 storage (see the module
    docstring) and route the experts' forward to ``homelab_nf4``. The weights are quantized on
    the device they are on, from their values cast to ``compute_dtype``, the dtype they are
    dequantized to. ``storage``: the packed values' dtype (uint8 by default).

    Returns the number of weight values quantized (the logical parameters: the packed
    parameters hold two a byte), 0 for a model without fused experts.
    Raises ValueError for an expert-parallel module (not supported).
    """
    register_experts_implementation()
    total = 0
    for module in model.modules():
        if not is_fused_experts(module):
            continue
        if module._is_expert_parallel:
            raise ValueError(
                f"{type(module).__name__}: 4-bit experts under expert parallelism (not "
                "supported: use train.method = 'lora' for an expert-parallel model)"
            )
        for name in FUSED_WEIGHTS:
            weight = module._parameters.get(name)
            if weight is None or weight.ndim != 3:
                continue
            total += weight.numel()
            _quantize_weight(module, name, weight.detach(), compute_dtype, storage or torch.uint8)
    return total


def quantize_expert_tensor(
    weight: torch.Tensor, compute: torch.dtype, storage: torch.dtype = torch.uint8
) -> dict[str, torch.Tensor]:
    """NF4 storage of a 3-D weight ``[E, A, B]``, expert by expert, on its device: ``nf4``
    (``[E, packed]`` of ``storage``) and the quantization state (``absmax``, ``absmax2``,
    ``offset``, ``code``, ``code2``: the module docstring), from its values cast to ``compute``."""
    import bitsandbytes.functional as bnbf

    s = nf4_settings()
    packed, absmax, absmax2, offset = [], [], [], []
    state = None
    for e in range(weight.shape[0]):
        q, state = bnbf.quantize_4bit(
            weight[e].to(compute).contiguous(),
            blocksize=s["blocksize"],
            compress_statistics=s["compress_statistics"],
            quant_type=s["quant_type"],
            quant_storage=storage,
        )
        packed.append(q.reshape(-1))
        absmax.append(state.absmax)
        absmax2.append(state.state2.absmax)
        offset.append(state.offset.reshape(()).float())
    if state is None:
        raise ValueError("a fused expert weight with no experts")
    return {"nf4": torch.stack(packed), "absmax": torch.stack(absmax),
            "absmax2": torch.stack(absmax2), "offset": torch.stack(offset),
            "code": state.code, "code2": state.state2.code}  # fmt: skip


def expert_state_shapes(
    logical: tuple[int, ...], storage: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each tensor `quantize_expert_tensor` makes of a ``logical`` weight
    ``(E, A, B)`` (what a model built on the meta device registers before the weights come)."""
    s = nf4_settings()
    experts, n = logical[0], logical[1] * logical[2]
    blocks = -(-n // s["blocksize"])
    return {
        "nf4": ((experts, (n + 1) // (2 * storage.itemsize)), storage),
        "absmax": ((experts, blocks), torch.uint8),
        "absmax2": ((experts, -(-blocks // s["nested_blocksize"])), torch.float32),
        "offset": ((experts,), torch.float32),
        "code": ((16,), torch.float32),
        "code2": ((256,), torch.float32),
    }


def install_expert_tensors(
    module: nn.Module,
    name: str,
    tensors: dict[str, torch.Tensor],
    logical: tuple[int, ...],
    compute: torch.dtype,
) -> None:
    """Put `quantize_expert_tensor`'s ``tensors`` on ``module`` in place of its 3-D ``name``:
    a frozen parameter ``<name>_nf4`` and non-persistent buffers for the state."""
    module._parameters.pop(name, None)
    module.register_parameter(f"{name}_nf4", nn.Parameter(tensors["nf4"], requires_grad=False))
    module.get_parameter(f"{name}_nf4").nf4_logical_shape = tuple(logical)
    for key in _STATE_SUFFIXES:
        module.register_buffer(f"{name}_{key}", tensors[key], persistent=False)
    shapes = getattr(module, "nf4_shapes", {})
    shapes[name] = (tuple(logical[1:]), compute)
    module.nf4_shapes = shapes
    # Kept on the module too: FSDP2 replaces the parameter (and its attributes) by a DTensor.
    module.nf4_logical = {**getattr(module, "nf4_logical", {}), name: tuple(logical)}
    module.nf4_compute_dtype = compute
    module.config._experts_implementation = EXPERTS_IMPLEMENTATION


def _quantize_weight(
    module: nn.Module, name: str, weight: torch.Tensor, compute: torch.dtype, storage: torch.dtype
) -> None:
    """Quantize ``weight [E, A, B]`` expert by expert onto ``module`` (and drop it)."""
    tensors = quantize_expert_tensor(weight, compute, storage)
    install_expert_tensors(module, name, tensors, tuple(weight.shape), compute)


def pack_experts_on_meta(model: nn.Module, compute: torch.dtype, storage: torch.dtype) -> int:
    """`quantize_experts` for a model on the meta device: every fused 3-D weight replaced by
    empty (meta) NF4 storage of the shapes quantization will give, for FSDP2 to shard before
    the values come (`train.model.quantized_load.stream_weights`). Returns the values to come."""
    register_experts_implementation()
    total = 0
    for module in model.modules():
        if not is_fused_experts(module):
            continue
        for name in FUSED_WEIGHTS:
            weight = module._parameters.get(name)
            if weight is None or weight.ndim != 3:
                continue
            total += weight.numel()
            meta = {key: torch.empty(shape, dtype=dtype, device="meta")
                    for key, (shape, dtype) in expert_state_shapes(weight.shape, storage).items()}  # fmt: skip
            install_expert_tensors(module, name, meta, tuple(weight.shape), compute)
    return total


def dequantize_expert(module: nn.Module, name: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s weight ``name`` as bitsandbytes dequantizes it, in the compute dtype."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    s = nf4_settings()
    shape, dtype = module.nf4_shapes[name]
    packed = module.get_parameter(f"{name}_nf4")[expert]
    nested = QuantState(
        absmax=getattr(module, f"{name}_absmax2")[expert],
        code=getattr(module, f"{name}_code2"),
        blocksize=s["nested_blocksize"],
        dtype=torch.float32,
    )
    state = QuantState(
        absmax=getattr(module, f"{name}_absmax")[expert],
        shape=torch.Size(shape),
        code=getattr(module, f"{name}_code"),
        blocksize=s["blocksize"],
        quant_type=s["quant_type"],
        dtype=dtype,
        offset=getattr(module, f"{name}_offset")[expert],
        state2=nested,
    )
    return bnbf.dequantize_4bit(packed.view(torch.uint8).reshape(-1, 1), state)


def dequantize_experts(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantized 3-D weight of ``module``, whole, dequantized (tests and export)."""
    return {
        name: torch.stack([dequantize_expert(module, name, e) for e in range(shape_e)])
        for name in module.nf4_shapes
        for shape_e in [module.get_parameter(f"{name}_nf4").shape[0]]
    }


DEQUANT_GROUP_ELEMENTS = 1 << 20
"""Elements of routed experts' weights dequantized together in one call (at least one expert):
1 Mi values, 2 MiB in bf16. Measured on the CPU (`benchmarks/nf4_experts.py`, docs/benchmarks.md):
groups of 1 Mi values ran a layer fastest, 512 Ki and 2 Mi slower, 16 Mi slower than one expert
at a time (the group no longer stays in cache). Experts as large as Qwen3-30B-A3B's (3 Mi
values) are dequantized one at a time as before; small experts, whose per-call overhead
dominates, in groups. The plan counts the same
(`homelab_dp.planning.memory.moe_memory.DEQUANT_GROUP_ELEMENTS`, a test keeps them equal)."""


def dequant_group_size(module: nn.Module, name: str) -> int:
    """How many of ``module``'s experts `nf4_experts_forward` dequantizes ``name`` of at once:
    as many as `DEQUANT_GROUP_ELEMENTS` holds, at least one, at most all of them. One where a
    row of the weight does not fill whole absmax blocks: bitsandbytes' CPU kernel then gives a
    concatenation of experts other values than each expert alone (measured: rows of 48)."""
    (rows, cols), _ = module.nf4_shapes[name]
    n = rows * cols
    if cols % NF4_BLOCKSIZE:
        return 1
    experts = module.get_parameter(f"{name}_nf4").shape[0]
    return max(1, min(experts, DEQUANT_GROUP_ELEMENTS // n))


def dequantize_expert_group(module: nn.Module, name: str, experts: list[int]) -> torch.Tensor:
    """Experts ``experts``' weights ``name`` as one ``[k, A, B]`` tensor in the compute dtype,
    bit for bit what `dequantize_expert` gives each, in one bitsandbytes call: their packed
    codes and block scales are gathered and concatenated (each expert's values fill whole
    64-value blocks: `dequant_group_size`), the double quantization of the scales undone here
    as bitsandbytes undoes it (``code2[absmax] * absmax2 + offset``, float32)."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.functional import QuantState

    if len(experts) == 1 and dequant_group_size(module, name) == 1:
        return dequantize_expert(module, name, experts[0]).unsqueeze(0)
    s = nf4_settings()
    shape, dtype = module.nf4_shapes[name]
    packed_all = module.get_parameter(f"{name}_nf4")
    idx = torch.tensor(experts, device=packed_all.device)
    packed = packed_all.index_select(0, idx).view(torch.uint8)
    codes = getattr(module, f"{name}_absmax").index_select(0, idx)  # [k, blocks] uint8
    absmax2 = getattr(module, f"{name}_absmax2").index_select(0, idx)  # [k, blocks2]
    offset = getattr(module, f"{name}_offset").index_select(0, idx)  # [k]
    scales2 = absmax2.repeat_interleave(s["nested_blocksize"], dim=1)[:, : codes.shape[1]]
    absmax = getattr(module, f"{name}_code2")[codes.long()] * scales2 + offset.unsqueeze(1)
    state = QuantState(
        absmax=absmax.reshape(-1),
        shape=torch.Size((len(experts), *shape)),
        code=getattr(module, f"{name}_code"),
        blocksize=s["blocksize"],
        quant_type=s["quant_type"],
        dtype=dtype,
    )
    return bnbf.dequantize_4bit(packed.reshape(-1, 1), state)


def _groups(module: nn.Module, name: str, counts: list[int]) -> list[tuple[list[int], list[int]]]:
    """The routed experts (``counts[e] > 0``) in dequantization groups, each with the start
    row of every expert's rows in the expert-sorted order (and the group's end)."""
    size = dequant_group_size(module, name)
    groups: list[tuple[list[int], list[int]]] = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if not groups or len(groups[-1][0]) == size:
            groups.append(([], [start]))
        groups[-1][0].append(e)
        start += n
        groups[-1][1].append(start)
    return groups


class _Nf4GroupedLinear(torch.autograd.Function):
    """``x_e @ W_e^T`` (``x_e @ W_e`` when transposed) for the rows ``x_e`` of each routed
    expert ``e`` (``x`` sorted by expert), the routed experts dequantized a group at a time
    (`dequant_group_size`). Saves no weight: each group is dequantized again in backward, as
    bitsandbytes' ``MatMul4Bit`` does, and at most one group is held dequantized at a time.
    The row counts come from the host (the one sync of the layer, in its forward only)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        module: nn.Module,
        name: str,
        groups: list[tuple[list[int], list[int]]],
        transposed: bool,
    ) -> torch.Tensor:
        ctx.module, ctx.name, ctx.groups, ctx.transposed = module, name, groups, transposed
        (rows, cols), _ = module.nf4_shapes[name]
        out = x.new_empty(x.shape[0], cols if transposed else rows)
        for experts, bounds in groups:
            w = dequantize_expert_group(module, name, experts)
            for j in range(len(experts)):
                a, b = bounds[j], bounds[j + 1]
                torch.mm(x[a:b], w[j] if transposed else w[j].t(), out=out[a:b])
            del w  # one group held at a time
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        (rows, cols), _ = ctx.module.nf4_shapes[ctx.name]
        grad_x = grad.new_empty(grad.shape[0], rows if ctx.transposed else cols)
        for experts, bounds in ctx.groups:
            w = dequantize_expert_group(ctx.module, ctx.name, experts)
            for j in range(len(experts)):
                a, b = bounds[j], bounds[j + 1]
                g = grad[a:b]
                torch.mm(g, w[j].t() if ctx.transposed else w[j], out=grad_x[a:b])
            del w
        return grad_x, None, None, None, None


def _linear(
    module: nn.Module, name: str, counts: list[int], ids: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """The routed experts' projection ``name`` of the expert-sorted rows ``x`` (``counts`` of
    them per expert, ``ids`` each row's expert), and their biases (kept 16-bit), one gather."""
    groups = _groups(module, name, counts)
    out = _Nf4GroupedLinear.apply(x, module, name, groups, module.is_transposed)
    if module.has_bias:
        out = out + module.get_parameter(f"{name}_bias")[ids]
    return out


def nf4_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts forward (the grouped implementation's math) on NF4 experts:
    only the experts some token is routed to are dequantized, a group at a time
    (`dequant_group_size`).

    One host sync per layer (the per-expert row counts, ``bincount().tolist()``): which experts
    to dequantize and which rows each multiplies are data-dependent, and launching a matmul per
    routed expert needs them on the host; a grouped matmul with device offsets would need the
    whole stack dequantized (the memory the plan does not count), and one sync per step is not
    possible since each layer's routing depends on the previous layer's output. Backward reuses
    the counts (no sync); recompute under activation checkpointing syncs once more."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    compute = self.nf4_compute_dtype
    x = hidden_states.to(compute)
    expert_ids = top_k_index.reshape(-1)  # (S,), S = tokens x top-k
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    counts = torch.bincount(sorted_ids, minlength=self.num_experts).tolist()  # one host sync
    routed = sum(counts[: self.num_experts])  # sorted: sentinels (no expert) come last
    counts = counts[: self.num_experts]
    first = "gate_up_proj" if self.has_gate else "up_proj"
    if routed:
        ids = sorted_ids[:routed]
        h = _linear(self, first, counts, ids, x[perm[:routed] // num_top_k])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _linear(self, "down_proj", counts, ids, h)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
    else:
        h = x.new_zeros(0, hidden_dim)
    if routed < perm.numel():
        h = torch.cat([h, h.new_zeros(perm.numel() - routed, hidden_dim)])
    if not routed:
        return torch.zeros_like(hidden_states)
    grouped = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(compute)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    out = grouped[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Make ``homelab_nf4`` a valid ``config._experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, nf4_experts_forward)
