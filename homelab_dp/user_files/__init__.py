"""Per-user files in one place: where they live (`paths`), how one is written whole and private
and read back without a traceback (`private_write`), and the fingerprinted store both
calibrations keep (`fingerprint_store`). The layer just above the shared words: it imports
them and nothing else of the project."""
