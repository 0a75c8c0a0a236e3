"""A QLoRA result is served and chatted with on the NF4 base it was trained against (issue 22
point 9), where bitsandbytes works: here on the CPU, with bitsandbytes' real 4-bit kernels.

`serving.replica.result_model.load_for_inference` quantizes the base as training does (`nf4_quantization.nf4_config`, one definition for both)
and keeps the adapter apart; the 16-bit merge it used to load computes another function.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from homelab_dp.nf4_quantization import nf4_config, nf4_works
from homelab_dp.runs.model_ref import ModelRef
from homelab_dp.serving.replica.result_model import load_for_inference

DEMO_MODEL = Path(__file__).resolve().parents[3] / "assets" / "models" / "tiny-llama"
pytestmark = pytest.mark.skipif(not nf4_works("cpu"), reason="no bitsandbytes CPU kernels")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    folder = tmp_path_factory.mktemp("qlora") / "final"
    get_peft_model(AutoModelForCausalLM.from_pretrained(DEMO_MODEL), config).save_pretrained(folder)
    return folder


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_a_qlora_result_generates_on_its_nf4_base(adapter: Path) -> None:
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ref = ModelRef(name="run", path=adapter, base=DEMO_MODEL, quantized="nf4")
    loaded = load_for_inference(ref, "cpu")
    assert loaded.base == "nf4" and loaded.dtype == torch.float32
    linear4 = [m for m in loaded.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linear4) == 4 * 7  # every projection of the 4 layers, as training quantized
    assert any("lora_A" in n for n, _ in loaded.model.named_parameters())
    ids = torch.tensor([loaded.tokenizer("The capital of Voupum is")["input_ids"]])
    got = _logits(loaded.model, ids)
    # What the run trained: the base quantized by the same config, the adapter on top.
    base = AutoModelForCausalLM.from_pretrained(
        DEMO_MODEL, dtype=torch.float32, quantization_config=nf4_config(torch.float32),
        device_map={"": "cpu"},
    )  # fmt: skip
    want = _logits(PeftModel.from_pretrained(base, adapter), ids)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    # The 16-bit merge (what chat and serve loaded before) is another model.
    merged = load_for_inference(ModelRef(name="run", path=adapter, base=DEMO_MODEL), "cpu")
    assert merged.base == "fp32"
    assert float((_logits(merged.model, ids) - want).abs().max()) > 1e-3


def test_the_nf4_model_generates_through_the_engine(adapter: Path) -> None:
    """Serve's engine and chat run the quantized model as any other (greedy, a few tokens)."""
    from homelab_dp.serving.replica.generation_engine import Engine, Request

    loaded = load_for_inference(
        ModelRef(name="r", path=adapter, base=DEMO_MODEL, quantized="nf4"), "cpu"
    )
    engine = Engine(loaded.model, loaded.tokenizer, context=loaded.context, eos_ids=set())
    prompt = loaded.tokenizer("Hello")["input_ids"]
    (result,) = engine.generate([Request(prompt, 4)])
    assert len(result.token_ids) == 4


def test_nf4_is_what_bitsandbytes_can_do_on_the_device() -> None:
    """The one NF4 rule eval's worker, chat and serve share: a 4-bit round trip on the device;
    no CUDA, no NF4 on CUDA. The config is QLoRA's: NF4, double quantization, uint8 storage
    unless FSDP2 asks for the compute dtype."""
    assert nf4_works("cpu")  # (the module is skipped where it does not)
    assert nf4_works("cuda") == torch.cuda.is_available()
    config = nf4_config(torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_use_double_quant and config.bnb_4bit_quant_storage == torch.uint8
    assert (
        nf4_config(torch.bfloat16, storage=torch.bfloat16).bnb_4bit_quant_storage == torch.bfloat16
    )
