"""How ranks share the work: the strategy (DDP, ZeRO-1, FSDP2, offload), the host optimizer, activation offload, sequence parallelism, communication timing."""
