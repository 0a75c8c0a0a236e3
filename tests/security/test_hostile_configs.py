"""config.json is input, and the model-spec cache is not trusted (issue 34, items 2 and 3).

Hostile and damaged values of every kind in a model folder's config.json: `plan` answers exit 2
with one ``error:`` line naming config.json and the field and a ``hint:``, quickly, with no
census child started and nothing cached. A cached spec that is edited, damaged, of another
config, or not a regular file is never believed: it is derived again. The census child runs
under a time and an address-space cap.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.app import model_specs
from homelab_dp.app.model_specs import cache_key, cache_path, model_spec
from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_spec import spec_to_dict
from tests.conftest import run_cli

pytestmark = pytest.mark.beside  # in-process (or one short child): on the free worker

LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
QWEN35 = {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 64, "head_dim": 16,
          "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip
MOE = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32}  # fmt: skip


def _write_raw(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


def _plan_refuses(capsys, folder: Path, *needles: str) -> str:
    start = time.monotonic()
    rc, out, err = run_cli(capsys, "plan", "--model", str(folder), "--gpus", "24GiB")
    took = time.monotonic() - start
    assert rc == 2 and out == "", err
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and "config.json" in lines[0], err
    for needle in needles:
        assert needle in lines[0], err
    assert lines[1].startswith("hint: ") and "Traceback" not in err
    assert len(lines[0]) < 400  # the value is never echoed whole
    assert took < 30  # liveness: no loop over the stated count, no child building it
    assert not (Path(model_specs.data_home()) / "model-specs").exists()  # no census, no cache
    return lines[0]


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({**LLAMA, "hidden_size": "4096"}, "hidden_size"),
    ({**LLAMA, "hidden_size": 64.0}, "hidden_size"),
    ({**LLAMA, "num_hidden_layers": True}, "num_hidden_layers"),
    ({**LLAMA, "num_attention_heads": [4]}, "num_attention_heads"),
    ({**LLAMA, "num_key_value_heads": {"a": 1}}, "num_key_value_heads"),
    ({**LLAMA, "num_attention_heads": 0}, "num_attention_heads"),
    ({**LLAMA, "num_attention_heads": -4}, "num_attention_heads"),
    ({**LLAMA, "num_key_value_heads": 0}, "num_key_value_heads"),
    ({**LLAMA, "num_key_value_heads": 8}, "num_key_value_heads"),
    ({**LLAMA, "head_dim": 0}, "head_dim"),
    ({**LLAMA, "head_dim": -16}, "head_dim"),
    ({**LLAMA, "num_attention_heads": 128}, "num_attention_heads"),
    ({**LLAMA, "vocab_size": -1}, "vocab_size"),
    ({**LLAMA, "intermediate_size": 0}, "intermediate_size"),
    ({**LLAMA, "num_hidden_layers": 10**12}, "num_hidden_layers"),
    ({**LLAMA, "num_hidden_layers": 0}, "num_hidden_layers"),
    ({**LLAMA, "attention_dropout": "0.1"}, "attention_dropout"),
    ({**MOE, "num_experts": 0}, "num_experts"),
    ({**MOE, "num_experts": -8}, "num_experts"),
    ({**MOE, "num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({**MOE, "num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({**MOE, "moe_intermediate_size": -32}, "moe_intermediate_size"),
    ({**MOE, "mlp_only_layers": ["0"]}, "mlp_only_layers"),
    ({**MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({**LLAMA, "model_type": "gemma3_text", "sliding_window": 4, "sliding_window_pattern": 0},
     "sliding_window_pattern"),
    # a derived family (the census child would build it): refused before the child starts
    ({**QWEN35, "num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({**QWEN35, "linear_num_value_heads": 0}, "linear_num_value_heads"),
    ({**QWEN35, "linear_key_head_dim": -1}, "linear_key_head_dim"),
    ({**QWEN35, "layer_types": ["full_attention"] * 3}, "layer_types"),
    ({**QWEN35, "layer_types": "full_attention"}, "layer_types"),
    ({**QWEN35, "text_config": {"hidden_size": -5}}, "text_config.hidden_size"),
    ({**LLAMA, "model_type": "gemma4_text", "num_experts": 4, "top_k_experts": 5}, "top_k_experts"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "field"), BAD_FIELDS, ids=[f"{c['model_type']}-{f}" for c, f in BAD_FIELDS]
)
def test_a_size_no_model_has_is_refused_naming_the_field(cfg, field, tmp_path, capsys) -> None:
    folder = _write_raw(tmp_path, json.dumps(cfg))
    _plan_refuses(capsys, folder, field)


RAW: list[tuple[str, str]] = [
    ('{"model_type": "llama", "hidden_size": Infinity}', "hidden_size"),
    ('{"model_type": "llama", "attention_dropout": NaN}', "attention_dropout"),
    ('{"model_type": "llama", "rope_scaling": {"factor": -Infinity}}', "rope_scaling.factor"),
    ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", "not a model config"),
    ('{"model_type": "llama", "hidden_size": ' + "9" * 40 + "}", "hidden_size"),
    ('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "config.json"),
    ('{"model_type": "llama", "x": ' + "[" * 40 + "]" * 40 + "}", "nested"),
    ('{"model_type": "llama", "x": ' + '{"a":' * 50 + "1" + "}" * 50 + "}", "nested"),
    ("[1, 2, 3]", "expected a JSON object"),
    ("\xff\xfe", "not valid JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "needle"), RAW, ids=[str(i) for i in range(len(RAW))])
def test_damaged_json_is_refused_without_a_traceback(text, needle, tmp_path, capsys) -> None:
    folder = _write_raw(tmp_path, text)
    _plan_refuses(capsys, folder, needle)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "huge"])
def test_a_config_json_that_is_not_a_plain_file_is_not_read(kind, tmp_path, capsys) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "config.json"
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a plain read would block forever
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")  # a plain read would never end
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_text('{"model_type": "llama", "pad": "' + "x" * (17 * 1024 * 1024) + '"}')
    _plan_refuses(capsys, folder)


# --- the model-spec cache --------------------------------------------------------------------


@pytest.fixture
def derived(tmp_path, monkeypatch):
    """A derived family's folder, the census counted (run in this process: the child's own
    function, to keep the test quick) and its cache entry's path."""
    from homelab_dp.train.model.model_census import census

    folder = _write_raw(tmp_path, json.dumps(QWEN35))
    calls: list[Path] = []

    def run(f, **kw):
        calls.append(f)
        return spec_to_dict(census(f, **kw))

    monkeypatch.setattr(model_specs, "run_census", run)
    good = model_spec(folder)
    assert len(calls) == 1
    return folder, calls, good, cache_path(folder, trust_remote_code=False, text_only=False)


def _edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


EDITS = {
    "negative embedding": lambda d: d["spec"].update(embedding_params=-(10**9)),
    "negative group count": lambda d: d["spec"]["blocks"][0].update(count=-3),
    "string hidden": lambda d: d["spec"].update(hidden="64"),
    "bool layers": lambda d: d["spec"].update(layers=True),
    "float vocab": lambda d: d["spec"].update(vocab=128.5),
    "huge layers": lambda d: d["spec"].update(layers=10**12),
    "unknown mixer": lambda d: d["spec"]["blocks"][0]["kind"]["mixers"][0].update(kind="magic"),
    "linear d_in 0": lambda d: d["spec"]["linears"][0].update(d_in=0),
    "linears not a list": lambda d: d["spec"].update(linears={"a": 1}),
    "unknown field": lambda d: d["spec"].update(evil=1),
    "missing field": lambda d: d["spec"].pop("vocab"),
    "groups not adding up": lambda d: d["spec"].update(layers=5),
    "another key": lambda d: d.update(key="0" * 64),
    "no key": lambda d: d.pop("key"),
    "spec not an object": lambda d: d.update(spec=[1, 2]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_cache_entry_is_derived_again(edit, derived) -> None:
    folder, calls, good, path = derived
    _edit(path, EDITS[edit])
    again = model_spec(folder)
    assert again == good and again.params > 0
    assert len(calls) == 2  # derived again, and the entry rewritten whole
    assert json.loads(path.read_text())["key"] == cache_key(
        folder, trust_remote_code=False, text_only=False
    )


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge", "torn", "deep"])
def test_a_cache_path_that_is_not_a_plain_small_file_is_not_read(kind, derived) -> None:
    folder, calls, good, path = derived
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        path.write_text(" " * (model_specs.CACHE_MAX_BYTES + 1))
    elif kind == "torn":
        path.write_text('{"key": "')
    else:
        path.write_text("[" * 100_000 + "]" * 100_000)
    start = time.monotonic()
    assert model_spec(folder) == good
    assert time.monotonic() - start < 30 and len(calls) == 2
    assert path.is_file() and not path.is_symlink()  # replaced by a good entry
    assert Path("/dev/zero").exists()


def test_the_cached_spec_is_read_when_it_passes(derived) -> None:
    folder, calls, good, _ = derived
    assert model_spec(folder) == good and len(calls) == 1


def test_the_census_child_runs_under_an_address_space_cap(tmp_path, monkeypatch) -> None:
    """A child whose address space would outgrow the cap is stopped and named, not waited for
    (here the cap is set below what importing torch takes)."""
    folder = _write_raw(tmp_path, json.dumps(QWEN35))
    monkeypatch.setattr(model_specs, "CENSUS_MEMORY_BYTES", 64 * 1024**2)
    with pytest.raises(ModelSpecError, match=r"config.json.*(outgrew|census failed)"):
        model_specs.run_census(folder, trust_remote_code=False, text_only=False)
    assert model_specs.CENSUS_TIMEOUT_S < 600


@pytest.mark.parametrize(
    "cfg",
    [
        {**LLAMA, "hidden_size": [64, 64]},
        {**LLAMA, "num_attention_heads": [4, 4], "head_dim": 16},
        {**MOE, "num_experts": [8, 8], "num_experts_per_tok": [2]},
        {**LLAMA, "num_hidden_layers": [2, 2]},
    ],
)  # fmt: skip
def test_lists_where_one_size_is_expected_never_crash_the_checks(cfg, tmp_path, capsys) -> None:
    """Per-layer and per-modality size lists are legal in some families; where the planner
    needs one number, a list is refused naming the field, never a TypeError."""
    folder = _write_raw(tmp_path, json.dumps(cfg))
    line = _plan_refuses(capsys, folder)
    assert any(
        f in line
        for f in ("hidden_size", "num_attention_heads", "num_experts", "num_hidden_layers")
    )
