"""homelab-dp: plan and run data-parallel fine-tunes on the GPUs you own."""

__version__ = "0.1.0"
