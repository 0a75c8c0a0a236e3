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
# Each test that runs NF4 on the CPU skips itself where bitsandbytes cannot (`pytest -rs` lists
# it with this reason); the rule itself and the config are checked everywhere.
NO_CPU_NF4 = pytest.mark.skipif(
    not nf4_works("cpu"),
    reason="bitsandbytes has no working CPU 4-bit kernels here (nf4_works('cpu') is False)",
)


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


@NO_CPU_NF4
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


@NO_CPU_NF4
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


def test_nf4_works_on_the_cpu_with_the_bitsandbytes_the_project_requires() -> None:
    """pyproject.toml requires bitsandbytes >= 0.50, the first whose CPU kernels run QLoRA:
    where that release is installed, a 4-bit round trip on the CPU works; no CUDA, no NF4 on
    CUDA."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    major, minor = (int(p) for p in bnb.__version__.split(".")[:2])
    if (major, minor) < (0, 50):
        pytest.skip(f"bitsandbytes {bnb.__version__} is older than the project's floor 0.50")
    assert nf4_works("cpu")
    assert nf4_works("cuda") == torch.cuda.is_available()


def test_nf4_does_not_work_where_bitsandbytes_has_no_kernel(monkeypatch) -> None:
    """A bitsandbytes without kernels for the device (its call raises) answers False."""
    bnbf = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")

    def no_kernel(*_args, **_kwargs):
        raise NotImplementedError("no kernel for this device")  # as a build without it raises

    monkeypatch.setattr(bnbf, "quantize_4bit", no_kernel)
    nf4_works.cache_clear()  # asked once per process; ask again with the kernel gone
    try:
        assert not nf4_works("cpu")
    finally:
        nf4_works.cache_clear()


def test_the_nf4_config_is_qloras() -> None:
    """The one NF4 rule eval's worker, chat and serve share. The config is QLoRA's: NF4, double
    quantization, uint8 storage unless FSDP2 asks for the compute dtype."""
    config = nf4_config(torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_use_double_quant and config.bnb_4bit_quant_storage == torch.uint8
    assert (
        nf4_config(torch.bfloat16, storage=torch.bfloat16).bnb_4bit_quant_storage == torch.bfloat16
    )


@pytest.fixture(scope="module")
def moe_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random Qwen3-MoE base (safetensors) and a QLoRA-style adapter on its attention."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("qlora-moe")
    torch.manual_seed(3)
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2)  # fmt: skip
    base = root / "base"
    Qwen3MoeForCausalLM(config).save_pretrained(base)
    AutoTokenizer.from_pretrained(DEMO_MODEL).save_pretrained(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False)  # fmt: skip
    folder = root / "final"
    get_peft_model(Qwen3MoeForCausalLM.from_pretrained(base), lora).save_pretrained(folder)
    return base, folder


def test_a_qlora_moe_result_is_served_and_evaluated_on_nf4_experts(moe_adapter) -> None:
    """Issue 32, point 5: bitsandbytes converts nn.Linear only; the fused experts are quantized
    as training quantizes them, in serving (chat) and in eval alike: the same logits as the
    base the run trained on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from homelab_dp.nf4_quantization import is_fused_experts, quantize_experts
    from homelab_dp.train.evaluation.eval_worker import load_model as load_eval_model
    from homelab_dp.train.model.lora import disable_cpu_bf16_repack

    base, adapter = moe_adapter
    ref = ModelRef(name="run", path=adapter, base=base, quantized="nf4")
    loaded = load_for_inference(ref, "cpu")
    experts = [m for m in loaded.model.modules() if is_fused_experts(m)]
    assert len(experts) == 2
    assert all("gate_up_proj_nf4" in m._parameters and "gate_up_proj" not in m._parameters
               for m in experts)  # fmt: skip
    job = {"base_path": str(base), "model_path": str(adapter), "trust_remote_code": False,
           "quantized": "nf4"}  # fmt: skip
    evaluated = load_eval_model(job, torch.device("cpu"), torch.float32, "nf4")
    assert all("gate_up_proj_nf4" in m._parameters
               for m in evaluated.modules() if is_fused_experts(m))  # fmt: skip

    def trained(repack: bool):  # noqa: ANN202 - what the run trained on, built as the worker does
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=torch.float32, quantization_config=nf4_config(torch.float32),
            device_map={"": "cpu"},
        )  # fmt: skip
        quantize_experts(model, torch.float32)  # as the worker's QLoRA load does
        if not repack:
            disable_cpu_bf16_repack(model)  # eval computes with the in-run eval's CPU kernel
        return PeftModel.from_pretrained(model, adapter)

    ids = torch.tensor([[5, 9, 30, 7]])
    for got_model, repack in ((loaded.model, True), (evaluated, False)):
        got, want = _logits(got_model, ids), _logits(trained(repack), ids)
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
