"""The CUDA day-one checks on one card: what the CPU tests can only show with stand-in facts.

    python benchmarks/cuda_day_one.py [--model assets/models/tiny-llama] [--device cuda|cpu] [--json]

Each check runs the project's own code on the card and says what it found (`benchmarks/gpu_validate.py`
runs this script as one of its rows; ``--device cpu`` tests the script itself):

- **attention**: the kernel the worker would load with on this card (`train.model.attention`) and why:
  FlashAttention-2 only with flash-attn 2.x and compute capability 8.0+, else SDPA.
- **packing**: one packed block against its samples run one by one, in the card's 16-bit dtype,
  with that attention (`train.model.packing_check`): the largest logit difference and the tolerance.
- **inference dtypes**: the model loaded for eval/chat/serve in 16-bit (`serving.replica.result_model`): the
  dtype of every rotary ``inv_freq`` buffer (fp32 expected) and of the weights.
- **one bad row fails alone**: the serving engine on the card with a batch of four requests, two
  hostile (a temperature whose logits overflow, a seed beyond 64 bits): the good rows' tokens
  equal the same requests decoded alone.
- **pinned host memory, activation offload**: HostAdamW's pinned bytes against the plan's host
  line for them (`planning.memory.pinned_memory`: torch's caching host allocator rounds each block up to a
  power of two); `train.parallelism.activation_offload` on a small MLP: weights kept on the card,
  activations moved, gradients bitwise those without offload.
- **device order**: a replica named by NVML index gets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, and torch
  in a child with that environment sees the card NVML calls index 0.
- **MIG**: the probe's MIG mode per card against ``nvidia-smi``'s.
- **MoE NF4 experts**: a small random Qwen3-MoE with its fused expert stacks in NF4
  (`nf4_quantization.quantize_experts`, the `homelab_nf4` experts implementation) against the same model
  with the experts bitsandbytes-dequantized: the loss, its backward, and the peak memory.

Prints one JSON object per check with ``--json`` (``{"check", "ok", ...}``), else a line each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def half(device: str) -> str:
    """The 16-bit dtype a run would use here: bf16 on sm80+, fp16 below, fp32 on the CPU."""
    import torch

    if device == "cpu":
        return "fp32"
    return "bf16" if torch.cuda.get_device_capability(0) >= (8, 0) else "fp16"


def torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def check_attention_and_packing(model: Path, device: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from homelab_dp.train.model.attention import attention_choice
    from homelab_dp.train.model.packing_check import check_model

    dtype = half(device)
    impl, why = attention_choice(device, dtype)
    m = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch_dtype(dtype), attn_implementation=impl
    ).to(device)
    found = check_model(m, device=torch.device(device), dtype=dtype, fsdp=False)
    return {
        "ok": found.exact,
        "attention": impl,
        "why": why,
        "dtype": dtype,
        "packing": found.verdict,
        "max_diff": found.max_diff,
        "tolerance": found.tolerance,
    }


def check_inference_dtypes(model: Path, device: str) -> dict[str, Any]:
    from homelab_dp.runs.model_ref import resolve_model
    from homelab_dp.serving.replica.result_model import load_for_inference

    dtype = torch_dtype("bf16" if device == "cpu" else half(device))
    loaded = load_for_inference(resolve_model(str(model)), device, dtype=dtype)
    rope = sorted({str(b.dtype) for n, b in loaded.model.named_buffers() if "inv_freq" in n})
    weights = sorted({str(p.dtype) for p in loaded.model.parameters()})
    return {"ok": rope == ["torch.float32"], "inv_freq": rope, "weights": weights,
            "base": loaded.base}  # fmt: skip


def check_one_bad_row(model: Path, device: str) -> dict[str, Any]:
    from homelab_dp.runs.model_ref import resolve_model
    from homelab_dp.serving.replica.generation_engine import Engine, Request
    from homelab_dp.serving.replica.prompt_templates import eos_ids, prompt_ids
    from homelab_dp.serving.replica.result_model import load_for_inference

    loaded = load_for_inference(resolve_model(str(model)), device)
    engine = Engine(loaded.model, loaded.tokenizer, context=loaded.context,
                    eos_ids=eos_ids(loaded.tokenizer, loaded.model))  # fmt: skip
    ids = prompt_ids(loaded.tokenizer, prompt="Hello")
    good = [Request(ids, 8, 0.7, seed=1), Request(ids, 8, 0.0)]
    batch = [good[0], Request(ids, 8, 1e-40), Request(ids, 8, 0.7, seed=2**64), good[1]]
    together = engine.generate(batch)
    alone = [engine.generate([Request(ids, 8, r.temperature, seed=r.seed)])[0] for r in good]
    reasons = [r.finish_reason for r in together]
    same = [together[0].token_ids, together[3].token_ids] == [a.token_ids for a in alone]
    return {"ok": reasons[1:3] == ["error", "error"] and "error" not in (reasons[0], reasons[3])
            and same, "finish_reasons": reasons, "good_rows_as_alone": same}  # fmt: skip


def check_pinned_and_offload(
    device: str, read_pinned: Callable[[], int] | None = None
) -> dict[str, Any]:
    """HostAdamW pins what the plan's host line says (one flat buffer per kind, rounded up to a
    power of two by torch's caching host allocator); activation offload keeps the weights on
    the card, moves the activations and changes no bit of the gradients."""
    import torch

    from homelab_dp.planning.memory.pinned_memory import host_adamw_pinned_bytes
    from homelab_dp.train.parallelism.activation_offload import ActivationOffload
    from homelab_dp.train.parallelism.host_optimizer import HostAdamW

    cuda = device == "cuda"

    def pinned() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    if read_pinned is None and cuda:
        read_pinned = pinned
    base = read_pinned() if read_pinned is not None else 0
    params = [
        torch.nn.Parameter(torch.randn(n, device=device)) for n in (3_000_000, 1_500_000, 700_001)
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = HostAdamW(params)
    optimizer.step()
    planned = host_adamw_pinned_bytes(4 * sum(p.numel() for p in params))
    # Read while the optimizer is alive: its pinned buffers go back to the caching host
    # allocator (allocated_bytes.current falls) once it is freed.
    measured = read_pinned() - base if read_pinned is not None else None
    del optimizer
    m = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).to(device)
    x = torch.randn(512, 1024, device=device, requires_grad=True)
    ref = torch.autograd.grad(m(x).square().sum(), [x, *m.parameters()])
    off = ActivationOffload(m, pin=cuda)
    with off.context():
        y = m(x).square().sum()
    got = torch.autograd.grad(y, [x, *m.parameters()])
    exact = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    return {"ok": (measured is None or measured == planned) and exact
            and off.kept_bytes >= 2 * 4 * 1024 * 4096, "host_adamw_planned": planned,
            "host_adamw_pinned": measured, "activations_moved": off.moved_bytes,
            "weights_kept": off.kept_bytes, "gradients_bitwise": exact}  # fmt: skip


def check_device_order(device: str) -> dict[str, Any]:
    from homelab_dp.probe.nvml import probe
    from homelab_dp.probe.visible_gpus import cuda_device_env

    if device == "cpu":
        env = cuda_device_env(os.environ, ["0"])
        return {"ok": env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", "env": "PCI_BUS_ID"}
    first = probe().gpus[0]  # the first card CUDA_VISIBLE_DEVICES leaves, as the probe reads it
    env = cuda_device_env(os.environ, [str(first.index)])
    nvml_name = first.name
    code = "import torch; print(torch.cuda.get_device_name(0))"
    seen = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    return {"ok": seen == nvml_name, "nvml_index_0": nvml_name, "torch_cuda_0": seen}


def check_mig(device: str) -> dict[str, Any]:
    from homelab_dp.probe.nvml import probe

    smi = shutil.which("nvidia-smi")
    if device == "cpu" or smi is None:
        return {"ok": True, "skipped": "no nvidia-smi"}
    query = [smi, "--query-gpu=index,mig.mode.current,mig.mode.pending", "--format=csv,noheader"]
    lines = subprocess.run(query, capture_output=True, text=True, check=True).stdout.splitlines()
    ours = {g.index: g for g in probe().gpus}
    rows, ok = [], True
    for line in lines:
        index, current, pending = (x.strip() for x in line.split(","))
        want = None if "N/A" in current else (current == "Enabled", pending == "Enabled")
        g = ours.get(int(index))
        got = None if g is None or g.mig is None else (g.mig.enabled, g.mig.pending)
        ok = ok and got == want
        rows.append({"index": int(index), "nvidia_smi": want, "probe": got})
    return {"ok": ok, "cards": rows}


def check_moe_nf4(device: str) -> dict[str, Any]:
    """QLoRA's NF4 expert stacks on the card: the loss equals the model whose experts hold the
    dequantized values (the same bitsandbytes dequantization), backward runs, and the peak."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"ok": True, "skipped": "bitsandbytes not installed (carry its wheel to run it)"}
    import copy

    import torch
    import transformers as tf

    from homelab_dp.nf4_quantization import (
        dequantize_experts,
        is_fused_experts,
        quantize_experts,
    )

    cuda = device == "cuda"
    size = (512, 32, 4, 256) if cuda else (64, 8, 2, 32)  # hidden, experts, top-k, seq
    hidden, experts, top_k, seq = size
    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                            intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                            num_experts=experts, num_experts_per_tok=top_k)  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    quantized, reference = copy.deepcopy(model), copy.deepcopy(model)
    packed = quantize_experts(quantized, dtype)
    pairs = zip([m for m in quantized.modules() if is_fused_experts(m)],
                [m for m in reference.modules() if is_fused_experts(m)], strict=True)  # fmt: skip
    for q, r in pairs:
        for name, value in dequantize_experts(q).items():
            getattr(r, name).data.copy_(value)
    ids = torch.randint(0, 512, (2, seq), device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loss_q = quantized(input_ids=ids, labels=ids).loss
    loss_q.backward()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    loss_r = reference(input_ids=ids, labels=ids).loss
    diff = abs(loss_q.item() - loss_r.item())
    return {"ok": diff < (2e-2 if cuda else 1e-5), "quantized_values": packed,
            "loss_nf4": loss_q.item(), "loss_dequantized": loss_r.item(), "diff": diff,
            "peak_bytes": peak}  # fmt: skip


def check_packed_attention(device: str) -> dict[str, Any]:
    """``homelab_packed`` on the device: the route taken (torch's varlen_attn in bf16 on a card
    of compute capability 8.0+, SDPA per sample elsewhere), packed logits and gradients against
    each sample alone, and on a card the packed step's peak against the unpacked loop's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from homelab_dp.train.model.packed_attention import (
        PACKED_ATTENTION,
        register,
        take_route_counts,
    )

    register()
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512 if cuda else 64,
                      intermediate_size=1536 if cuda else 128, num_hidden_layers=4 if cuda else 2,
                      num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=PACKED_ATTENTION, dtype=dtype)
    model = model.to(device)
    rows = [[700, 150, 1200, 2046], [33, 4000, 63]] if cuda else [[7, 15, 10], [20, 12]]
    g = torch.Generator().manual_seed(1)
    samples = [[torch.randint(3, 2048, (n,), generator=g) for n in row] for row in rows]
    width = max(sum(row) for row in rows)
    pad = [width - sum(row) for row in rows]  # a row shorter than the block ends in a sample
    for row, extra in zip(samples, pad, strict=True):
        if extra:
            row.append(torch.randint(3, 2048, (extra,), generator=g))
    ids = torch.stack([torch.cat(r) for r in samples]).to(device)
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in samples]).to(device)
    take_route_counts()  # the routes of this forward alone, counted
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    route = ", ".join(f"{k} ×{n}" for k, n in sorted(take_route_counts().items()))
    packed.square().mean().backward()
    peak_packed = torch.cuda.max_memory_allocated() - base if cuda else None
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    alone, loss = [], 0.0
    for row in samples:  # the unpacked loop: every sample alive until one backward
        outs = []
        for sample in row:
            out = model(input_ids=sample[None].to(device), use_cache=False).logits.float()[0]
            loss = loss + out.square().sum() / packed.numel()
            outs.append(out.detach())
        alone.append(torch.cat(outs))
    loss.backward()
    peak_alone = torch.cuda.max_memory_allocated() - base if cuda else None
    ref = torch.stack(alone)
    logit_err = float((packed.detach() - ref).abs().max() / ref.abs().max())
    grad_err = max(
        float((grads[n] - p.grad.float()).norm() / p.grad.float().norm().clamp_min(1e-12))
        for n, p in model.named_parameters()
    )
    if cuda:
        assert peak_packed is not None and peak_alone is not None
        ok = route == "varlen ×4" and logit_err < 2e-2 and grad_err < 5e-2
        ok = ok and peak_packed <= 1.05 * peak_alone
    else:
        ok = route == "sdpa ×2" and logit_err < 1e-5 and grad_err < 1e-4
    return {"ok": ok, "route": route, "logit_err": logit_err, "grad_err": grad_err,
            "peak_packed_bytes": peak_packed, "peak_unpacked_bytes": peak_alone}  # fmt: skip


def check_preference_log_probs(device: str) -> dict[str, Any]:
    """DPO's per-sequence log-probabilities on the device in its compute dtype (fp32 sums of
    the target rows) against a plain log-softmax, and the loss of a policy equal to its
    reference: ln 2."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from homelab_dp.train.objectives.preference_losses import dpo_loss, sequence_log_probs

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "models" / "tiny-llama",
                                                 dtype=dtype).to(device).eval()  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 64), generator=g).to(device)
    labels = ids.roll(-1, 1)
    labels[:, :20] = -100
    labels[:, -1] = -100
    seq = torch.arange(2, device=device)[:, None].expand(2, 64)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    logps, tokens = sequence_log_probs(logits, labels, seq, 2, dtype=torch.float32)
    direct = torch.log_softmax(logits.float(), -1).gather(2, labels.clamp(min=0)[..., None])
    direct = direct.squeeze(2).masked_fill(labels < 0, 0).sum(1)
    err = float((logps - direct).abs().max() / direct.abs().max())  # relative
    loss, _, _ = dpo_loss(logps[:1], logps[1:], logps[:1], logps[1:], beta=0.1,
                          loss_type="sigmoid", label_smoothing=0.0)  # fmt: skip
    loss_err = abs(float(loss.mean()) - math.log(2))
    ok = err < (1e-4 if cuda else 1e-6) and loss_err < 1e-6 and int(tokens.sum()) == 2 * 43
    return {"ok": ok, "logp_rel_err": err, "first_loss_minus_ln2": loss_err}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "assets" / "models" / "tiny-llama")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("attention and packing", lambda: check_attention_and_packing(args.model, args.device)),
        ("inference dtypes", lambda: check_inference_dtypes(args.model, args.device)),
        ("one bad row fails alone", lambda: check_one_bad_row(args.model, args.device)),
        ("pinned host memory, activation offload", lambda: check_pinned_and_offload(args.device)),
        ("device order", lambda: check_device_order(args.device)),
        ("MIG mode", lambda: check_mig(args.device)),
        ("MoE NF4 experts", lambda: check_moe_nf4(args.device)),
        ("packed attention (homelab_packed)", lambda: check_packed_attention(args.device)),
        ("DPO log-probabilities", lambda: check_preference_log_probs(args.device)),
    ]
    for name, check in checks:
        try:
            doc = {"check": name, **check()}
        except Exception as exc:  # a check that cannot run is a row saying why, not the end
            doc = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                   "where": traceback.format_exc().strip().splitlines()[-2:]}  # fmt: skip
        if args.json:
            print(json.dumps(doc, default=str), flush=True)
        else:
            print(f"[{name}] {'ok' if doc['ok'] else 'FAILED'}: {doc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
