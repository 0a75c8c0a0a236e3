"""Inference on a fine-tuned result: loading it, generation with dynamic batching, a replica."""
