"""Load the model and tokenizer from a local folder, and make it trainable as the spec says.

Full fine-tunes keep fp32 master weights (bf16/fp16 autocast on CUDA); LoRA keeps a frozen base in
the compute dtype with fp32 adapters; QLoRA quantizes the linear layers to 4-bit NF4 with double
quantization. Everything is read from the local folder: no network, and the folder's own Python
code runs only when the preset says ``model.trust_remote_code = true``. Results are written with
safetensors only (never pickle).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from homelab_dp.core.preset import Preset
from homelab_dp.core.runspec import Resolved

log = logging.getLogger(__name__)

# "fp64" is accepted on the CPU only, for the exactness tests (see worker docstring).
_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclass
class LoadedModel:
    """A model ready to be wrapped by a strategy."""

    model: nn.Module
    """The Hugging Face model, or a peft ``PeftModel`` around it for lora/qlora."""
    is_peft: bool
    params: int
    """All parameters (4-bit weights counted as their logical size)."""
    trainable_params: int
    decoder_layers: list[nn.Module]
    """The transformer blocks: the unit FSDP2 shards and activation checkpointing recomputes."""


def compute_dtype(resolved: Resolved) -> torch.dtype:
    """The dtype the matmuls run in: fp32 (or fp64) on CPU, bf16/fp16 on CUDA."""
    if resolved.device == "cpu":
        return torch.float64 if resolved.dtype == "fp64" else torch.float32
    return _DTYPES[resolved.dtype]


def master_dtype(resolved: Resolved) -> torch.dtype:
    """The dtype of the weights the optimizer updates (fp32 master weights except in fp64 mode)."""
    return torch.float64 if resolved.dtype == "fp64" else torch.float32


def load_tokenizer(preset: Preset) -> Any:
    """The fast tokenizer of the model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )


def load_model(preset: Preset, resolved: Resolved, device: torch.device) -> LoadedModel:
    """Load the model for ``resolved.method`` on ``device``; LoRA adapters are seeded by train.seed."""
    from transformers import AutoModelForCausalLM

    method = resolved.method
    kwargs: dict[str, Any] = {"trust_remote_code": preset.model.trust_remote_code}
    if method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(resolved),
        )
        kwargs["dtype"] = compute_dtype(resolved)
        kwargs["device_map"] = {"": device}
    elif method == "lora":
        # The frozen base only needs the compute dtype; the adapters are made fp32 by peft.
        kwargs["dtype"] = compute_dtype(resolved)
    else:
        kwargs["dtype"] = master_dtype(resolved)
    model = AutoModelForCausalLM.from_pretrained(preset.model.path, **kwargs)
    if method != "qlora":
        model.to(device)
    model.config.use_cache = False  # no KV cache while training
    # from_pretrained returns the model in eval mode, where dropout is off and transformers
    # silently skips activation checkpointing (it recomputes only while training).
    model.train()
    ac = resolved.activation_checkpointing
    if method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=ac,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = count_params(model)
    if method in ("lora", "qlora"):
        model = _add_lora(model, preset)
    if method == "qlora" and device.type == "cpu":
        disable_cpu_bf16_repack(model)
    layers = decoder_layers(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoadedModel(model, method != "full", params, trainable, layers)


def _add_lora(model: nn.Module, preset: Preset) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = preset.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    # Every rank draws the same adapter init: the seed is set before this call (see worker).
    return get_peft_model(model, config)


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


def count_params(model: nn.Module) -> int:
    """Logical parameter count; a packed 4-bit weight holds two values per byte."""
    total = 0
    for p in model.parameters():
        n = p.numel()
        if p.dtype == torch.uint8 and hasattr(p, "quant_state"):
            n *= 2
        total += n
    return total


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found by the model's ``_no_split_modules`` class names."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    # Fallback: the longest ModuleList (the stack of blocks in every causal LM we know).
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def save_full_model(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None, tokenizer: Any, out_dir: Path
) -> None:
    """Write a Hugging Face model folder (config + safetensors) and the tokenizer.

    ``state_dict`` is the gathered full state dict (FSDP2); None saves the module's own weights.
    """
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(out_dir), **kwargs)
    tokenizer.save_pretrained(str(out_dir))


def save_adapter(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None, tokenizer: Any, out_dir: Path
) -> None:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors)."""
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(out_dir), safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(str(out_dir))


def merge_adapter(preset: Preset, adapter_dir: Path, tokenizer: Any, out_dir: Path) -> None:
    """Merge a saved adapter into a fresh, unquantized copy of the base model and save it.

    QLoRA adapters are merged into the 16/32-bit base, not the 4-bit one: merging into quantized
    weights would round the update away.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        preset.model.path, dtype="auto", trust_remote_code=preset.model.trust_remote_code
    )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out_dir)
