"""Chunked cross-entropy inside the model: the loss without full batch × seq_len × vocab logits.

The standard path (``model(...).logits`` then ``F.cross_entropy(logits.float(), ...)``) holds
three tokens × vocab fp32 tensors at once (the fp32 copy of the logits, the log-softmax and its
gradient): 5.9 GiB for a 128k vocabulary at 2 × 2048 tokens. Here :class:`ChunkedLossHead`
replaces the model's ``lm_head`` (same Parameter objects, so state-dict keys and weight tying are
unchanged) and, while ``with head.targets(labels):`` is active, returns the summed token loss
instead of logits; the CausalLM passes that 0-dim tensor out as ``.logits``. The loss is computed
inside the model's forward so that DDP's and FSDP2's hooks (FSDP2 gathers the root unit's
parameters, lm_head's among them, only around forward and backward) see ordinary forward work.

:class:`_ChunkedCrossEntropy` works on the target tokens only (labels != -100; prompt tokens get
no logits at all), ``chunk_tokens(vocab)`` rows at a time. Forward: a chunk's logits in the
compute dtype, then log-sum-exp and the target logit in fp32 (fp64 when computing in fp64).
Backward recomputes each chunk's logits (unless one chunk holds every target row: its softmax
is then kept from forward, the same bytes the recompute would make, and a matmul saved):
(softmax - onehot) · grad_output, cast to the compute
dtype, gives the chunk's hidden-state rows and is added (fp32) into the weight and bias
gradients. Under autocast the matmuls run in the autocast dtype exactly as ``nn.Linear`` would.

Bytes alive, for the planner (`planning.memory.device_memory.chunk_peak_bytes` is this arithmetic, checked against measured
live bytes in tests/unit/train/test_chunked_loss.py), with c = chunk rows, V = vocabulary, H = hidden
size, e = compute element size (2 for bf16/fp16, 4 fp32), n = target tokens, N = all tokens:

- saved from forward to backward: the target rows of the hidden states n·H·e, their labels and
  row indices n·16, the per-token log-sum-exp n·4, and under autocast the cast weight V·H·e (as
  nn.Linear under autocast saves it);
- forward peak, per chunk: c·V·(e + 4) when e != 4 (the logits and their fp32 copy while
  casting), c·V·4 in fp32 (everything after the matmul is in place);
- backward peak: the largest of c·V·(e + 4) (a chunk's fp32 softmax and its compute-dtype
  cast), c·V·e + V·H·e (when e != 4: the cast and its g.T @ h product) and V·H·w (the sum
  returned in a 16-bit weight's dtype), plus the fp32 weight-gradient sum V·H·4 (these weight
  terms vanish when the weight is frozen), plus the hidden-state gradient: its target rows n·H·e
  and the full N·H gradient in the hidden states' dtype.

Fused kernels (``liger_kernel``'s fused linear cross-entropy) were considered and not used:
they compute the gradients during the forward pass and hold the V × H weight gradient from
forward to backward, and nothing here could test them on CUDA.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from homelab_dp.planning.memory.device_memory import chunk_tokens
from homelab_dp.train.loop.device_copy import to_device

IGNORE_INDEX = -100
_SOFTCAP_KEYS = ("final_logit_softcapping", "logit_softcapping", "logit_softcap")
_SCALE_KEYS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")
_OTHER_KEYS = ("unpadded_vocab_size",)


def _compute_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for ``device_type`` (None: no casting)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """Autocast's rule: floating tensors other than fp64 go to ``dtype``."""
    if t is None or dtype is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def target_rows(labels: torch.Tensor) -> torch.Tensor:
    """The flat row numbers of ``labels`` that are not -100, on the labels' device. Host labels
    (the worker's) give them without a device sync; labels on the device cost one (``nonzero``
    must know its size)."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of ``hidden @ weight.T + bias``, chunk by chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        labels: torch.Tensor, chunk: int, rows: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        device_type = hidden.device.type
        autocast_dtype = _compute_dtype(device_type)
        rows = target_rows(labels) if rows is None else rows
        y = to_device(labels.index_select(0, rows), hidden.device)
        rows = to_device(rows, hidden.device)
        h = _cast(hidden.index_select(0, rows), autocast_dtype)
        w, b = _cast(weight, autocast_dtype), _cast(bias, autocast_dtype)
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        lse = torch.empty(rows.numel(), dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        # One chunk holds every target row: keep its softmax for backward instead of
        # recomputing the logits (the same bytes, alive from here rather than made again).
        keep = rows.numel() <= chunk
        ctx.probs = None
        with torch.autocast(device_type, enabled=False):
            for s in range(0, rows.numel(), chunk):
                z = F.linear(h[s : s + chunk], w, b).to(acc)  # a fresh fp32 copy, or z itself
                target = z.gather(1, y[s : s + chunk, None]).squeeze(1)
                top = z.amax(1, keepdim=True)
                sums = z.sub_(top).exp_().sum(1)
                if keep:
                    ctx.probs = z.div_(sums[:, None])
                lse_c = sums.log_().add_(top.squeeze(1))
                lse[s : s + chunk] = lse_c
                total += (lse_c - target).sum()
                del z
        ctx.save_for_backward(h, w, b, y, rows, lse)
        ctx.chunk, ctx.n_rows, ctx.hidden_dtype = chunk, hidden.shape[0], hidden.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h, w, b, y, rows, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk, acc, dev = ctx.chunk, lse.dtype, h.device
        gh_rows = torch.empty_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=acc, device=dev) if need_w else None
        gb = torch.zeros(w.shape[0], dtype=acc, device=dev) if need_b else None
        scale = grad_out.to(acc)
        with torch.autocast(dev.type, enabled=False):
            for s in range(0, rows.numel(), chunk):
                h_c, y_c = h[s : s + chunk], y[s : s + chunk]
                if ctx.probs is not None:  # kept from forward (one chunk)
                    p, ctx.probs = ctx.probs, None
                else:
                    p = F.linear(h_c, w, b).to(acc)
                    p.sub_(lse[s : s + chunk, None]).exp_()  # softmax
                p[torch.arange(y_c.numel(), device=dev), y_c] -= 1
                p.mul_(scale)
                if gb is not None:
                    gb += p.sum(0)
                g = p.to(h.dtype)
                del p
                if gh_rows is not None:
                    torch.mm(g, w, out=gh_rows[s : s + chunk])
                if gw is not None:
                    if g.dtype == acc:
                        gw.addmm_(g.t(), h_c)
                    else:  # 16-bit product, fp32 sum across chunks
                        gw += torch.mm(g.t(), h_c)
                del g
        gh = None
        if gh_rows is not None:
            gh = torch.zeros(ctx.n_rows, h.shape[1], dtype=ctx.hidden_dtype, device=dev)
            gh.index_copy_(0, rows, gh_rows.to(ctx.hidden_dtype))
        gw = gw.to(ctx.weight_dtype) if gw is not None else None
        gb = gb.to(ctx.bias_dtype) if gb is not None else None
        return gh, gw, gb, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    chunk: int | None = None, rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """0-dim sum of the token cross-entropies of ``hidden @ weight.T + bias`` over the labels
    that are not -100; ``labels`` has ``hidden``'s shape without the last dimension. ``rows``:
    their `target_rows` when the caller has them already."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    chunk = chunk or chunk_tokens(weight.shape[0])
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)  # left where it is: on the host it costs no device sync
    return _ChunkedCrossEntropy.apply(flat, weight, bias, labels, chunk, rows)


class ChunkedLossHead(nn.Module):
    """The model's lm_head, able to return the summed token loss instead of logits.

    Holds the old head's Parameter objects. Outside ``targets`` it is ``nn.Linear``.
    """

    def __init__(self, head: nn.Linear, chunk: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.bias = head.bias  # a Parameter, or None (registered as such)
        self.chunk = chunk or chunk_tokens(head.out_features)
        self._labels: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        """Within this block, forward returns the loss sum over ``labels`` (already shifted)."""
        if self._labels is not None:
            raise RuntimeError("ChunkedLossHead.targets is already active")
        self._labels = labels
        try:
            yield
        finally:
            self._labels = self._rows = None

    def target_rows(self) -> torch.Tensor | None:
        """Within ``targets``: the labels' `target_rows`, found once a block for the loss and
        `train.model.last_mlp_rows`; None outside."""
        if self._labels is None:
            return None
        if self._rows is None:
            self._rows = target_rows(self._labels)
        return self._rows

    def label_count(self) -> int:
        """Within ``targets``: how many labels (rows) the block has; 0 outside."""
        return 0 if self._labels is None else self._labels.numel()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits, or within ``targets`` the 0-dim sum of token cross-entropies."""
        if self._labels is None:
            return F.linear(hidden_states, self.weight, self.bias)
        return chunked_cross_entropy(
            hidden_states, self.weight, self.bias, self._labels, self.chunk, self.target_rows()
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, chunk={self.chunk}")  # fmt: skip


def _base(model: nn.Module) -> nn.Module:
    """The CausalLM inside a peft PeftModel, or the model itself."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _config_transform(base: nn.Module) -> str | None:
    """A config setting that changes the logits after lm_head, or None."""
    config = getattr(base, "config", None)
    if config is None:
        return None
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text):
        configs.append(text())
    for cfg in configs:
        for key in _SOFTCAP_KEYS + _SCALE_KEYS + _OTHER_KEYS:
            value = getattr(cfg, key, None)
            if value is None or (key in _SCALE_KEYS and value == 1):
                continue
            return f"the config sets {key}={value} (the logits are changed after lm_head)"
    return None


def _source_transform(base: nn.Module, attr: str) -> str | None:
    """Whether the forward's code touches the logits after ``self.<attr>(...)``, or None."""
    try:
        lines = inspect.getsource(inspect.unwrap(type(base).forward)).splitlines()
    except (OSError, TypeError):
        return f"the source of {type(base).__name__}.forward is not available"
    # `.contiguous()` / `.float()` leave a 0-dim fp32 loss as it is.
    call = re.compile(
        rf"^\s*(\w+)\s*=\s*self\.{re.escape(attr)}\([^()]*\)(\.contiguous\(\)|\.float\(\))?\s*(#.*)?$"
    )
    for i, line in enumerate(lines):
        found = call.match(line)
        if found is None:
            continue
        var = re.escape(found.group(1))
        changed = re.compile(rf"^\s*{var}\s*([-+*/@]?=)(?!=)|\b{var}\.\w+_\(|\b{var}\[.*\]\s*=")
        for later in lines[i + 1 :]:
            if changed.search(later) and not later.rstrip().endswith(","):  # not a keyword
                return f"{type(base).__name__}.forward changes the logits after {attr}"
        return None
    return f"{type(base).__name__}.forward has no plain 'logits = self.{attr}(...)' line"


def _find_head(base: nn.Module) -> tuple[nn.Module | None, str | None, str | None]:
    """(the output layer, its dotted name, why it cannot be replaced)."""
    try:
        head = base.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return None, None, "the model has no output embeddings"
    if head is None:
        return None, None, "the model has no output embeddings"
    name = next((n for n, m in base.named_modules() if m is head), None)
    if name is None or not name:
        return head, None, "the output layer is not a submodule of the model"
    if isinstance(head, ChunkedLossHead):
        return head, name, None
    if type(head) is not nn.Linear:  # quantized, LoRA-wrapped or modules_to_save heads
        return head, name, f"the output layer is a {type(head).__name__}, not a plain nn.Linear"
    hooks = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks,
             getattr(head, "_backward_pre_hooks", {}))  # fmt: skip
    if any(hooks) or hasattr(head, "_hf_hook"):
        return head, name, "the output layer has hooks"
    return head, name, None


def router_aux_coef(model: nn.Module) -> float:
    """The weight of a MoE model's router auxiliary (load-balancing) loss, as the model adds it.

    transformers' MoE CausalLMs (Qwen3-MoE, Mixtral, gpt-oss, ...) add
    ``router_aux_loss_coef × aux_loss`` to their loss only when the config sets
    ``output_router_logits`` and labels are passed; the worker computes its own loss (the
    chunked head), so it adds the term itself (`train.loop.training_loop.micro_step`). 0 where the
    config does not ask for it, the weight is not positive, or the forward takes no
    ``output_router_logits``."""
    base = _base(model)
    config = getattr(base, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if coef <= 0:
        return 0.0
    try:
        accepts = "output_router_logits" in inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):
        accepts = False
    return coef if accepts else 0.0


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `install_loss_head` would keep the full logits path for ``model``; None if it would not."""
    base = _base(model)
    head, name, why = _find_head(base)
    if why is not None:
        return why
    assert head is not None and name is not None
    if isinstance(head, ChunkedLossHead):
        return None
    return _config_transform(base) or _source_transform(base, name.rsplit(".", 1)[-1])


def install_loss_head(model: nn.Module, chunk: int | None = None) -> ChunkedLossHead | None:
    """Put a :class:`ChunkedLossHead` in place of the model's lm_head; None where it cannot be
    used (see `unsupported_reason`). ``model``: a Hugging Face CausalLM or a peft PeftModel.

    Install before the strategy wraps the model (DDP, FSDP2): the wrappers then see the same
    parameters under the same names. Installing twice returns the installed head.
    """
    if unsupported_reason(model) is not None:
        return None
    base = _base(model)
    head, name, _ = _find_head(base)
    if isinstance(head, ChunkedLossHead):
        return head
    assert isinstance(head, nn.Linear) and name is not None
    parent_name, _, attr = name.rpartition(".")
    parent = base.get_submodule(parent_name) if parent_name else base
    new = ChunkedLossHead(head, chunk)
    setattr(parent, attr, new)
    return new


def token_loss_sum(
    output_logits: torch.Tensor, labels: torch.Tensor, loss_dtype: torch.dtype,
    head: ChunkedLossHead | None,
) -> torch.Tensor:  # fmt: skip
    """The sum of token losses: ``output_logits`` itself when the head computed it (``head``
    not None: the model ran inside ``head.targets``), else full cross-entropy in ``loss_dtype``."""
    if head is not None:
        return output_logits
    return F.cross_entropy(output_logits.to(loss_dtype).flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
