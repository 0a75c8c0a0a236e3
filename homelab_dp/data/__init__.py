"""The data pipeline, torch-free: read and check records, tokenize, pack into blocks."""
