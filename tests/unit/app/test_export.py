"""`homelab-dp export`: a merged export computes what the base with its adapter computes; the
Modelfile's exact lines; every refusal exits 2 before anything is written.

The runs are real run folders (`make_run` writes spec.json through `runs.folder.run_folder`, as the
controller does); the LoRA run's ``final/`` is a real PEFT adapter on the demo model with a
nonzero ``lora_B`` (a fresh adapter's update is zero: it would not tell a merge from none).
The merges run in this process on the CPU, as the CLI runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from homelab_dp.cli.main import main
from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec
from homelab_dp.serving.replica.prompt_templates import (
    CHAT,
    PLAIN,
    Template,
    build_modelfile,
    cut_chat_template,
)
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL, make_run

LORA = "20260301-000000-lora-aaaa"
BF16 = "20260301-000000-lora-bf16-bbbb"
FULL = "20260301-000000-full-cccc"
UNFINISHED = "20260301-000000-unfinished-dddd"
IDS = torch.tensor([[0, 71, 300, 5, 911, 42, 7, 1500]])


def _adapter(folder: Path) -> None:
    """A LoRA adapter on the demo model with random, nonzero lora_B, saved as a run saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO_MODEL).save_pretrained(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run (fp32, a CPU run), the same adapter in a bf16 run, a full run, one unfinished."""
    root = tmp_path_factory.mktemp("export") / "runs"
    lora = make_run(root, DEMO_MODEL, DEMO_DATA, name=LORA, method="lora")
    _adapter(lora / "final")
    bf16 = make_run(root, DEMO_MODEL, DEMO_DATA, name=BF16, method="lora")
    spec = read_run_spec(bf16)
    write_run_spec(bf16, replace(spec, resolved=replace(spec.resolved, dtype="bf16")))
    shutil.copytree(lora / "final", bf16 / "final")
    full = make_run(root, DEMO_MODEL, DEMO_DATA, name=FULL)
    shutil.copytree(DEMO_MODEL, full / "final")
    make_run(root, DEMO_MODEL, DEMO_DATA, name=UNFINISHED)
    return root


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    """`homelab-dp export ARGS --json`: exit code, the JSON document (None on error), stderr."""
    rc = main(["export", *args, "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _leftovers(parent: Path) -> list[str]:
    """Hidden staging folders an export left beside its output (there must be none)."""
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_merged_export_computes_the_base_plus_its_adapter(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    rc, doc, err = _export(capsys, str(runs / LORA), "--format", "merged", "--out", str(out))
    assert rc == 0, err
    files = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
             "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    assert doc == {"format": "merged", "out": str(out), "files": files, "dtype": "fp32",
                   "bytes": sum((out / f).stat().st_size for f in files), "notes": []}  # fmt: skip
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert not (out / "adapter_config.json").exists() and _leftovers(tmp_path) == []

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    base_logits = _logits(base)
    with_adapter = PeftModel.from_pretrained(base, runs / LORA / "final").eval()  # not merged
    expected = _logits(with_adapter)
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter changes the answer
    torch.testing.assert_close(_logits(merged), expected, rtol=1e-5, atol=1e-5)


def test_ollama_export_writes_the_modelfile_in_the_runs_dtype(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 run (a CUDA run's compute dtype) exports bf16 weights; the demo data is
    instruction data, so the template is the instruction prompt the run trained on."""
    monkeypatch.setenv("HOMELAB_DP_RUNS", str(runs))  # the run named by its id
    from safetensors import safe_open

    out = tmp_path / "ollama"
    rc, doc, err = _export(capsys, BF16, "--format", "ollama", "--out", str(out))  # by run id
    assert rc == 0, err
    assert doc is not None and "Modelfile" in doc["files"] and doc["dtype"] == "bf16"
    assert doc["notes"] == ["template: instruction"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()}  # noqa: SIM118 == {torch.bfloat16}
    modelfile = (out / "Modelfile").read_text(encoding="utf-8")
    assert modelfile == (
        "FROM .\n"
        'TEMPLATE """{{ $sys := "" }}{{ range .Messages }}{{ if eq .Role "system" }}'
        '{{ if $sys }}{{ $sys = printf "%s\\n\\n%s" $sys .Content }}{{ else }}'
        "{{ $sys = .Content }}{{ end }}{{ end }}{{ end }}"
        '{{ $pending := "" }}{{ $has := false }}{{ $first := true }}{{ range .Messages }}'
        '{{ if eq .Role "user" }}{{ if $has }}{{ $pending = printf "%s\\n\\n%s" $pending '
        ".Content }}{{ else }}{{ $pending = .Content }}{{ end }}{{ $has = true }}"
        '{{ else if eq .Role "assistant" }}### Instruction:\n'
        "{{ if and $first $sys }}{{ $sys }}{{ if $pending }}\n\n{{ $pending }}{{ end }}"
        "{{ else }}{{ $pending }}{{ end }}\n\n### Response:\n{{ .Content }}\n\n"
        '{{ $first = false }}{{ $pending = "" }}{{ $has = false }}{{ end }}{{ end }}'
        "### Instruction:\n"
        "{{ if and $first $sys }}{{ $sys }}{{ if $pending }}\n\n{{ $pending }}{{ end }}"
        '{{ else }}{{ $pending }}{{ end }}\n\n### Response:\n"""\n'
        'PARAMETER stop "</s>"\n'
        'PARAMETER stop "### Instruction:"\n'
    )
    rc, _, err = _export(capsys, BF16, "--format", "ollama", "--out", str(out))
    assert rc == 2 and "the folder is not empty; an export never overwrites" in err


def test_chat_and_plain_modelfiles() -> None:
    """A chat run's template is cut from the tokenizer's chat template (without the <s> the
    tokenizer adds by itself); text and completion runs continue the messages' text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    chat = build_modelfile(tokenizer, Template(CHAT), ["</s>"])
    assert chat.template_kind == "chat" and chat.notes == []
    assert chat.text == (
        "FROM .\n"
        'TEMPLATE """{{ range .Messages }}{{ if eq .Role "system" }}<|system|>\n'
        '{{ .Content }}</s>{{ else if eq .Role "user" }}<|user|>\n'
        '{{ .Content }}</s>{{ else if eq .Role "assistant" }}<|assistant|>\n'
        '{{ .Content }}</s>{{ end }}{{ end }}<|assistant|>\n"""\n'
        'PARAMETER stop "</s>"\n'
    )
    plain = build_modelfile(tokenizer, Template(PLAIN), ["</s>"], "./model.gguf")
    assert plain.text == (
        "FROM ./model.gguf\n"
        'TEMPLATE """{{ range $i, $m := .Messages }}{{ if $i }}\n{{ end }}{{ $m.Content }}'
        '{{ end }}"""\n'
        'PARAMETER stop "</s>"\n'
    )
    # The cut renders conversations exactly as the chat template does (after the <s>).
    parts = cut_chat_template(tokenizer)
    assert parts is not None
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]  # fmt: skip
    rendered = tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True)
    assert "<s>" + parts.render(talk) == rendered
    # ChatML: its end of turn is a stop string too.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chatml = build_modelfile(tokenizer, Template(CHAT), ["</s>"])
    assert chatml.text.endswith(
        '{{ .Content }}<|im_end|>\n{{ end }}{{ end }}<|im_start|>assistant\n"""\n'
        'PARAMETER stop "</s>"\nPARAMETER stop "<|im_end|>"\n'
    )
    # A template that moves the system message into the first turn does not cut: no TEMPLATE.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% set s = m['content'] %}"
        "{% else %}[{{ m['role'] }}] {{ m['content'] }}{% endif %}{% endfor %}"
    )
    uncut = build_modelfile(tokenizer, Template(CHAT), ["</s>"])
    assert uncut.template_kind == "none" and "TEMPLATE" not in uncut.text
    assert "ollama create` detects the template" in uncut.notes[0]


def test_refusals_exit_2_and_write_nothing(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    rc, _, err = _export(capsys, str(runs / FULL), "--format", "adapter", "--out", str(out))
    assert rc == 2 and f"error: {FULL}: a full fine-tune has no adapter to export" in err
    assert "hint: export its model with --format hf" in err

    rc, _, err = _export(capsys, str(runs / UNFINISHED), "--format", "merged", "--out", str(out))
    assert rc == 2 and f"run {UNFINISHED} has no result yet" in err
    assert f"resume {UNFINISHED}" in err

    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no convert_hf_to_gguf.py there
    rc, _, err = _export(capsys, str(runs / LORA), "--format", "gguf", "--out", str(out))
    assert rc == 2 and "error: gguf export needs llama.cpp's converter" in err
    assert "git clone https://github.com/ggml-org/llama.cpp and set LLAMA_CPP_DIR" in err
    assert 'pip install "homelab-dp[gguf]"' in err and "gguf package alone has no" in err
    assert not out.exists()

    inside = runs / LORA / "final" / "export"
    rc, _, err = _export(capsys, str(runs / LORA), "--format", "adapter", "--out", str(inside))
    assert rc == 2 and f"--out {inside}: inside {runs / LORA}, which the export reads" in err
    assert not inside.exists()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = _export(capsys, str(runs / LORA), "--format", "adapter", "--out", str(out))
    assert rc == 2 and f"error: --out {out}: the folder is not empty" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (
        out / "keep.txt"
    ).read_text() == "mine"
    assert _leftovers(tmp_path) == []


def test_adapter_and_hf_exports_copy_the_result(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty folder is fine; a full run's hf export is its final/ as it is."""
    monkeypatch.setenv("HOMELAB_DP_RUNS", str(runs))
    out = tmp_path / "adapter"
    out.mkdir()
    rc, doc, err = _export(capsys, str(runs / LORA), "--format", "adapter", "--out", str(out))
    assert rc == 0, err
    assert doc is not None and "adapter_model.safetensors" in doc["files"]
    final = runs / LORA / "final"
    assert (out / "adapter_model.safetensors").read_bytes() == (
        final / "adapter_model.safetensors"
    ).read_bytes()
    rc, doc, err = _export(capsys, FULL, "--format", "hf", "--out", str(tmp_path / "hf"))
    assert rc == 0, err
    assert doc is not None and doc["files"] == sorted(p.name for p in DEMO_MODEL.iterdir())
    assert doc["dtype"] == "as saved"
    # What is exported gets the modes any tool would give it under this umask (the staging
    # folder was mkdtemp's 0700, a copied or saved file may come 0600).
    os.chmod(final / "adapter_model.safetensors", 0o600)  # as a run's private folder holds it
    rc, doc, err = _export(
        capsys, str(runs / LORA), "--format", "adapter", "--out", str(tmp_path / "modes")
    )
    assert rc == 0, err
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "modes").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert (tmp_path / "modes").stat().st_mode & 0o777 == 0o777 & ~umask


def test_gguf_runs_llama_cpps_converter_on_the_merge(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp is an outside tool: a stand-in converter records what it was given; a
    converter that fails leaves no output folder (exit 1: not bad input)."""
    llama = tmp_path / "llama.cpp"
    llama.mkdir()
    (llama / "convert_hf_to_gguf.py").write_text(
        "import json, os, sys\n"
        "src, out = sys.argv[1], sys.argv[sys.argv.index('--outfile') + 1]\n"
        "if os.environ.get('FAKE_CONVERTER_FAILS'): sys.exit('unknown architecture')\n"
        "doc = {'argv': sys.argv[2:], 'files': sorted(os.listdir(src))}\n"
        "open(out, 'w').write(json.dumps(doc))\n"
    )
    monkeypatch.setenv("LLAMA_CPP_DIR", str(llama))
    monkeypatch.setenv("FAKE_CONVERTER_FAILS", "1")
    out = tmp_path / "gguf"
    rc, _, err = _export(capsys, str(runs / LORA), "--format", "gguf", "--out", str(out))
    assert rc == 1 and "exited with 1: unknown architecture" in err
    assert not out.exists() and _leftovers(tmp_path) == []

    monkeypatch.delenv("FAKE_CONVERTER_FAILS")
    rc, doc, err = _export(capsys, str(runs / LORA), "--format", "gguf", "--out", str(out))
    assert rc == 0, err
    assert doc is not None and doc["files"] == ["Modelfile", "model.gguf"]
    seen = json.loads((out / "model.gguf").read_text())
    assert seen["argv"] == ["--outfile", seen["argv"][1], "--outtype", "f32"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(seen["files"])
    assert (out / "Modelfile").read_text().startswith('FROM ./model.gguf\nTEMPLATE """')


def test_the_export_module_loads_no_torch() -> None:
    """The TUI imports it for the export child: torch stays out of the TUI's process."""
    code = ("import sys, homelab_dp.app.export, homelab_dp.tui.screens.export_dialog; "
            "print('torch' in sys.modules)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.strip() == "False"
