"""train.compile and TF32: when they turn on, and that compiling keeps the layers' results."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from homelab_dp.errors import PresetError
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.train.loop.layer_compile import compile_layers, compile_wanted
from homelab_dp.train.loop.tf32 import enable_tf32


def test_auto_compiles_only_full_and_lora_on_cuda_with_triton() -> None:
    triton = importlib.util.find_spec("triton") is not None
    assert compile_wanted("auto", "cuda", "full") is triton
    assert compile_wanted("auto", "cuda", "lora") is triton
    assert compile_wanted("auto", "cuda", "qlora") is False
    assert compile_wanted("auto", "cpu", "full") is False
    # An explicit choice is obeyed everywhere.
    assert compile_wanted(True, "cpu", "qlora") is True
    assert compile_wanted(False, "cuda", "full") is False


def test_preset_takes_auto_true_false_and_names_a_bad_value() -> None:
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    for value in ("auto", True, False):
        assert preset_from_dict({**base, "train": {"compile": value}}).train.compile == value
    with pytest.raises(PresetError, match="train.compile"):
        preset_from_dict({**base, "train": {"compile": "yes"}})


def test_tf32_stays_off_on_the_cpu_and_for_fp32_runs() -> None:
    before = torch.get_float32_matmul_precision()
    assert enable_tf32(torch.device("cpu"), "bf16") is False
    assert enable_tf32(torch.device("cpu"), "fp32") is False
    assert torch.get_float32_matmul_precision() == before


def test_compiled_layers_keep_names_and_results() -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2)]
    x = torch.randn(3, 8)
    eager = [layer(x) for layer in layers]
    names = [n for layer in layers for n, _ in layer.named_parameters()]
    assert compile_layers(layers, strict=True) == 2
    # Compiled in place: the same modules and parameter names (FSDP2 units, state dict keys).
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)
    assert [n for layer in layers for n, _ in layer.named_parameters()] == names
    if importlib.util.find_spec("triton") is None and not _cpu_compiler():
        pytest.skip("no C++ compiler for the CPU backend")
    for layer, want in zip(layers, eager, strict=True):
        torch.testing.assert_close(layer(x), want)


def _cpu_compiler() -> bool:
    import shutil

    return shutil.which("g++") is not None or shutil.which("c++") is not None
