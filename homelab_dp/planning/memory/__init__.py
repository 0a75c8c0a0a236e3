"""The memory model: bytes per device and per host, offload costs, calibration."""
