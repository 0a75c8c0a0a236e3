"""The Textual TUI: a thin front end over the run controller (`homelab-dp` with no command)."""
