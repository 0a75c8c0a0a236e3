"""Serving: the OpenAI-compatible front, the load balancer and the replica supervisor (no torch)."""
