"""Presentation shared by the CLI and the TUI: probe, plan, measure, run views, errors."""
