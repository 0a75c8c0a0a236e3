"""The vision towers of the multimodal wrappers the planner counts by hand (pure): their
parameters (`ModelSpec.vision_params`, loaded frozen) and the weights of their ``nn.Linear``
modules, which QLoRA quantizes with the rest (`ModelSpec.outer_quantized`)."""

from __future__ import annotations

from typing import Any

# SigLIP's vision config defaults (transformers 5), for a wrapper's vision_config.
SIGLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
           "image_size": 224, "patch_size": 16, "num_channels": 3, "vision_use_head": True}  # fmt: skip


def siglip_params(vision: dict[str, Any]) -> int:
    """A SigLIP vision tower: patch and position embeddings, encoder layers, post-norm, head."""
    v = {**SIGLIP, **{k: val for k, val in vision.items() if val is not None}}
    d, i, p = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"])
    embed = v["num_channels"] * p * p * d + d + (int(v["image_size"]) // p) ** 2 * d
    mlp = d * i + i + i * d + d
    layer = 2 * 2 * d + 4 * (d * d + d) + mlp
    head = (d + 3 * d * d + 3 * d + d * d + d + 2 * d + mlp) if v["vision_use_head"] else 0
    return embed + int(v["num_hidden_layers"]) * layer + 2 * d + head


def siglip_linear_weights(vision: dict[str, Any]) -> int:
    """The weights of a SigLIP tower's ``nn.Linear`` modules, which QLoRA quantizes with the
    rest (`ModelSpec.outer_quantized`): q/k/v/out and fc1/fc2 of each layer, the pooling head's
    MLP (its ``MultiheadAttention`` holds no plain ``nn.Linear``)."""
    v = {**SIGLIP, **{k: val for k, val in vision.items() if val is not None}}
    d, i = int(v["hidden_size"]), int(v["intermediate_size"])
    head = 2 * d * i if v["vision_use_head"] else 0
    return int(v["num_hidden_layers"]) * (4 * d * d + 2 * d * i) + head
