"""A vLLM replica: the replica protocol of `serving.replica.transformers_replica`, generation by vLLM's async engine.

    python -m homelab_dp.serving.replica.vllm_replica --model MODEL --device cuda:0 --id K --state-dir DIR
        [--context N] [--gpu-memory-utilization F] [--max-batch B] [--threads T]
                                                 (env HOMELAB_DP_REPLICA_TOKEN=<secret>)

The HTTP surface, the ready file, the signals, the parent watch and the body checks are
`http_replica`'s, shared with the transformers replica: the serve front cannot tell them apart.
The prompt is rendered and tokenized by `prompting` exactly as there (the HF tokenizer of the
result), and vLLM gets the token ids, so both engines see the same tokens.

- **Model** (`vllm_settings`): a full model folder (or a run's ``final/merged``) as it is; an
  adapter folder runs on its base with LoRA (``enable_lora``, one adapter, ``max_lora_rank`` the
  adapter's ``r`` rounded up to a rank vLLM allows). dtype: the run's preset dtype where it names
  one, else vLLM's ``auto`` (vLLM refuses bf16 on a card before compute capability 8.0: the
  replica then exits 2 with its reason). ``max_model_len``: the model's positions, capped by
  ``--context``; it is the ready file's ``context`` and the limit requests are checked against.
  ``trust_remote_code`` only where the run's preset allowed it.
- **Requests** (`sampling_kwargs`): temperature (0: greedy), top_p (0: the most likely token,
  vLLM's ``top_k=1``), max_tokens, stop strings (the body's and the template's), the tokenizer's
  eos as stop tokens (vLLM adds the generation config's), seed.
- **Streaming** (`output_events`): vLLM yields cumulative ``RequestOutput``s; each becomes the
  new part of its text as a ``{"text"}`` line, and the finished one adds the
  ``{"finish_reason", "usage"}`` line (usage from ``prompt_token_ids`` and the output's
  ``token_ids``). A client that leaves aborts its request (``engine.abort``).
- **Card**: vLLM reads ``CUDA_VISIBLE_DEVICES`` as indices; a UUID there (how `serve` names a
  card) becomes its NVML index with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (`index_for_vllm`).
- **Batching**: vLLM schedules its own batches (continuous batching); ``--max-batch`` and
  ``--threads`` are accepted (the front passes the same arguments to both kinds) and ignored.

vllm is imported only when the replica starts: this module imports without it. Not run here:
the machines this was written on have neither vllm nor a GPU. The pure parts (settings, sampling
arguments, stream lines) are tested (tests/unit/serving/test_vllm_replica.py); the engine calls follow
vLLM's documented ``AsyncLLMEngine`` API and have not been exercised against a real vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable, MutableMapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from homelab_dp.errors import HomelabError
from homelab_dp.planning.model_spec import read_config
from homelab_dp.runs.model_ref import ModelRef, resolve_model
from homelab_dp.serving.replica.prompt_templates import Template, eos_ids, template_for
from homelab_dp.serving.replica.replica_protocol import (
    Event,
    Prepared,
    ReplicaServer,
    base_parser,
    check_setup,
    exit_now,
    leave_while_loading,
    prepare,
    report,
    run_until_stopped,
    server_error,
)
from homelab_dp.serving.replica.result_model import context_length, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""
VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_GPU_MEMORY = 0.90


@dataclass(frozen=True)
class VllmSettings:
    """How the engine is built for one model."""

    model: str
    """The folder vLLM loads: the model, or an adapter's base."""
    tokenizer: str
    """The tokenizer's folder (the result's own, else the base's)."""
    dtype: str
    """``auto`` or a torch dtype name (``bfloat16``, ``float16``, ``float32``)."""
    max_model_len: int
    """Tokens per sequence (prompt + answer): the model's positions capped by ``--context``."""
    gpu_memory_utilization: float
    """The share of the card vLLM may take (weights, activations, KV cache)."""
    trust_remote_code: bool
    """Run the model folder's own code (only where the run's preset allowed it)."""
    lora_path: str | None = None
    """The adapter folder, served as a vLLM LoRA on ``model``; None for a full model."""
    max_lora_rank: int | None = None
    """The adapter's rank rounded up to one vLLM allows; None without an adapter."""

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "trust_remote_code": self.trust_remote_code,
            "disable_log_stats": True,  # a stats line every few seconds buries the log
        }
        if self.lora_path is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=self.max_lora_rank)
        return kwargs


def lora_rank(r: int) -> int:
    """The smallest rank vLLM allows that holds an adapter of rank ``r``."""
    for allowed in LORA_RANKS:
        if r <= allowed:
            return allowed
    raise HomelabError(
        f"adapter rank r={r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}",
        hint="merge the adapter into its base and serve the merged folder, or use --engine "
        "transformers (it merges adapters itself)",
    )


def _adapter_rank(ref: ModelRef) -> int:
    path = ref.path / "adapter_config.json"
    try:
        r = json.loads(path.read_text(encoding="utf-8")).get("r")
    except (OSError, ValueError, AttributeError) as exc:
        raise HomelabError(
            f"{path}: unreadable ({exc})", hint="the adapter folder is damaged"
        ) from None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise HomelabError(f"{path}: r is {r!r}, not a positive rank", hint="a LoRA adapter has r")
    return r


def vllm_settings(
    ref: ModelRef, *, context: int | None = None, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY
) -> VllmSettings:
    """The engine settings for ``ref`` (see the module docstring); bad values are HomelabErrors."""
    if not 0 < gpu_memory_utilization <= 1:
        raise HomelabError(
            f"--gpu-memory-utilization {gpu_memory_utilization}: not a share of the card",
            hint="a number above 0 and at most 1, e.g. 0.9",
        )
    if context is not None and context < 1:
        raise HomelabError(
            f"--context {context}: not a positive length", hint="e.g. --context 4096"
        )
    positions = context_length(SimpleNamespace(**read_config(ref.config_path)))
    lora = ref.is_adapter
    return VllmSettings(
        model=str(ref.config_path),
        tokenizer=str(ref.tokenizer_path),
        dtype=VLLM_DTYPES.get(ref.dtype, "auto"),
        max_model_len=min(positions, context) if context else positions,
        gpu_memory_utilization=gpu_memory_utilization,
        trust_remote_code=ref.trust_remote_code,
        lora_path=str(ref.path) if lora else None,
        max_lora_rank=lora_rank(_adapter_rank(ref)) if lora else None,
    )


def sampling_kwargs(prepared: Prepared, stop_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for a checked request."""
    body = prepared.body
    kwargs: dict[str, Any] = {
        "max_tokens": prepared.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": list(prepared.stop),
        "stop_token_ids": sorted(set(stop_token_ids)),
        "seed": body.seed,
    }
    if body.top_p == 0:  # vLLM wants top_p in (0, 1]; 0 means the most likely token only
        kwargs.update(top_p=1.0, top_k=1)
    return kwargs


def text_delta(sent: str, text: str) -> str:
    """The part of the cumulative ``text`` not sent yet ("" while it does not extend ``sent``).

    vLLM's cumulative text only grows (it holds back a possible stop string's start and
    incomplete characters itself); a text that does not extend what was sent cannot be taken
    back from the client, so nothing is sent until it does again.
    """
    return text[len(sent) :] if text.startswith(sent) else ""


def finish_event(reason: str | None, prompt_tokens: int, completion_tokens: int) -> Event:
    """The protocol's last line: vLLM's ``length`` stays, any other end (eos, stop) is ``stop``."""
    return {
        "finish_reason": "length" if reason == "length" else "stop",
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def output_events(sent: str, output: Any) -> tuple[str, list[Event]]:
    """One cumulative ``RequestOutput`` -> (the text sent after it, the protocol lines it adds)."""
    completion = output.outputs[0]
    text = completion.text if output.finished else completion.text.rstrip("\ufffd")
    delta = text_delta(sent, text)
    events: list[Event] = [{"text": delta}] if delta else []
    if output.finished:
        prompt = len(output.prompt_token_ids or ())
        events.append(finish_event(completion.finish_reason, prompt, len(completion.token_ids)))
    return sent + delta, events


class VllmReplica(ReplicaServer):
    """Requests go to vLLM's engine; its cumulative outputs become protocol lines."""

    def __init__(
        self,
        engine: Any,
        vllm: Any,
        tokenizer: PreTrainedTokenizerBase,
        template: Template,
        settings: VllmSettings,
        token: str,
    ) -> None:
        super().__init__(token, tokenizer, template, settings.max_model_len)
        self.engine = engine
        self.vllm = vllm
        self.stop_ids = eos_ids(tokenizer)
        self.lora = None
        if settings.lora_path is not None:
            from vllm.lora.request import LoRARequest

            self.lora = LoRARequest(
                lora_name="adapter", lora_int_id=1, lora_path=settings.lora_path
            )

    async def events(self, prepared: Prepared) -> AsyncIterator[Event]:
        """Generate with vLLM and yield the protocol's lines; abort when closed early."""
        request_id = uuid.uuid4().hex
        prompt = {"prompt_token_ids": prepared.prompt_ids}
        sent, done = "", False
        try:
            params = self.vllm.SamplingParams(**sampling_kwargs(prepared, self.stop_ids))
            stream = self.engine.generate(prompt, params, request_id, lora_request=self.lora)
            async with contextlib.aclosing(stream) as outputs:
                async for output in outputs:
                    sent, lines = output_events(sent, output)
                    for line in lines:
                        done = done or "finish_reason" in line
                        yield line
                    if output.finished:
                        return
        except Exception as exc:  # noqa: BLE001 - reported to the client, the replica lives on
            done = True
            yield server_error(f"generation failed: {exc}")
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    await self.engine.abort(request_id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The replica's command line (see the module docstring)."""
    p = base_parser("python -m homelab_dp.serving.replica.vllm_replica")
    p.add_argument("--context", type=int, help="cap on tokens per sequence (default: the model's)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY,
        help=f"share of the card vLLM may take (default {DEFAULT_GPU_MEMORY})",
    )
    p.add_argument("--max-batch", type=int, help="ignored: vLLM schedules its own batches")
    p.add_argument("--threads", type=int, help="ignored: vLLM generates on the GPU")
    return p.parse_args(argv)


def check_device(device: str) -> None:
    """vLLM replicas run on the one card CUDA_VISIBLE_DEVICES leaves them: ``cuda:0``."""
    if device not in ("cuda", "cuda:0"):
        raise HomelabError(
            f"--device {device}: a vLLM replica runs on cuda:0",
            hint="set CUDA_VISIBLE_DEVICES to the card and pass cuda:0 (as `serve` does), or "
            "use the transformers replica (homelab_dp.serving.replica.transformers_replica) on the CPU",
        )


def _tokenizer(ref: ModelRef) -> Any:
    """The result's HF tokenizer (prompts are tokenized here, as the transformers replica does)."""
    try:
        return load_tokenizer(ref)
    except Exception as exc:  # noqa: BLE001 - whatever the reason, this folder does not load
        raise HomelabError(
            f"{ref.tokenizer_path}: cannot load the tokenizer ({exc})",
            hint="point at a complete model folder (config.json, weights, tokenizer)",
        ) from None


def _shutdown(engine: Any) -> None:
    """Stop vLLM's engine process (older engines have no ``shutdown``: they go with us)."""
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(Exception):
            shutdown()


def index_for_vllm(env: MutableMapping[str, str]) -> None:
    """Turn a card's UUID in ``CUDA_VISIBLE_DEVICES`` (what `serve` sets when NVML gives one)
    into its NVML index, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA counts cards in NVML's
    order: vLLM reads the variable as numbers (``int()``). Anything else is left as it is."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not visible.startswith("GPU-") or "," in visible:
        return
    try:
        import pynvml  # nvidia-ml-py: installed with vllm

        pynvml.nvmlInit()
        try:
            index = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(visible))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML, an unknown UUID: vLLM cannot use it
        raise HomelabError(
            f"CUDA_VISIBLE_DEVICES={visible}: no card index for this UUID ({exc})",
            hint="set CUDA_VISIBLE_DEVICES to the card's index for a vLLM replica",
        ) from None
    env["CUDA_VISIBLE_DEVICES"] = str(index)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"


def build_engine(settings: VllmSettings) -> tuple[Any, Any]:
    """(vllm, its ``AsyncLLMEngine`` for ``settings``); a missing vllm or a model it cannot
    load is a HomelabError."""
    try:
        import vllm
    except ImportError as exc:
        raise HomelabError(
            f"vllm cannot be imported ({exc})",
            hint="`pip install vllm` on a machine with NVIDIA GPUs, or use --engine transformers",
        ) from None
    try:
        args = vllm.AsyncEngineArgs(**settings.engine_kwargs())
        return vllm, vllm.AsyncLLMEngine.from_engine_args(args)
    except Exception as exc:  # noqa: BLE001 - whatever the reason, vLLM cannot serve this
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HomelabError(
            f"{settings.lora_path or settings.model}: vLLM cannot load the model ({reason})",
            hint="check the model folder; for memory, a shorter --context (vLLM reserves KV "
            "cache for a whole context) or a larger --gpu-memory-utilization; or serve it with "
            "--engine transformers",
        ) from None


async def _warm_up(replica: VllmReplica) -> None:
    """One 1-token generation, so the first client does not pay for compilation."""
    prepared = prepare({"prompt": "Hello", "max_tokens": 1, "temperature": 0}, replica.tokenizer,
                       replica.template, replica.context)  # fmt: skip
    async for event in replica.events(prepared):
        if "error" in event:
            raise RuntimeError(event["error"]["message"])


async def _run(
    args: argparse.Namespace,
    ref: ModelRef,
    settings: VllmSettings,
    tokenizer: PreTrainedTokenizerBase,
    template: Template,
    *,
    token: str,
    parent: int,
) -> int:
    # The engine is built inside the event loop: its clients bind to the running loop.
    try:
        vllm, engine = build_engine(settings)
    except HomelabError as exc:
        return report(exc)
    replica = VllmReplica(engine, vllm, tokenizer, template, settings, token)
    print(
        f"replica {args.id}: vLLM loaded {ref.name} ({settings.dtype}, context "
        f"{settings.max_model_len}, template {template.kind}"
        f"{', LoRA' if settings.lora_path else ''}) on {args.device}",
        flush=True,
    )
    warm = time.perf_counter()
    await _warm_up(replica)
    print(f"replica {args.id}: warm-up in {time.perf_counter() - warm:.2f} s", flush=True)
    scheduler = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    info = {
        "model": ref.name,
        "context": settings.max_model_len,
        "max_batch": getattr(scheduler, "max_num_seqs", None),  # vLLM's own limit
    }
    await run_until_stopped(replica, args, info, parent=parent, on_stop=lambda: _shutdown(engine))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Check, build the engine, warm up, serve; 2 with an ``error:`` line on bad input."""
    parent = leave_while_loading()
    args = parse_args(argv)
    try:
        token = check_setup(args)
        check_device(args.device)
        index_for_vllm(os.environ)  # before anything starts CUDA
        ref = resolve_model(args.model)
        settings = vllm_settings(
            ref, context=args.context, gpu_memory_utilization=args.gpu_memory_utilization
        )
        tokenizer = _tokenizer(ref)
        template = template_for(tokenizer, ref)
    except HomelabError as exc:
        return report(exc)
    return asyncio.run(_run(args, ref, settings, tokenizer, template, token=token, parent=parent))


if __name__ == "__main__":
    exit_now(main())
