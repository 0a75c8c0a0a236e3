"""Widgets and rich renderings used by the TUI screens."""
