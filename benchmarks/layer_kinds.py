"""Activations saved per token by each layer kind, measured on the CPU against the plan.

``python benchmarks/layer_kinds.py [--seq 512]`` builds small random models of the hybrid
families (fp32, the torch reference kernels: what runs on the CPU and, without the fast
kernels, on a GPU), runs one decoder layer of each kind forward on ``seq`` tokens with
``torch.autograd.graph.saved_tensors_hooks``, and sums the distinct storages autograd saves for
backward (the weights left out). It prints bytes per token measured, the per-kind model
(`homelab_dp.planning.memory.layer_kinds.kind_activation_bytes`, full fine-tune, fp32) and
their ratio; the mixers' ratios are the fits `STATE_KIND_FIT` and `MAMBA_FIT` record.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from homelab_dp.planning.memory.layer_kinds import kind_activation_bytes, mixer_elements
from homelab_dp.train.model.model_census import census, layer_groups

H = {"hidden_size": 256, "vocab_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
     "head_dim": 32, "intermediate_size": 512, "max_position_embeddings": 4096}  # fmt: skip
FAMILIES = {
    "qwen3_5_text": {**H, "num_hidden_layers": 4, "linear_num_key_heads": 4,
                     "linear_num_value_heads": 8, "linear_key_head_dim": 32,
                     "linear_value_head_dim": 32},
    "nemotron_h": {**H, "num_hidden_layers": 4, "hybrid_override_pattern": "M-*E",
                   "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 64,
                   "n_groups": 1, "chunk_size": 128, "n_routed_experts": 8,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                   "moe_shared_expert_intermediate_size": 256},
    "lfm2": {**H, "num_hidden_layers": 2, "full_attn_idxs": [1]},
    "falcon_h1": {**H, "num_hidden_layers": 1, "mamba_n_heads": 8, "mamba_d_head": 32,
                  "mamba_d_ssm": 256, "mamba_d_state": 64, "mamba_chunk_size": 128},
}  # fmt: skip


def saved_bytes(model, index: int, seq: int) -> float:
    """Bytes autograd saves in decoder layer ``index`` for ``seq`` tokens (weights apart)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, seq))
    layers = model.model.layers
    captured = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        raise StopIteration

    handle = layers[index].register_forward_pre_hook(grab, with_kwargs=True)
    with contextlib.suppress(StopIteration):
        model(input_ids=ids)
    handle.remove()
    args = tuple(a.detach().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point()
                 else a for a in captured["args"])  # fmt: skip
    kwargs = captured["kwargs"]
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_(True)}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layers[index](*args, **kwargs)
    return float(sum(seen.values()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print("| family | layer kind | measured B/token | planned B/token | ratio | mixer ratio |")
    print("|---|---|---|---|---|---|")
    for family, fields in FAMILIES.items():
        cfg = CONFIG_MAPPING[family](**fields)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float().train()
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            spec = census(tmp)
        for group, ids in layer_groups(model, cfg):
            measured = saved_bytes(model, ids[0], args.seq) / args.seq
            planned = kind_activation_bytes(spec, group.kind, 4, experts_trained=True,
                                            frozen_norms=False)  # fmt: skip
            mixer = 4 * sum(mixer_elements(m, spec.hidden) for m in group.kind.mixers)
            rest = planned - mixer
            mixer_ratio = (measured - rest) / mixer if mixer else float("nan")
            print(f"| {family} | {group.kind.mixer} | {measured:.0f} | {planned:.0f} | "
                  f"{measured / planned:.2f} | {mixer_ratio:.2f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
