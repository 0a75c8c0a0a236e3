"""The NF4 quantization a QLoRA base is trained on, and evaluated, chatted with and served on.

One definition for the worker (`train/`) and the replicas (`serving/replica/`), which may not
import each other: the same quantization on both sides is what makes `eval` of a QLoRA result
give the run's own eval loss (the adapter was trained against exactly this base).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from transformers import BitsAndBytesConfig

FUSED_OUT_PROJ_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h", "bamba", "granitemoehybrid",
    "zamba2",
})  # fmt: skip
"""Families whose Mamba mixer hands ``out_proj.weight`` itself to mamba-ssm's fused kernel
(``mamba_split_conv1d_scan_combined(..., outproj_weight=self.out_proj.weight)`` in transformers
5.25's modeling code) when that kernel is installed: a packed 4-bit weight there would be read as
if it were the 16-bit matrix, so QLoRA keeps it 16-bit (peft refuses LoRA on it too)."""
NF4_DEFAULT_SKIPS = ("lm_head",)
"""What bitsandbytes leaves 16-bit by default (the output layer); named again whenever a family
adds its own skips, which replace transformers' default list."""


def nf4_skip_modules(model_type: str) -> list[str] | None:
    """The module names QLoRA keeps 16-bit beside the defaults on a ``model_type`` model (None:
    transformers' defaults only): Mamba's ``out_proj`` on `FUSED_OUT_PROJ_MODEL_TYPES`. The
    convolutions, ``A_log``, ``dt_bias``, ``D``, norms and embeddings are no linears and stay
    16-bit anyway."""
    if model_type in FUSED_OUT_PROJ_MODEL_TYPES:
        return [*NF4_DEFAULT_SKIPS, "out_proj"]
    return None


def nf4_config(
    compute: torch.dtype, storage: torch.dtype | None = None, *, model_type: str = ""
) -> BitsAndBytesConfig:
    """QLoRA's quantization: NF4 with double quantization, computing in ``compute``; packed
    weights stored as ``storage`` (uint8 by default; the compute dtype under FSDP2, so that it
    shards them as parameters of that dtype). ``model_type``: the family, for what it keeps
    16-bit (`nf4_skip_modules`); the worker and the replicas pass the same, so a QLoRA result is
    evaluated and served on the base it was trained on."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage or torch.uint8,
        llm_int8_skip_modules=nf4_skip_modules(model_type),
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
