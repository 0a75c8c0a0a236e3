"""`plan --model DIR` on any decoder: hand-written families, the census of the others (a child
process, then its cache), and the refusals (exit 2, ``error:`` naming the file and model_type,
a ``hint:``, nothing built)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.app import model_specs
from homelab_dp.app.model_specs import cache_path, model_spec
from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_spec import spec_from_config, spec_to_dict
from homelab_dp.train.model.model_census import census
from tests.conftest import run_cli
from tests.unit.planning.test_model_families import PUBLISHED, _config, _meta_count

TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _folder(tmp_path: Path, name: str, cfg: dict[str, Any]) -> Path:
    """A config-only model folder written by transformers (every field, as a hub download)."""
    folder = tmp_path / name
    _config(cfg).save_pretrained(folder)
    return folder


def _plan_json(capsys: pytest.CaptureFixture[str], folder: Path) -> dict[str, Any]:
    rc, out, err = run_cli(capsys, "plan", "--model", str(folder), "--gpus", "2x24GiB", "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "gpt-oss-20b", "gemma-3-4b"])
def test_plan_model_reports_the_meta_device_count(name, tmp_path, capsys) -> None:
    total, inactive = _meta_count(PUBLISHED[name])
    model = _plan_json(capsys, _folder(tmp_path, name, PUBLISHED[name]))["model"]
    vision = spec_from_config(json.loads(_config(PUBLISHED[name]).to_json_string())).vision_params
    assert model["params"] == total
    assert model["active_params"] == total - inactive - vision
    assert not (Path(model_specs.data_home()) / "model-specs").exists()  # no census needed


def test_a_family_without_a_hand_written_spec_is_derived_then_cached(
    tmp_path, capsys, monkeypatch
) -> None:
    """starcoder2 (no hand-written spec): the census child's count, kept private in the cache."""
    cfg = {"model_type": "starcoder2", **TINY}
    folder = _folder(tmp_path, "starcoder2", cfg)
    total, _ = _meta_count(cfg)
    assert _plan_json(capsys, folder)["model"]["params"] == total
    cached = cache_path(folder, trust_remote_code=False, text_only=False)
    assert stat.S_IMODE(cached.stat().st_mode) == 0o600
    assert stat.S_IMODE(cached.parent.stat().st_mode) == 0o700
    calls: list[Path] = []
    monkeypatch.setattr(model_specs, "run_census", lambda f, **_: calls.append(f) or {})
    assert model_spec(folder).params == total and calls == []  # the cache answers
    assert model_spec(folder).source == "meta-device"


def test_text_only_wrapper_is_its_language_model(tmp_path) -> None:
    folder = _folder(tmp_path, "gemma3", PUBLISHED["gemma-3-4b"])
    whole, text = model_spec(folder), model_spec(folder, text_only=True)
    assert text.vision_params == 0 and whole.params - text.params == whole.vision_params
    assert text.model_type == "gemma3_text"


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"model_type": "bert", **TINY}, "model_type='bert' is an encoder-only model"),
        ({"model_type": "roberta", **TINY}, "model_type='roberta' is an encoder-only model"),
        ({"model_type": "t5", "d_model": 64}, "model_type='t5' is an encoder-decoder"),
        ({"model_type": "my_bart", "is_encoder_decoder": True}, "'my_bart' is an encoder-decoder"),
        ({"model_type": "custom_lm", "auto_map": {"AutoModelForCausalLM": "m.M"}, **TINY},
         "model_type='custom_lm' runs the model folder's own Python code"),
        ({"model_type": "qwen3_moe", "hidden_size": 64}, "missing or invalid 'num_attention_heads'"),
        ({"hidden_size": 64}, "no 'model_type'"),
        ({"model_type": "no_such_family", **TINY}, "model_type='no_such_family' is unknown to"),
    ],
)  # fmt: skip
def test_refusals_name_the_file_and_model_type(cfg, needle, tmp_path, capsys) -> None:
    folder = _write(tmp_path, cfg)
    rc, out, err = run_cli(capsys, "plan", "--model", str(folder), "--gpus", "24GiB")
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and needle in lines[0] and "config.json" in lines[0]
    assert lines[1].startswith("hint: ") and "Traceback" not in err
    assert not (Path(model_specs.data_home()) / "model-specs").exists()  # nothing cached


def test_planning_a_moe_folder_imports_no_torch(tmp_path) -> None:
    """A hand-written MoE family is planned from config.json alone, in a process that never
    imports torch or transformers (the CLI's rule)."""
    folder = _folder(tmp_path, "qwen3_moe", PUBLISHED["Qwen3-30B-A3B"])
    code = (
        "import sys\nfrom homelab_dp.cli.main import main\n"
        f"rc = main(['plan', '--model', {str(folder)!r}, '--gpus', '2x24GiB', '--json'])\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules, rc, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.split()[-3:] == ["False", "False", "0"]
    assert json.loads(out.stdout)["model"]["params"] == 30_532_122_624


def test_a_damaged_cache_entry_is_derived_again(tmp_path, monkeypatch) -> None:
    cfg = {"model_type": "stablelm", **TINY}
    folder = _folder(tmp_path, "stablelm", cfg)
    path = cache_path(folder, trust_remote_code=False, text_only=False)
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_text("{not json")
    # The census in this process (the child's own function), to keep the test quick.
    monkeypatch.setattr(model_specs, "run_census", lambda f, **kw: spec_to_dict(census(f, **kw)))
    assert model_spec(folder).params == _meta_count(cfg)[0]
    assert json.loads(path.read_text())["spec"]["model_type"] == "stablelm"
    with pytest.raises(ModelSpecError):
        model_specs.spec_from_dict({"model_type": "x"})
