"""Hardware probing: the only package that imports pynvml."""
