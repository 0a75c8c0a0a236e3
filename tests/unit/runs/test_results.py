"""`runs.model_ref.resolve_model`: every kind of MODEL argument, and every kind of miss.

Run folders are real ones (`make_run` writes spec.json through `runs.folder.run_folder`, as the
controller does); their ``final/`` results are laid out as the worker saves them: a full model
folder, a PEFT adapter folder, or an adapter with its merged model in ``final/merged/``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from homelab_dp.errors import HomelabError
from homelab_dp.runs.model_ref import find_run, resolve_model
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run


def _adapter(folder: Path, base: str) -> Path:
    """A PEFT adapter folder (its config names the base; the weights are not read here)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": base, "r": 4}),
        encoding="utf-8",
    )
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def _full(folder: Path) -> Path:
    """A full model folder: the demo model's files."""
    shutil.copytree(DEMO_MODEL, folder)
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """A runs folder with four runs: full result, adapter, merged adapter, and none yet."""
    root = tmp_path / "runs"
    full = make_run(root, DEMO_MODEL, DEMO_DATA, name="20260101-000000-full-aaaa", seq_len=48)
    _full(full / "final")
    lora = make_run(root, DEMO_MODEL, DEMO_DATA, name="20260101-000000-lora-bbbb", method="lora")
    _adapter(lora / "final", str(DEMO_MODEL))
    merged = make_run(
        root, DEMO_MODEL, DEMO_DATA, name="20260102-000000-merged-cccc", method="lora"
    )
    _adapter(merged / "final", str(DEMO_MODEL))
    _full(merged / "final" / "merged")
    make_run(root, DEMO_MODEL, DEMO_DATA, name="20260103-000000-unfinished-dddd")
    return root


def test_a_model_folder_is_itself(tmp_path: Path) -> None:
    ref = resolve_model(str(DEMO_MODEL), tmp_path)
    assert (ref.name, ref.path, ref.base, ref.run_dir) == ("tiny-llama", DEMO_MODEL, None, None)
    assert not ref.is_adapter and not ref.trust_remote_code and ref.seq_len is None
    assert ref.tokenizer_path == ref.config_path == DEMO_MODEL


def test_an_adapter_folder_applies_to_its_base(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "my-adapter", str(DEMO_MODEL))
    ref = resolve_model(str(folder), tmp_path)
    assert ref.is_adapter and ref.path == folder and ref.base == DEMO_MODEL
    assert ref.config_path == DEMO_MODEL
    assert ref.tokenizer_path == DEMO_MODEL  # the adapter folder has no tokenizer of its own
    (folder / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    assert resolve_model(str(folder), tmp_path).tokenizer_path == folder


def test_an_adapter_whose_base_is_not_here_is_refused(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "hub-adapter", "meta-llama/Llama-3.1-8B")
    with pytest.raises(HomelabError) as err:
        resolve_model(str(folder), tmp_path)
    assert "'meta-llama/Llama-3.1-8B' is not a local model folder" in err.value.message
    assert "merged model folder" in err.value.hint


def test_a_folder_that_is_no_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HomelabError) as err:
        resolve_model(str(tmp_path), tmp_path / "runs")
    assert "not a model folder (no config.json) nor an adapter" in err.value.message


def test_a_run_folder_gives_its_full_result_and_settings(runs: Path) -> None:
    run_dir = runs / "20260101-000000-full-aaaa"
    ref = resolve_model(str(run_dir), runs)
    assert (ref.name, ref.path, ref.base, ref.run_dir) == (run_dir.name, run_dir / "final", None,
                                                           run_dir)  # fmt: skip
    assert ref.seq_len == 48 and ref.data_path == DEMO_DATA and ref.dtype == "auto"
    assert ref.data_format == "auto" and not ref.trust_remote_code


def test_a_lora_run_gives_its_adapter_on_the_base(runs: Path) -> None:
    run_dir = runs / "20260101-000000-lora-bbbb"
    ref = resolve_model(str(run_dir), runs)
    assert ref.is_adapter and ref.path == run_dir / "final" and ref.base == DEMO_MODEL


def test_an_adapter_naming_a_hub_base_falls_back_to_the_runs_model(runs: Path) -> None:
    """peft writes the name the base was loaded by; the run's preset says where it is."""
    run_dir = runs / "20260101-000000-lora-bbbb"
    _adapter(run_dir / "final", "someone/not-downloaded")
    assert resolve_model(str(run_dir), runs).base == DEMO_MODEL


def test_a_merged_result_is_preferred_to_the_adapter(runs: Path) -> None:
    run_dir = runs / "20260102-000000-merged-cccc"
    ref = resolve_model(str(run_dir), runs)
    assert ref.path == run_dir / "final" / "merged" and not ref.is_adapter


def test_a_run_id_and_a_unique_prefix(runs: Path) -> None:
    full = runs / "20260101-000000-full-aaaa"
    assert resolve_model("20260101-000000-full-aaaa", runs).run_dir == full
    assert resolve_model("20260102", runs).run_dir == runs / "20260102-000000-merged-cccc"
    assert find_run("20260101-000000-f", runs) == full
    assert find_run("2027", runs) is None


def test_an_ambiguous_prefix_is_refused(runs: Path) -> None:
    with pytest.raises(HomelabError) as err:
        resolve_model("20260101", runs)
    assert "run id prefix '20260101' matches 2 runs" in err.value.message
    assert "20260101-000000-full-aaaa" in err.value.message
    assert "more of the id" in err.value.hint


def test_a_run_without_a_result_says_what_to_do(runs: Path) -> None:
    with pytest.raises(HomelabError) as err:
        resolve_model("20260103", runs)
    assert err.value.message.startswith("run 20260103-000000-unfinished-dddd has no result yet")
    assert "resume 20260103-000000-unfinished-dddd" in err.value.hint


def test_a_missing_name_is_refused(runs: Path, tmp_path: Path) -> None:
    for ref in ("no-such-run", str(tmp_path / "no" / "such" / "folder"), ""):
        with pytest.raises(HomelabError) as err:
            resolve_model(ref, runs)
        assert f"model {ref!r}: no such folder, and no run with that id" in err.value.message
        assert "homelab-dp runs" in err.value.hint
