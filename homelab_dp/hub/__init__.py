"""The Hugging Face Hub: model ids resolved to local snapshot folders (no torch)."""
