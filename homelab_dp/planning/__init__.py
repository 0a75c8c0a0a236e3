"""Pure planning core: stdlib only, no torch, textual, rich or pynvml (a test enforces it)."""
