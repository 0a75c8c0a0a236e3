"""Measurement harnesses that run beside training: the memory grid `measure` launches under torchrun."""
