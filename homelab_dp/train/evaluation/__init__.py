"""Evaluation as its own process: the in-run validator and the eval workers."""
