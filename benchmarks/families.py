"""Every decoder family transformers builds, planned: census against meta-device instantiation.

``python benchmarks/families.py [--json OUT] [model_type ...]`` iterates over transformers'
``CONFIG_MAPPING``: for each model_type that ``AutoModelForCausalLM`` can build it makes a tiny
config (the config class's defaults with the sizes shrunk, `tiny_config`), writes it to a
folder, plans it as `plan` does (the hand-written spec from config.json, else the census of
`homelab_dp.train.model.model_census`) and compares the parameter count with the model transformers
itself instantiates on the meta device. Status: ``exact`` (a hand-written family, counted from
config.json alone), ``derived`` (the census: layer groups from the module tree), ``refused``
(with the reason: not a causal language model, or a config transformers itself rejects), or
``MISMATCH`` (a bug), or ``not checked`` (transformers needs a library not installed here, named).
The table goes to docs/models.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from homelab_dp.errors import HomelabError
from homelab_dp.planning.model_spec import SUPPORTED, hand_written_spec
from homelab_dp.train.model.model_census import census

SMALL = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 128,
    "moe_intermediate_size": 32, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
    "moe_num_experts": 8, "num_experts_per_tok": 2, "top_k_experts": 2,
    "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16, "ssm_state_size": 16,
    "mamba_d_state": 16, "n_groups": 1, "mamba_n_groups": 1, "mamba_d_ssm": 64,
    "max_position_embeddings": 256, "global_head_dim": 32, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 128, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 256,
    "num_layers": 4, "d_model": 64, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1, "moe_topk": 2,
    "zero_expert_num": 2, "moe_k": 2,
}  # fmt: skip
_SMALL_TEXT = {k: SMALL[k] for k in (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_hidden_layers", "vocab_size", "max_position_embeddings",
)}  # fmt: skip
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
        "indexer_compress_ratio": 4, "hc_lowrank": 16}  # fmt: skip
OVERRIDES = {
    "deepseek_v2": {"num_experts_per_tok": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "conv"], "num_dense_layers": 1},
    # RoPE given per layer type, as its released configs give it.
    "cohere_compass_text": {"rope_parameters": {"full_attention": _ROPE,
                                                "sliding_attention": _ROPE}},
    # Attention and MoE sizes live in sub-configs; rope_theta in attn_config.
    "dbrx": {"n_heads": 4, "n_layers": 2, "max_seq_len": 256,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
             "ffn_config": {"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2}},
    "dots1": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1},
    # Gemma 4's assistant (MTP drafter): every layer reads the KV of the target model's layers.
    "gemma4_assistant": {"text_config": {
        **_SMALL_TEXT, "global_head_dim": 32, "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
    }},
    # The QSA indexer of the indexed-attention layers has no defaults.
    "qwen4_exp_text": _QSA,
    "qwen4_exp": {"text_config": {
        **_SMALL_TEXT, **_QSA, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_experts": 8, "num_experts_per_tok": 2, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    }},
    "reformer": {"is_decoder": True},  # its causal LM head requires it
}  # fmt: skip
"""Fields a family's default config leaves unset (or set for another use) that its released
configs set."""


def tiny_config(model_type: str, **overrides):
    """A small config of ``model_type``: its defaults with the sizes of `SMALL` it has, then
    ``overrides``; when transformers rejects the shrunk sizes, only fewer layers; else the
    defaults (cheap on the meta device either way)."""
    cls = CONFIG_MAPPING[model_type]
    fields: dict = {}
    for kw in ({}, overrides):  # some defaults do not validate alone (gemma4_assistant)
        try:
            fields = cls(**kw).to_dict()
            break
        except Exception:  # noqa: BLE001 - the tries below report why
            continue
    tries = [
        {k: v for k, v in SMALL.items() if fields.get(k) is not None},
        {k: v for k, v in {**SMALL, "rope_theta": 10000.0}.items() if k in fields},
        {k: SMALL[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if fields.get(k)},
        {},
    ]
    last: Exception | None = None
    for sizes in tries:
        try:
            cfg = cls(**{**sizes, **overrides})
            with torch.device("meta"):
                transformers.AutoModelForCausalLM.from_config(cfg)
            return cfg
        except Exception as exc:  # noqa: BLE001 - the next, plainer try
            last = exc
    raise ValueError(f"no buildable config: {last}")


def meta_count(cfg) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def unbuildable(model_type: str, exc: Exception, **overrides) -> dict:
    """Status and reason of a family no tiny config of which transformers builds: what `plan`
    says of its config.json (the census child's own answer), or the library it needs."""
    try:
        cls = CONFIG_MAPPING[model_type]
        with tempfile.TemporaryDirectory() as tmp:
            cls(**overrides).save_pretrained(tmp)
            out = subprocess.run([sys.executable, "-m", "homelab_dp.train.model.model_census", tmp],
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - no config.json to plan either
        why = " ".join(str(exc).split())[:160]
        return {"status": "not checked", "reason": f"no config builds here: {why}"}
    reason = " ".join(answer["error"].split(": ", 1)[-1].split())[:200]
    status = "not checked" if answer.get("missing_library") else "refused"
    return {"status": status, "reason": reason}


def check(model_type: str, **overrides) -> dict:
    """Plan the tiny ``model_type`` and compare with transformers' own count."""
    row = {"family": model_type}
    try:
        cfg = tiny_config(model_type, **overrides)
    except Exception as exc:  # noqa: BLE001
        return {**row, **unbuildable(model_type, exc, **overrides)}
    truth = meta_count(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        start = time.perf_counter()
        try:
            spec = hand_written_spec(tmp)
            status = "exact"
            if spec is None:
                spec, status = census(tmp), "derived"
        except HomelabError as exc:
            return {**row, "status": "refused", "reason": exc.message.split(": ", 1)[-1][:200]}
        except Exception as exc:  # noqa: BLE001 - a census bug: reported, the table goes on
            return {**row, "status": "MISMATCH", "reason": f"census raised {exc!r}"[:200]}
        seconds = time.perf_counter() - start
    ok = spec.params == truth and 0 < spec.active_params <= spec.params
    return {
        **row, "status": status if ok else "MISMATCH", "params": spec.params, "meta": truth,
        "active": spec.active_params, "mixers": spec.mixer_counts,
        "state_layers": spec.state_layers, "groups": len(spec.layer_groups),
        "seconds": round(seconds, 3), "hand_written": model_type in SUPPORTED,
    }  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    types = args.types or sorted(
        t for t in CONFIG_MAPPING if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    rows = []
    for t in types:
        row = check(t, **OVERRIDES.get(t, {}))
        rows.append(row)
        mixers = ", ".join(f"{k} {v}" for k, v in (row.get("mixers") or {}).items())
        print(f"| {t} | {row['status']} | {row.get('reason') or mixers} |", flush=True)
    counts = {
        s: sum(1 for r in rows if r["status"] == s)
        for s in ("exact", "derived", "refused", "not checked", "MISMATCH")
    }
    print(f"transformers {transformers.__version__}: {len(rows)} families, {counts}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if counts["MISMATCH"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
