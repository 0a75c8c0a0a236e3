"""The NF4 quantization a QLoRA base is trained on, and evaluated, chatted with and served on.

One definition for the worker (`train/`) and the replicas (`serving/replica/`), which may not
import each other: the same quantization on both sides is what makes `eval` of a QLoRA result
give the run's own eval loss (the adapter was trained against exactly this base).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import BitsAndBytesConfig


def nf4_config(compute: torch.dtype, storage: torch.dtype | None = None) -> BitsAndBytesConfig:
    """QLoRA's quantization: NF4 with double quantization, computing in ``compute``; packed
    weights stored as ``storage`` (uint8 by default; the compute dtype under FSDP2, so that it
    shards them as parameters of that dtype)."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=storage or torch.uint8,
    )


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
