"""The training worker and its components; runs under torchrun, one process per rank."""
