"""TF32 matmuls: a speed switch that changes no result beyond rounding.

On compute capability 8.0 and later, fp32 matmuls (what autocast leaves in fp32) run on
the tensor cores with a 10-bit mantissa, several times faster. Only bf16/fp16 runs turn it on:
their matmuls already run in 16-bit, and a run that asked for fp32 keeps full fp32.
"""

from __future__ import annotations

import torch


def enable_tf32(device: torch.device, dtype_name: str) -> bool:
    """TF32 matmuls on Ampere (8.0) and later for a bf16/fp16 run; returns whether enabled."""
    if device.type != "cuda" or dtype_name not in ("bf16", "fp16"):
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return True
