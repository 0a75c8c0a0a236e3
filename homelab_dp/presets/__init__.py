"""Run presets: the TOML schema, every field documented, and where presets are found."""
