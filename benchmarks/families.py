"""Every decoder family transformers builds, planned: census against meta-device instantiation.

``python benchmarks/families.py [--json OUT] [model_type ...]`` iterates over transformers'
``CONFIG_MAPPING``: for each model_type that ``AutoModelForCausalLM`` can build it makes a tiny
config (the config class's defaults with the sizes shrunk, `tiny_config`), writes it to a
folder, plans it as `plan` does (the hand-written spec from config.json, else the census of
`homelab_dp.train.model_census`) and compares the parameter count with the model transformers
itself instantiates on the meta device. Status: ``exact`` (a hand-written family, counted from
config.json alone), ``derived`` (the census: layer groups from the module tree), ``refused``
(with the reason: not a causal language model, or a config transformers itself rejects), or
``MISMATCH`` (a bug). The table goes to docs/models.md.
"""

from __future__ import annotations

import argparse
import json
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
from homelab_dp.train.model_census import census

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
OVERRIDES = {
    "deepseek_v2": {"num_experts_per_tok": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "conv"], "num_dense_layers": 1},
}
"""Fields a family's default config leaves None that its released configs set."""


def tiny_config(model_type: str, **overrides):
    """A small config of ``model_type``: its defaults with the sizes of `SMALL` it has, then
    ``overrides``; when transformers rejects the shrunk sizes, only fewer layers; else the
    defaults (cheap on the meta device either way)."""
    cls = CONFIG_MAPPING[model_type]
    base = cls()
    fields = base.to_dict()
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


def check(model_type: str, **overrides) -> dict:
    """Plan the tiny ``model_type`` and compare with transformers' own count."""
    row = {"family": model_type}
    try:
        cfg = tiny_config(model_type, **overrides)
    except Exception as exc:  # noqa: BLE001
        why = " ".join(str(exc).split())[:120]
        return {**row, "status": "not checked", "reason": f"no tiny config builds here: {why}"}
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
