"""A model folder's config.json read as input (issue 34): a regular file of bounded size, valid
JSON of bounded depth with finite numbers, and every size the planner or the census uses in
range, before anything uses them; errors name config.json and the field (exit 2)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from homelab_dp.errors import ModelSpecError

MAX_LAYERS = 4096
"""The most decoder layers a config.json may state (released models have at most a few
hundred): every count the planner or the census loops over is bounded by it."""

MAX_SIZE = 10**12
"""The largest size a spec (or a config.json) may state: 10^12 is above any real width, vocabulary
or count; a larger one is damage or hostility, refused before arithmetic meets it."""

CONFIG_MAX_BYTES = 16 * 1024 * 1024
"""The largest config.json read (released ones are a few KB; a Gemma 4 or Qwen3.5 with its
per-layer lists a few tens of KB)."""
CONFIG_MAX_DEPTH = 32
"""The deepest nesting of objects and lists a config.json may have (released ones: 3 or 4)."""

_K, _M = 1 << 10, 1 << 20
# Sizes a config.json states, by field: (smallest, largest). None (or absent) is left to the
# family's default; anything else must be an integer (not a bool, not a float) in range.
CONFIG_INTS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), (1, MAX_LAYERS)),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), (1, _M)),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads",
                     "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads",
                     "mamba_num_heads", "num_heads"), (1, 64 * _K)),
    **dict.fromkeys(("head_dim", "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head",
                     "mamba_head_dim", "global_head_dim", "v_head_dim", "attention_head_dim"),
                    (1, 64 * _K)),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "q_lora_rank", "kv_lora_rank",
                     "first_k_dense_replace", "num_kv_shared_layers", "num_nextn_predict_layers",
                     "mtp_num_hidden_layers", "sliding_window", "attention_chunk_size",
                     "shared_expert_intermediate_size", "n_shared_experts",
                     "moe_shared_expert_intermediate_size", "hidden_size_per_layer_input",
                     "vocab_size_per_layer_input"),
                    (0, 64 * _M)),  # 0: none (Gemma 4's assistant has no per-layer inputs)
    **dict.fromkeys(("intermediate_size", "moe_intermediate_size", "n_inner", "ffn_hidden_size",
                     "mamba_d_ssm", "mamba_expand"), (1, 64 * _M)),
    "vocab_size": (1, 64 * _M),
    **dict.fromkeys(("max_position_embeddings", "n_positions"), (1, 1 << 30)),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                    (1, 64 * _K)),
    **dict.fromkeys(("num_experts_per_tok", "top_k_experts", "moe_k", "moe_topk"), (1, 64 * _K)),
    **dict.fromkeys(("ssm_state_size", "mamba_d_state", "n_groups", "mamba_n_groups",
                     "linear_conv_kernel_dim", "mamba_d_conv", "conv_kernel", "conv_L_cache",
                     "decoder_sparse_step", "mamba_chunk_size", "chunk_size"), (1, 64 * _K)),
    **dict.fromkeys(("sliding_window_pattern", "attn_layer_period", "expert_layer_period",
                     "moe_layer_interval"), (1, MAX_LAYERS)),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset", "moe_layer_start_index"),
                    (0, MAX_LAYERS)),
}  # fmt: skip
CONFIG_FLOATS = ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
                 "router_aux_loss_coef", "aux_loss_alpha", "logits_scaling",
                 "final_logit_softcapping", "attn_logit_softcapping")  # fmt: skip
"""Numbers a config.json states that the planner reads: a number (not a string), finite."""
LAYER_COUNTS = frozenset({"num_hidden_layers", "n_layer", "num_layers"})
"""Sizes that are one number, never a list (a list of sizes is allowed elsewhere: Gemma 3n's
per-layer intermediate_size, ERNIE-VL's per-modality experts)."""
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "top_k_experts", "moe_k", "moe_topk")
LAYER_LISTS = ("layer_types", "layers_block_type", "mlp_only_layers", "full_attn_idxs",
               "block_types", "attn_layer_indices")  # fmt: skip


def _config_error(source: str, field: str, why: str) -> ModelSpecError:
    return ModelSpecError(
        f"{source}: {field}: {why}",
        hint="config.json must be the model's published Hugging Face config; re-download it",
    )


def _walk_config(cfg: Any, source: str) -> None:
    """Every value of a parsed config: no deeper than `CONFIG_MAX_DEPTH`, every number finite
    (no Infinity or NaN), no integer longer than 30 digits (iterative: no recursion to blow)."""
    stack: list[tuple[Any, str, int]] = [(cfg, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > CONFIG_MAX_DEPTH:
            raise _config_error(
                source, where or "(top)", f"nested over {CONFIG_MAX_DEPTH} levels deep"
            )
        if isinstance(value, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        elif isinstance(value, float) and not math.isfinite(value):
            raise _config_error(source, where, f"{value} is not a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
            raise _config_error(source, where, "an integer of more than 30 digits")


def check_config_sizes(cfg: dict[str, Any], source: str, where: str = "") -> None:
    """ModelSpecError naming config.json and the field for a size no model has: a wrong type, a
    zero or negative count of layers, heads, head dims or experts, a top-k above the experts,
    more than `MAX_LAYERS` layers, a per-layer list of another length. Checked before anything
    uses them (the hand-written spec, the census child, the worker)."""
    for name, (low, high) in CONFIG_INTS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, list) and name not in LAYER_COUNTS:  # per layer or per modality
            if len(value) > MAX_LAYERS or not all(
                isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value
            ):
                raise _config_error(source, where + name, f"must list integers in [{low}, {high}]")
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            got = type(value).__name__
            raise _config_error(
                source, where + name, f"must be an integer, got {got} {str(value)[:40]!r}"
            )
        if not low <= value <= high:
            raise _config_error(source, where + name, f"{value} is outside [{low}, {high}]")
    for name in CONFIG_FLOATS:
        value = cfg.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not -1e6 <= value <= 1e6):  # fmt: skip
            raise _config_error(source, where + name, f"must be a number, got {str(value)[:40]!r}")
    count = next((cfg[n] for n in EXPERT_COUNTS if isinstance(cfg.get(n), int)), None)
    top_k = next((n for n in TOP_K_FIELDS if isinstance(cfg.get(n), int)), None)
    zero = cfg.get("zero_expert_num") if isinstance(cfg.get("zero_expert_num"), int) else 0
    if count is not None and top_k is not None and cfg[top_k] > count + max(0, zero):
        raise _config_error(source, where + top_k, f"{cfg[top_k]} is above the {count} experts")
    layers = next((cfg[n] for n in ("num_hidden_layers", "n_layer", "num_layers")
                   if cfg.get(n) is not None), None)  # fmt: skip
    for name in LAYER_LISTS:
        value = cfg.get(name)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > MAX_LAYERS:
            raise _config_error(
                source, where + name, f"must be a list of at most {MAX_LAYERS} items"
            )
        if name == "block_types":  # a pattern repeated over the layers (RecurrentGemma)
            if not all(isinstance(t, str) for t in value):
                raise _config_error(source, where + name, "must name layer types")
        elif name in ("layer_types", "layers_block_type") and layers is not None:
            if len(value) != layers or not all(isinstance(t, str) for t in value):
                raise _config_error(
                    source, where + name, f"must name one layer type per layer ({layers})"
                )
        elif name not in ("layer_types", "layers_block_type", "block_types") and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in value
        ):
            raise _config_error(source, where + name, "must list layer indices")
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None and (not isinstance(pattern, str) or len(pattern) > MAX_LAYERS):
        raise _config_error(source, where + "hybrid_override_pattern", "must be a short string")
    hidden = next((cfg[n] for n in ("hidden_size", "n_embd") if isinstance(cfg.get(n), int)), None)
    heads = next(
        (cfg[n] for n in ("num_attention_heads", "n_head") if cfg.get(n) is not None), None
    )
    heads = heads if isinstance(heads, int) else None  # a per-layer list: transformers checks
    if hidden and heads and cfg.get("head_dim") is None and heads > hidden:
        raise _config_error(
            source, where + "num_attention_heads", f"{heads} heads of a {hidden}-wide model"
        )
    kv = cfg.get("num_key_value_heads")
    if heads and isinstance(kv, int) and kv > heads:
        raise _config_error(
            source, where + "num_key_value_heads", f"{kv} is above the {heads} heads"
        )
    for name in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(name), dict):
            check_config_sizes(cfg[name], source, f"{where}{name}.")


def read_regular_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (a FIFO, a device
    such as /dev/zero or a folder is refused without reading: no hang, no unbounded read);
    ModelSpecError naming it otherwise. OSError passes through for a missing file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelSpecError(f"{path}: not a regular file", hint=f"{what} must be a plain file")
        if st.st_size > limit:
            raise ModelSpecError(
                f"{path}: {st.st_size} bytes, over the {limit} a {what} may have",
                hint=f"{what} must be the model's published file",
            )
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ModelSpecError(
                    f"{path}: grew past {limit} bytes", hint=f"{what} must be a plain file"
                )
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_config(data: bytes, path: Path | str) -> dict[str, Any]:
    """A config.json's bytes parsed and checked (`check_config_sizes`), errors naming the file."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSpecError(
            f"{path}: not valid JSON ({exc})", hint="re-download or re-save the model's config"
        ) from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit integer; nesting past the C stack
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise ModelSpecError(
            f"{path}: not a model config ({why})", hint="re-download or re-save the model's config"
        ) from None
    if not isinstance(cfg, dict):
        raise ModelSpecError(f"{path}: expected a JSON object", hint="a config.json is an object")
    _walk_config(cfg, str(path))
    check_config_sizes(cfg, str(path))
    return cfg


def read_config_bytes(model_dir: str | Path) -> tuple[Path, bytes]:
    """A model folder's config.json path and bytes (a regular file, size-bounded)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ModelSpecError(
            f"model.path: {folder} is not a folder",
            hint="model.path must be a local Hugging Face model folder (with config.json)",
        )
    path = folder / "config.json"
    try:
        return path, read_regular_file(path, CONFIG_MAX_BYTES, "config.json")
    except FileNotFoundError:
        raise ModelSpecError(
            f"{path}: missing",
            hint="a Hugging Face model folder has config.json beside the weights and tokenizer",
        ) from None
    except OSError as exc:
        raise ModelSpecError(
            f"{path}: cannot be read ({exc.strerror})", hint="check its permissions"
        ) from None


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """Read a model folder's config.json with errors that name the file and the field."""
    path, data = read_config_bytes(model_dir)
    cfg = parse_config(data, path)
    # Multimodal wrappers keep the text model's sizes in text_config.
    if "text_config" in cfg and isinstance(cfg["text_config"], dict) and "model_type" not in cfg:
        cfg = cfg["text_config"]
    return cfg
