"""The model a rank trains: loading, LoRA, quantized loading and experts, attention, packed attention, the tiled MLP, the loss head, the census."""
