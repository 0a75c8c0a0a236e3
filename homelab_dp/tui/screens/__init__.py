"""The five screens of the TUI, one module each."""
