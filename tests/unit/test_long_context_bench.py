"""benchmarks/long_context.py: the CLI runs' tokens/s from step events and the long copy of the
tiny model (no timed run here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "long_context", ROOT / "benchmarks" / "long_context.py"
)
assert _spec and _spec.loader
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_tokens_per_s_counts_the_steps_after_the_first() -> None:
    events = [
        {"type": "start", "time": 0.0},
        {"type": "step", "time": 10.0, "tokens": 2048},  # warm-up: its time left out
        {"type": "step", "time": 11.0, "tokens": 4096},
        {"type": "devices", "time": 11.5},
        {"type": "step", "time": 12.0, "tokens": 6144},
        {"type": "step", "time": 14.0, "tokens": 8192},
    ]
    # 3 steps' worth (4096 → 8192) over 3 s from the second step's event to the last
    assert bench.cli_tokens_per_s(events) == pytest.approx(4096 / 3.0)
    with pytest.raises(ValueError, match="too few"):
        bench.cli_tokens_per_s(events[:3])


def test_the_long_copy_raises_only_the_positions(tmp_path: Path) -> None:
    out = bench.long_copy(tmp_path, 4096)
    config = json.loads((out / "config.json").read_text())
    tiny = json.loads((bench.TINY / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096 != tiny["max_position_embeddings"]
    assert {k: v for k, v in config.items() if k != "max_position_embeddings"} == {
        k: v for k, v in tiny.items() if k != "max_position_embeddings"
    }
    assert (out / "model.safetensors").read_bytes() == (
        bench.TINY / "model.safetensors"
    ).read_bytes()
    preset = bench.cli_preset(out, "lora", 2048, 3)
    assert f'path = "{out}"' in preset and "seq_len = 2048" in preset and "max_steps = 4" in preset
