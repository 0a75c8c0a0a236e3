"""One module per command, combining the parts; the CLI and the TUI call these."""
