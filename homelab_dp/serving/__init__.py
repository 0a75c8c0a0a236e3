"""Serving: the OpenAI front (no torch) and the replicas behind it (torch)."""
