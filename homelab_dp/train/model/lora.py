"""LoRA and QLoRA: a frozen base in the compute dtype with fp32 adapters, and nothing wider.

`prepare_frozen_base` replaces peft's ``prepare_model_for_kbit_training``, which also casts every
16-bit parameter that is not 4-bit (embeddings, lm_head, norms) to fp32: on Llama-3.1-8B the
128k × 4096 embeddings and lm_head alone grow from 2 GiB to 4 GiB, and an fp32 embedding turns
the whole residual stream fp32 (twice the activation memory) while every matmul still runs in
the compute dtype. Here the base keeps the dtype it was loaded in:

- embeddings and lm_head are frozen, so fp32 storage would only hold the same bf16 values wider;
- norms stay 16-bit too: LlamaRMSNorm (like every RMSNorm/LayerNorm in transformers) normalises
  in fp32 and only multiplies by its frozen weight in the input dtype, as torchtune's RMSNorm
  (a bf16 ``scale``) and unsloth's preparation (freeze, no cast) do;
- the adapters, the only trained weights, are fp32: peft's ``autocast_adapter_dtype`` (on by
  default in ``get_peft_model``) upcasts them, so the optimizer updates fp32 weights;
- modules a model asks to keep in fp32 (``_keep_in_fp32_modules``) are kept so by
  ``from_pretrained`` and left alone here.

Gradient checkpointing is non-reentrant, which needs no input that requires grad: the hook
``enable_input_require_grads`` puts on the embeddings exists for reentrant checkpointing, whose
recomputed segment has no gradient path otherwise. transformers (``gradient_checkpointing_enable``)
and peft (``PeftModel`` of a checkpointed 16-bit model) both register it anyway; it is removed
after each, which spares the backward pass the gradient of the first block's input (a batch ×
sequence × hidden tensor and the first block's input-gradient matmuls, all discarded).
tests/unit/train/test_lean_dtypes.py checks that the first block is recomputed and its adapters still
get gradients. On the CPU the compute dtype is fp32, so no dtype of a CPU run changes.

fp16 is the exception (Turing and older cards, no bf16): there the embeddings and norms are
kept in fp32 (`residual_in_fp32`), so that the residual stream is fp32 and cannot overflow
fp16's range; the matmuls still run in fp16 under autocast.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import torch
from torch import nn

from homelab_dp.errors import HomelabError, ModelSpecError
from homelab_dp.peft_targets import exact_targets
from homelab_dp.planning.model_layers import PEFT_MAMBA_REFUSED, PEFT_MAMBA_TYPES, lora_can_adapt
from homelab_dp.train.model.layer_census import _decoder_layers


def prepare_frozen_base(
    model: nn.Module, *, gradient_checkpointing: bool, fp32_residual: bool = False
) -> nn.Module:
    """Freeze every base parameter, keep every dtype, and checkpoint non-reentrantly if asked.

    ``fp32_residual`` (fp16 compute): embeddings and norms in fp32 (`residual_in_fp32`).
    The model must already be in train mode (transformers only recomputes while training).
    """
    for param in model.parameters():
        param.requires_grad_(False)
    if fp32_residual:
        residual_in_fp32(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        _drop_input_grad_hook(model)
    return model


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: ``nn.LayerNorm`` or a model's own (LlamaRMSNorm, Qwen2RMSNorm,
    GemmaRMSNorm, …: by class name, as transformers names every one of them)."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("Norm", "RMSNorm"))


def residual_in_fp32(model: nn.Module) -> int:
    """Embeddings and norms to fp32: the residual stream of an fp16 run then stays fp32.

    fp16 tops out at 65504, and bf16-native families (Qwen2.x, Gemma) carry residual
    activations beyond it: with the embeddings' output in fp16 every residual add is fp16, an
    overflow gives inf, and the GradScaler skips every step. peft's kbit preparation casts every
    non-quantized parameter to fp32 for this reason; here only the embeddings (their output
    starts the residual stream) and the norms (their weight multiplies it) are cast, and
    autocast still runs every matmul in fp16. Costs the embeddings' fp16 bytes again (frozen,
    no optimizer state). Returns the parameters cast.
    """
    n = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) or is_norm(module):
            for param in module.parameters(recurse=False):
                if param.dtype == torch.float16:
                    param.data = param.data.float()
                    n += 1
    return n


def _drop_input_grad_hook(model: nn.Module) -> None:
    """Remove the hook that makes the embeddings' output require grad (see the module docstring).

    Called after each library call that may add one: a second ``enable_input_require_grads``
    overwrites the handle of the first, which could then never be removed.
    """
    disable = getattr(model, "disable_input_require_grads", None)
    if disable is not None:
        disable()


def add_lora(model: nn.Module, lora: Any) -> nn.Module:
    """Wrap ``model`` in a peft LoRA model (``lora``: the preset's `LoraSection`).

    Adapters are drawn from torch's global generator: every rank seeds it first (see worker).
    peft upcasts 16-bit adapters to fp32 (``autocast_adapter_dtype=True``, made explicit here).
    """
    from peft import LoraConfig, get_peft_model

    modules, parameters = lora_targets(model, lora.target_modules)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=modules,
        target_parameters=parameters or None,
        task_type="CAUSAL_LM",
    )
    with exact_targets():  # the modules named, not peft's v4 expert renaming
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    _drop_input_grad_hook(model)  # peft adds it to a checkpointed model that is not quantized
    return peft_model


EXPERT_TARGETS = ("experts", "experts.gate_up_proj", "experts.down_proj")
"""Names in ``lora.target_modules`` that ask for adapters on a MoE model's routed experts."""
_ROUTER_NAME = re.compile(r"(^|\.)(gate|router)$|(^|[._])(expert_gate|router_gate)$")
"""A linear named ``gate``, ``router``, ``shared_expert_gate``, ``router_gate``: a router,
never adapted (``gate_proj``, a dense MLP's input, does not match, nor does a projection that
merely ends in ``_gate``: Gemma 4's ``per_layer_input_gate``, MiniMax's ``output_gate``)."""
_NOT_TEXT = ("vision_tower", "vision_model", "visual", "multi_modal_projector", "audio_tower")
"""Submodules of a multimodal wrapper that are not its language model: frozen, never adapted."""


def is_router(name: str, module: nn.Module) -> bool:
    """Whether the module called ``name`` routes tokens to experts (or gates a shared expert).

    transformers 5 routers are their own classes (``Qwen3MoeTopKRouter``, ``GptOssTopKRouter``,
    ...) with a ``weight`` parameter; older and remote families use an ``nn.Linear`` called
    ``gate``/``router``."""
    cls = type(module).__name__
    return "Router" in cls or cls.endswith("Gate") or bool(_ROUTER_NAME.search(name))


def is_experts(module: nn.Module) -> bool:
    """A MoE block's routed experts: fused 3-D weights (``Qwen3MoeExperts``, ``GptOssExperts``)
    or a list of expert MLPs (by class name, as transformers names them ``*Experts``)."""
    return type(module).__name__.endswith("Experts")


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts (it has a router or routed experts)."""
    return any(is_experts(m) or is_router(n, m) for n, m in model.named_modules())


def is_outside_text(name: str) -> bool:
    """Whether the module or parameter called ``name`` lies outside a multimodal wrapper's
    language model (its vision tower or projector)."""
    return any(part in _NOT_TEXT for part in name.split("."))


PEFT_MAMBA_MODEL_TYPES = PEFT_MAMBA_TYPES
"""The ``model_type``s on which peft refuses LoRA on `PEFT_MAMBA_REFUSED` (peft 0.21,
``tuners_utils._check_lora_target_modules_mamba``; the plan's LoRA count uses the same rule,
`homelab_dp.planning.model_layers.lora_can_adapt`): their Mamba mixers hand ``out_proj``'s
weight to the fused mamba-ssm kernel, which would skip an adapter's forward."""


def peft_refuses(model_type: str, name: str) -> bool:
    """Whether peft refuses a LoRA adapter on the module called ``name`` (dotted or not) of a
    ``model_type`` model: its last name part is ``out_proj`` or ``conv1d`` on a Mamba-based
    family (`PEFT_MAMBA_MODEL_TYPES`), exactly as peft decides at ``get_peft_model``."""
    return not lora_can_adapt(model_type, name)


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or "")


def _linear(module: nn.Module) -> bool:
    """A plain or 4-bit linear layer (what peft's "all-linear" adapts)."""
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ in ("Linear4bit", "Linear8bitLt")


def _layers_prefix(model: nn.Module) -> str:
    """``"<name of the decoder layers' ModuleList>."`` ("" when the model has none)."""
    try:
        name, _ = _decoder_layers(model)
    except ModelSpecError:
        return ""
    return name + "."


def lora_targets(
    model: nn.Module, target_modules: str | list[str]
) -> tuple[str | list[str], list[str]]:
    """peft's ``(target_modules, target_parameters)`` for the preset's ``lora.target_modules``.

    A dense text model keeps what the preset says. On a MoE model, a multimodal wrapper or a
    Mamba-based family (`PEFT_MAMBA_MODEL_TYPES`) "all-linear" becomes the explicit list of
    linears peft would adapt minus the routers (`is_router`, and the linears inside one), the
    routed experts (`is_experts`), the output layer and any linear outside the decoder layers (the plan counts theirs), anything outside the language model
    (`_NOT_TEXT`) and what peft refuses (`peft_refuses`: Mamba's ``out_proj``): peft's own
    "all-linear" adapts the routers, for some families adds the fused experts by itself, and
    on Mamba-based families fails on ``out_proj``. Never adapted, being no linears: the
    convolutions (``conv1d``, LFM2's short ``conv``), ``A_log``, ``dt_bias``, ``D`` and the
    norms; Gated DeltaNet's projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``,
    ``in_proj_b``, ``out_proj``), Mamba-2's ``in_proj`` and LFM2's ``in_proj``/``out_proj`` are.
    A list naming a module peft refuses is a HomelabError, before anything is loaded onto a
    card. Naming "experts" (or "experts.gate_up_proj" /
    "experts.down_proj") in a list adds the fused 3-D expert weights as ``target_parameters``
    (every ``nn.Parameter`` of 3 dimensions directly on an experts module, or the one named);
    a ModuleList of expert MLPs gets its linears as modules instead.
    """
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [target_modules]  # one name, as planned (peft reads a str as a regex)
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    wanted = [n for n in names if n in EXPERT_TARGETS]
    rest = [n for n in names if n not in EXPERT_TARGETS]
    model_type = _model_type(model)
    refused = [n for n in rest if peft_refuses(model_type, n)]
    if refused:
        raise HomelabError(
            f"lora.target_modules names {refused[0]!r}, which peft refuses on a Mamba-based "
            f"model (model_type {model_type!r}: no LoRA on {sorted(PEFT_MAMBA_REFUSED)})",
            hint="leave it out of lora.target_modules, or use 'all-linear' (which skips it)",
        )
    multimodal = any(is_outside_text(n) for n, _ in model.named_modules())
    mamba = model_type in PEFT_MAMBA_MODEL_TYPES
    if not wanted and not (rest == ["all-linear"] and (multimodal or mamba or is_moe(model))):
        return target_modules, []
    output = getattr(model, "get_output_embeddings", lambda: None)()
    modules: list[str] = []
    parameters: list[str] = []
    inside_experts: set[str] = set()
    for name, module in model.named_modules():
        if is_experts(module):
            for pname, param in module.named_parameters(recurse=False):
                if param.ndim == 3 and any(w in ("experts", f"experts.{pname}") for w in wanted):
                    parameters.append(f"{name}.{pname}")
            inside_experts.add(name + ".")
    routers = tuple(n + "." for n, m in model.named_modules() if n and is_router(n, m))
    layers = _layers_prefix(model)
    for name, module in model.named_modules():
        if not _linear(module) or module is output or is_router(name, module):
            continue
        # The decoder layers' linears, as the plan counts them (not a model-level projection:
        # Gemma 4's per_layer_model_projection of the embeddings into the per-layer inputs).
        if layers and not name.startswith(layers):
            continue
        # A router's own linear (Gemma 4's ``router.proj``), peft's refusals, the vision tower.
        if name.startswith(routers) or peft_refuses(model_type, name) or is_outside_text(name):
            continue
        expert = any(name.startswith(prefix) for prefix in inside_experts)
        # A ModuleList of expert MLPs gets its linears when the experts are named.
        if ("experts" in wanted) if expert else ("all-linear" in rest):
            modules.append(name)
    if wanted and not parameters and not inside_experts:
        raise HomelabError(
            f"lora.target_modules names {wanted[0]!r}, but the model has no routed experts",
            hint="leave the experts out of lora.target_modules (e.g. 'all-linear')",
        )
    modules += [n for n in rest if n != "all-linear"]
    return modules, parameters


def is_adapter(name: str) -> bool:
    """Whether the parameter called ``name`` is a LoRA A or B matrix."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_init(name: str, shape: tuple[int, ...] | torch.Size, seed: int) -> torch.Tensor:
    """The initial value (fp32, on the CPU) of the LoRA parameter called ``name``.

    peft's default init — ``lora_A`` Kaiming-uniform with a = √5, ``lora_B`` zero, so the adapted
    model starts equal to its base — drawn from a generator seeded by ``seed`` (train.seed) and
    the parameter's name alone. QLoRA adapters are made so on every path: a model loaded whole
    (DDP) and one filled shard by shard (FSDP2, `train.model.quantized_load`) start from the same
    adapters, whatever the load drew from the global generator before them.
    """
    value = torch.empty(tuple(shape), dtype=torch.float32)
    if ".lora_B." in name:
        return value.zero_()
    if not is_adapter(name):
        raise ValueError(f"{name}: not a LoRA A or B matrix")
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)


def seed_adapters(model: nn.Module, seed: int) -> int:
    """Set every LoRA A and B matrix of ``model`` to `adapter_init`; how many were set."""
    n = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                param.copy_(adapter_init(name, param.shape, seed))
                n += 1
    return n


def disable_cpu_bf16_repack(model: nn.Module) -> int:
    """Stop bitsandbytes repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16 a no-grad eval forward repacks the weights into a layout without
    autograd support, after which LoRA gradients silently become None (found on the CPU
    machines this project is tested on). Returns how many layers were changed.
    """
    import bitsandbytes as bnb

    n = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def param_bytes(model: nn.Module, *, trainable: bool | None = None) -> int:
    """Bytes the parameters occupy (a tied weight once; a packed 4-bit weight as its uint8s).

    ``trainable``: only the trainable (True) or frozen (False) ones; None counts all.
    """
    total = 0
    for p in model.parameters():
        if trainable is None or p.requires_grad == trainable:
            total += p.numel() * p.element_size()
    return total


def param_dtypes(model: nn.Module) -> dict[torch.dtype, int]:
    """Parameter bytes by dtype (``torch.uint8`` holds the packed 4-bit weights)."""
    out: dict[torch.dtype, int] = {}
    for p in model.parameters():
        out[p.dtype] = out.get(p.dtype, 0) + p.numel() * p.element_size()
    return out


def nf4_split(model: nn.Module) -> tuple[list[str], list[str]]:
    """QLoRA's base, which linears are 4-bit and which bitsandbytes left 16-bit:
    ``(quantized, kept)``, module names (LoRA's own A and B matrices and the base layers peft
    wraps counted once, by the wrapped name). Fused expert stacks are not linears (see
    `train.quantized_experts`)."""
    quantized: list[str] = []
    kept: list[str] = []
    for name, module in model.named_modules():
        if ".lora_" in name or name.endswith(".base_layer"):
            continue
        base = getattr(module, "base_layer", module)
        if type(base).__name__ in ("Linear4bit", "Linear8bitLt"):
            quantized.append(name)
        elif isinstance(base, nn.Linear):
            kept.append(name)
    return quantized, kept


def nf4_report(model: nn.Module) -> str:
    """One line for the worker's log: how many linears QLoRA quantized and which it kept
    16-bit, by their last name part (``out_proj ×2, lm_head``)."""
    quantized, kept = nf4_split(model)
    counts: dict[str, int] = {}
    for name in kept:
        leaf = name.rsplit(".", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + 1
    names = ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in sorted(counts.items()))
    return f"QLoRA: {len(quantized)} linears in NF4, {len(kept)} kept 16-bit ({names or 'none'})"
