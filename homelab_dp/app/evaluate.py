"""`homelab-dp eval`'s front end: check everything, start the workers under torchrun, read the result.

`prepare` resolves MODEL (`runs.model_ref.resolve_model_arg`: a Hugging Face id to its local
snapshot), picks the devices (``--gpus cpu:N``, GPU indices, or every visible GPU from the NVML
probe, never initialising CUDA here), checks the model folder as the run preflight does, the
sequence length against the model's positions, and reads and tokenizes the data exactly as the
worker will, through the training data's path (`data.samples.load_examples`: a file of any
supported kind, a folder or a dataset id, and the token cache, which the workers then read):
every mistake is a `HomelabError` before anything is spawned. (The tokenizer, loaded only when
the cache misses, comes from transformers, which imports torch on the CPU; CUDA is never
touched.)

`run_eval` writes the job as JSON into a private temporary folder (0700), starts
``torchrun … -m homelab_dp.train.evaluation.eval_worker ARGS_FILE`` in its own session with every output
in files there (no pipe from the workers), waits, and reads the result rank 0 wrote. The folder
goes afterwards, unless the evaluation failed: the error then quotes the failing rank's log and
names the folder. Ctrl-C (or SIGTERM) stops torchrun and its workers (none is left behind) and
is re-raised as KeyboardInterrupt.

The job file (read by `homelab_dp.train.evaluation.eval_worker`): ``model_path``, ``base_path`` (an
adapter's base or null), ``tokenizer_path``, ``trust_remote_code``, ``dtype`` (the run's preset
dtype or auto), ``quantized`` (``nf4`` for a QLoRA result: its base is loaded so), ``device`` (cpu | cuda), ``data_path`` (a path or a dataset id), ``split``,
``format`` (as given: it keys the token cache), ``seq_len``, ``result_path`` and ``error_dir``.

**Preference pairs.** When ``--data`` holds pairs (``--format preference``, or ``auto`` and the
first record has ``chosen``/``rejected``), the job goes to `homelab_dp.train.evaluation.pair_evaluation`
instead, with the DPO loss settings (the run's train.beta, train.dpo_loss and
train.label_smoothing, else the preset defaults) and its reference (`choose_reference`): an
adapter result against its base with the adapters disabled (``reference`` null), a full or
merged run result against the run's starting model (its preset's model.path), ``--reference``
when given; a plain model folder without ``--reference`` is refused (nothing to compare with).
KTO records are refused: eval compares pairs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from homelab_dp.data.blocks import build_blocks
from homelab_dp.data.preference_blocks import pair_blocks_of
from homelab_dp.data.records import FORMATS, PREFERENCE_FORMATS, format_from_keys
from homelab_dp.data.samples import detect_format, load_examples, load_pairs, read_source
from homelab_dp.data.sources import resolve_source
from homelab_dp.data.token_cache import TokenizerRef
from homelab_dp.errors import DataError, HardwareSpecError, HomelabError, RunFailedError
from homelab_dp.hub.hub_models import looks_like_hub_id
from homelab_dp.planning.plan_hardware import PlanDevice, PlanHardware
from homelab_dp.presets.preset import DataSection, ModelSection, Preset, TrainSection
from homelab_dp.probe.hardware import HardwareReport
from homelab_dp.probe.visible_gpus import cuda_device_env
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.model_ref import ModelRef, resolve_model_arg
from homelab_dp.supervise.launcher import torchrun_command

EVAL_MODULE = "homelab_dp.train.evaluation.eval_worker"
PAIR_EVAL_MODULE = "homelab_dp.train.evaluation.pair_evaluation"
DEFAULT_SEQ_LEN = 2048
"""The longest default sequence for a model that did not come from a run."""
STOP_GRACE_S = 20.0
"""How long torchrun gets to stop its workers after Ctrl-C before they are killed."""
_GPUS_HINT = (
    "eval runs on this machine's devices: --gpus cpu:N for N CPU processes, GPU indices such "
    "as 0,1 (`homelab-dp probe` lists them), or no --gpus for every visible GPU; what-if sizes "
    "such as 2x24GiB are for `homelab-dp plan`"
)


@dataclass(frozen=True)
class Devices:
    """Where the ranks run: one process per GPU, or N CPU processes."""

    kind: str
    """cpu | cuda."""
    nproc: int
    gpu_indices: tuple[int, ...] = ()
    """The GPUs by NVML index (`homelab-dp probe`'s numbers); empty on the CPU."""
    gpu_uuids: tuple[str, ...] = ()
    """The same GPUs by UUID when NVML gave every one (CUDA_VISIBLE_DEVICES names them so)."""


@dataclass(frozen=True)
class PairSettings:
    """How preference pairs are scored: the DPO loss and the reference it compares against."""

    reference: ModelRef | None
    """The reference model; None: the evaluated adapter's base, its adapters disabled."""
    reference_label: str
    """What the report calls the reference."""
    beta: float
    """DPO's temperature (the run's train.beta, else the preset default)."""
    loss_type: str
    """sigmoid | ipo (the run's train.dpo_loss)."""
    label_smoothing: float
    identical: int = 0
    """Pairs left out because chosen and rejected are the same tokens."""


@dataclass(frozen=True)
class EvalJob:
    """Everything checked and resolved: what the workers are started with."""

    ref: ModelRef
    data: DataSection
    """--data as a [data] section: path (absolute, or a dataset id), format as given, split."""
    format: str
    """The data format, ``auto`` resolved."""
    seq_len: int
    """Tokens per sample at most (longer rows are truncated)."""
    samples: int
    """Rows with at least one target token within ``seq_len`` (what is evaluated); pairs for
    preference data."""
    devices: Devices
    pairs: PairSettings | None = None
    """Set for preference data: the job is a pair evaluation."""


@dataclass(frozen=True)
class EvalReport:
    """The `eval --json` document."""

    model: str
    data: str
    world_size: int
    loss: float
    """Mean negative log-likelihood per target token (nats)."""
    perplexity: float | None
    """exp(loss); None where it overflows."""
    tokens: int
    """Target tokens."""
    real_tokens: int
    """Non-padding tokens that went through the model."""
    tokens_per_s: float
    seconds: float
    """Time spent in the forward passes (rank 0), loading excluded."""
    seq_len: int
    samples: int
    device: str
    """cpu | cuda."""
    dtype: str
    """The dtype the weights computed in (fp32, bf16, fp16)."""
    base: str
    """The base weights: ``nf4`` (a QLoRA result on the NF4 base it was trained against),
    else the dtype they were loaded in (fp32, bf16, fp16)."""

    def to_json(self) -> dict[str, Any]:
        """The document as a dict."""
        return asdict(self)


@dataclass(frozen=True)
class PairEvalReport:
    """The `eval --json` document for preference pairs."""

    model: str
    data: str
    reference: str
    """The reference the rewards are measured against."""
    world_size: int
    loss: float | None
    """Mean DPO loss per pair (ln 2 when the model equals its reference)."""
    reward_accuracy: float | None
    """Share of pairs whose chosen reward is strictly above the rejected one."""
    reward_margin: float | None
    """Mean of chosen minus rejected reward."""
    rewards_chosen: float | None
    """Mean β·(log π − log π_ref) of the chosen responses."""
    rewards_rejected: float | None
    """The same for the rejected responses."""
    pairs: int
    identical: int
    """Pairs left out because chosen and rejected are the same tokens."""
    beta: float
    loss_type: str
    label_smoothing: float
    seconds: float
    """Time spent in the forward passes (rank 0), loading excluded."""
    seq_len: int
    device: str
    dtype: str
    base: str
    """The evaluated model's base weights (``nf4`` for a QLoRA result), as in `EvalReport`."""

    def to_json(self) -> dict[str, Any]:
        """The document as a dict."""
        return asdict(self)


def parse_gpus(gpus: str | None) -> tuple[str, int, tuple[int, ...]]:
    """What ``--gpus`` asks for, read without probing: ("cpu", N, ()), ("cuda", 0, indices),
    or ("auto", 0, ()) with no ``--gpus``. A what-if size or anything else is an error."""
    text = (gpus or "").strip()
    if not text:
        return "auto", 0, ()
    if text.lower().startswith("cpu"):
        m = re.fullmatch(r"cpu(?::(\d+))?", text, re.IGNORECASE)
        if not m:
            raise HardwareSpecError(f"--gpus: cannot read {gpus!r} (cpu or cpu:N)", _GPUS_HINT)
        nproc, cores = int(m.group(1) or 1), os.cpu_count() or 1
        if not 1 <= nproc <= cores:
            raise HardwareSpecError(
                f"--gpus: {nproc} CPU processes, this machine has {cores} CPU cores",
                hint=f"give cpu:1 to cpu:{cores}",
            )
        return "cpu", nproc, ()
    if not re.fullmatch(r"\d+(\s*,\s*\d+)*", text):
        raise HardwareSpecError(f"--gpus: {gpus!r} is not a device selection for eval", _GPUS_HINT)
    indices = tuple(int(i) for i in text.split(","))
    if len(set(indices)) != len(indices):
        raise HardwareSpecError(f"--gpus: a GPU named twice in {gpus!r}", _GPUS_HINT)
    return "cuda", len(indices), indices


def select_devices(gpus: str | None, report: HardwareReport | None = None) -> Devices:
    """The devices ``--gpus`` names (`parse_gpus`); with no ``--gpus`` every visible GPU, else
    one CPU process. ``report`` is the NVML probe's (None: probe now; never CUDA here)."""
    kind, nproc, indices = parse_gpus(gpus)
    if kind == "cpu":
        return Devices("cpu", nproc)
    if report is None:
        from homelab_dp.probe import nvml

        report = nvml.probe()
    by_index = {g.index: g for g in report.gpus}
    if kind == "auto":
        if not report.gpus:
            return Devices("cpu", 1)
        indices = tuple(sorted(by_index))
    missing = [i for i in indices if i not in by_index]
    if missing:
        found = ", ".join(map(str, sorted(by_index))) or "none"
        raise HardwareSpecError(
            f"--gpus: no visible GPU with index {', '.join(map(str, missing))} (visible: {found})",
            hint=(report.notice + " " if report.notice else "") + _GPUS_HINT,
        )
    chosen = [by_index[i] for i in indices]
    uuids = tuple(g.uuid for g in chosen if g.uuid)
    devices = Devices("cuda", len(chosen), indices, uuids if len(uuids) == len(chosen) else ())
    _check_torch_sees(devices, report)
    return devices


def _check_torch_sees(devices: Devices, report: HardwareReport) -> None:
    """The installed torch can use the chosen cards (asked in a child process, as the run does)."""
    from homelab_dp.app.runs import check_torch_sees_cards

    by_index = {g.index: g for g in report.gpus}
    cards = tuple(PlanDevice(by_index[i].name, by_index[i].memory_total,
                             by_index[i].compute_capability) for i in devices.gpu_indices)  # fmt: skip
    check_torch_sees_cards(PlanHardware("cuda", cards, indices=devices.gpu_indices), report)


def check_model(ref: ModelRef) -> None:
    """Weights in safetensors, a tokenizer, remote code only where the run allowed it."""
    from homelab_dp.app.runs import check_model_folder

    check_model_folder(Preset(model=ModelSection(path=str(ref.config_path),
                                                 trust_remote_code=ref.trust_remote_code)))  # fmt: skip
    if ref.is_adapter and not (ref.path / "adapter_model.safetensors").is_file():
        raise HomelabError(
            f"{ref.path}: no adapter weights (adapter_model.safetensors)",
            hint="an adapter folder holds adapter_config.json and adapter_model.safetensors "
            "(pickle .bin adapters are never loaded)",
        )


def max_positions(ref: ModelRef) -> int | None:
    """The model's positions from its config.json (None where it names none)."""
    config = json.loads((ref.config_path / "config.json").read_text(encoding="utf-8"))
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return int(cfg[key])
    return None


def choose_seq_len(ref: ModelRef, seq_len: int | None) -> int:
    """``--seq-len``, else the run's, else min(2048, the model's positions); never beyond them."""
    limit = max_positions(ref)
    if seq_len is None:
        seq_len = ref.seq_len or min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN)
    if seq_len < 1:
        raise HomelabError(f"--seq-len: must be at least 1, got {seq_len}", hint="e.g. 512")
    if limit is not None and seq_len > limit:
        raise HomelabError(
            f"--seq-len: {seq_len} is beyond the model's {limit} positions "
            f"(max_position_embeddings in {ref.config_path / 'config.json'})",
            hint=f"give --seq-len {limit} or less",
        )
    return seq_len


def data_section(data: str, fmt: str, split: str, seq_len: int) -> DataSection:
    """--data as a [data] section (read as data.path is): a path made absolute, or a dataset
    id (``org/name``) that exists nowhere on disk, kept as typed."""
    if fmt not in (*FORMATS, *PREFERENCE_FORMATS, "sharegpt", "auto"):
        raise DataError(
            f"--format: unknown format {fmt!r}",
            hint=f"one of auto, {', '.join(FORMATS)}, sharegpt, preference",
        )
    path = Path(data).expanduser()
    value = data if not path.exists() and looks_like_hub_id(data) else str(path.absolute())
    return DataSection(path=value, format=fmt, split=split, seq_len=seq_len, pack=False)  # type: ignore[arg-type]


def check_data(ref: ModelRef, data: DataSection) -> tuple[str, int]:
    """Read, validate and tokenize the data as the worker will (into the token cache, which
    the workers read); returns the resolved format and the rows left with a target token within
    data.seq_len (a DataError names the file and line or row)."""

    def tokenizer() -> Any:  # the model's own tokenizer: the worker's tokens (on a cache miss)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            ref.tokenizer_path, local_files_only=True, trust_remote_code=ref.trust_remote_code
        )

    loaded = load_examples(
        data, TokenizerRef(Path(ref.tokenizer_path), tokenizer), seq_len_limit=None, field="--data"
    )
    blocks = build_blocks(loaded.examples, data.seq_len, False, loaded.pad_id)
    if not blocks:
        raise DataError(
            f"{loaded.label}: no token is left with a loss within {data.seq_len} tokens "
            f"({loaded.fmt} format)",
            hint="the prompts fill the whole sequence: raise --seq-len",
        )
    return loaded.fmt, len(blocks)


def data_format(data: DataSection) -> str:
    """The data's format as reading it will resolve it: ``--format`` when named, else the first
    record's keys (`format_from_keys`) without reading the whole source (a Parquet file's
    schema, a CSV header; a .json file is read). Errors as reading the data raises them."""
    if data.format != "auto":
        return str(data.format)
    first = resolve_source(str(data.path), str(data.split), field="--data").files()[0]
    suffix = first.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return format_from_keys(list(pq.read_schema(first).names)) or "auto"
    if suffix == ".csv":
        with first.open(encoding="utf-8-sig", errors="replace") as fh:
            header = fh.readline().strip().split(",")
        return format_from_keys([h.strip().strip('"') for h in header]) or "auto"
    if suffix == ".json":
        return read_source(resolve_source(str(data.path), str(data.split), field="--data"),
                           "auto")[2]  # fmt: skip
    return detect_format(first)


def check_pairs(ref: ModelRef, data: DataSection) -> tuple[int, int]:
    """Read, validate and tokenize preference pairs as the pair worker will (into the token
    cache); the pairs evaluated and the identical pairs left out (a DataError names the file
    and line of a bad record)."""

    def tokenizer() -> Any:  # on a cache miss only
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            ref.tokenizer_path, local_files_only=True, trust_remote_code=ref.trust_remote_code
        )

    loaded = load_pairs(data, TokenizerRef(Path(ref.tokenizer_path), tokenizer), objective="dpo",
                        seq_len_limit=None, field="--data")  # fmt: skip
    blocks, identical = pair_blocks_of(loaded.pairs, data, loaded.fmt, loaded.pad_id, seed=0,
                                       where=loaded.label, min_blocks=1)  # fmt: skip
    return len(blocks), identical


def _vocab_size(ref: ModelRef) -> int | None:
    """The model's vocabulary size from its config.json (None where it names none)."""
    config = json.loads((ref.config_path / "config.json").read_text(encoding="utf-8"))
    for cfg in (config, config.get("text_config") or {}):
        if isinstance(cfg.get("vocab_size"), int):
            return int(cfg["vocab_size"])
    return None


def choose_reference(ref: ModelRef, reference: str | None) -> tuple[ModelRef | None, str]:
    """The reference pairs are scored against and its label (module docstring): ``--reference``,
    else an adapter's base with the adapters disabled (None), else a run's starting model; a
    HomelabError for a plain model folder (no base to compare with)."""
    if reference:
        chosen = resolve_model_arg(reference)
        label = chosen.name
    elif ref.is_adapter:
        return None, f"{ref.base} with the adapters disabled"
    elif ref.run_dir is not None:
        preset = read_run_spec(ref.run_dir).preset
        start = str(preset.model.path)
        chosen = resolve_model_arg(start)
        # the run's starting model computes as the run did: its remote-code choice and dtype
        chosen = replace(chosen, trust_remote_code=bool(preset.model.trust_remote_code),
                         dtype=str(preset.model.dtype))  # fmt: skip
        label = f"{start} (the run's starting model)"
    else:
        raise HomelabError(
            f"{ref.path}: a model folder with no base to measure rewards against (the rewards "
            "compare the model with the one it was tuned from)",
            hint="give --reference PATH (the model it was tuned from, e.g. the SFT result), or "
            "evaluate the run by its id",
        )
    check_model(chosen)
    if _vocab_size(chosen) != _vocab_size(ref):
        raise HomelabError(
            f"--reference {chosen.path}: its vocabulary ({_vocab_size(chosen)} tokens) is not "
            f"the model's ({_vocab_size(ref)}): the same tokens cannot be scored by both",
            hint="give the model this one was tuned from",
        )
    return chosen, label


def pair_settings(ref: ModelRef, reference: str | None, identical: int) -> PairSettings:
    """The reference and the DPO loss settings: a run's train section, else the defaults."""
    train = read_run_spec(ref.run_dir).preset.train if ref.run_dir is not None else TrainSection()
    chosen, label = choose_reference(ref, reference)
    return PairSettings(chosen, label, float(train.beta), str(train.dpo_loss),
                        float(train.label_smoothing), identical)  # fmt: skip


def prepare(model: str, data: str, fmt: str = "auto", seq_len: int | None = None,
            gpus: str | None = None, split: str = "train",
            reference: str | None = None) -> EvalJob:  # fmt: skip
    """Resolve and check everything ``eval`` was given; a HomelabError before anything starts.
    The cheap checks come first; the GPU probe (and torch's answer, in a child) last."""
    parse_gpus(gpus)
    ref = resolve_model_arg(model)  # a Hugging Face id: its local snapshot
    check_model(ref)
    seq_len = choose_seq_len(ref, seq_len)
    section = data_section(data, fmt, split, seq_len)
    resolved = data_format(section)
    if resolved == "kto":
        raise DataError(
            f"--data {data}: KTO records (prompt, completion, label); eval measures the loss "
            "and rewards of preference pairs",
            hint='give pairs {"prompt","chosen","rejected"}, or SFT data for the loss per token',
        )
    if resolved == "preference":
        settings = pair_settings(ref, reference, 0)  # the reference first: no tokenizing
        samples, identical = check_pairs(ref, section)
        return EvalJob(ref, section, resolved, seq_len, samples, select_devices(gpus),
                       replace(settings, identical=identical))  # fmt: skip
    if reference:
        raise HomelabError(
            f"--reference: {data} is not preference data (format {resolved}); a reference "
            "scores pairs only",
            hint="leave --reference out for the loss per token, or give pairs",
        )
    resolved, samples = check_data(ref, section)
    return EvalJob(ref, section, resolved, seq_len, samples, select_devices(gpus))


def job_document(job: EvalJob, folder: Path) -> dict[str, Any]:
    """What `homelab_dp.train.evaluation.eval_worker` reads (see the module docstring); for pairs also what
    `homelab_dp.train.evaluation.pair_evaluation` reads."""
    ref = job.ref
    doc = {
        "model_path": str(ref.path),
        "base_path": str(ref.base) if ref.base is not None else None,
        "tokenizer_path": str(ref.tokenizer_path),
        "trust_remote_code": ref.trust_remote_code,
        "dtype": ref.dtype,
        "quantized": ref.quantized,
        "device": job.devices.kind,
        "data_path": job.data.path,
        "split": job.data.split,
        "format": job.data.format,
        "seq_len": job.seq_len,
        "result_path": str(folder / "result.json"),
        "error_dir": str(folder / "errors"),
    }
    if job.pairs is not None:
        r = job.pairs.reference
        doc["reference"] = None if r is None else {
            "model_path": str(r.path),
            "base_path": str(r.base) if r.base is not None else None,
            "quantized": r.quantized,
            "trust_remote_code": r.trust_remote_code,
        }  # fmt: skip
        doc.update(beta=job.pairs.beta, loss_type=job.pairs.loss_type,
                   label_smoothing=job.pairs.label_smoothing)  # fmt: skip
    return doc


def eval_command(folder: Path, nproc: int, job_file: Path, module: str = EVAL_MODULE) -> list[str]:
    """The launcher's torchrun command (loopback rendezvous, logs under ``folder/logs``) with
    the eval worker ``module`` in place of the training worker."""
    return torchrun_command(folder, nproc, worker=(module, job_file))


def eval_env(devices: Devices) -> dict[str, str]:
    """The workers' environment: the chosen GPUs only (or none), loopback rendezvous, offline."""
    # The launcher's one rule (`probe.visible_gpus.cuda_device_env`): no card for a CPU evaluation
    # (it never opens a CUDA context), else the chosen cards by UUID or NVML index, counted in
    # PCI bus order as NVML counts them.
    cards = (
        [] if devices.kind == "cpu" else list(devices.gpu_uuids or map(str, devices.gpu_indices))
    )
    env = cuda_device_env(os.environ, cards)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    if devices.kind == "cpu" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // devices.nproc))
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env["HOMELAB_DP_LOOPBACK"] = "1"  # homelab_dp.supervise.torchrun_agent: TCP stores on 127.0.0.1
    return env


def run_eval(job: EvalJob) -> EvalReport | PairEvalReport:
    """Evaluate ``job`` under torchrun and return rank 0's result (see the module docstring)."""
    folder = Path(tempfile.mkdtemp(prefix="homelab-dp-eval-"))  # 0700
    job_file = folder / "job.json"
    job_file.write_text(json.dumps(job_document(job, folder), indent=2), encoding="utf-8")
    module = EVAL_MODULE if job.pairs is None else PAIR_EVAL_MODULE
    rc = launch_and_wait(folder, eval_command(folder, job.devices.nproc, job_file, module),
                         eval_env(job.devices))  # fmt: skip
    result = folder / "result.json"
    if rc == 0 and result.is_file():
        doc = json.loads(result.read_text(encoding="utf-8"))
        shutil.rmtree(folder, ignore_errors=True)
        return _report(job, doc) if job.pairs is None else _pair_report(job, doc)
    raise job_failure(folder, rc)


def launch_and_wait(folder: Path, cmd: list[str], env: dict[str, str]) -> int:
    """Run the torchrun ``cmd`` in a session of its own (its output in ``folder/launcher.log``)
    and return its exit code. Ctrl-C, or SIGTERM to the front end, stops every worker, removes
    ``folder`` (the job's private temporary folder) and raises KeyboardInterrupt. Used by
    `homelab-dp eval` and `homelab-dp bench`."""
    with open(folder / "launcher.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return proc.wait()
    except KeyboardInterrupt:
        stop_workers(proc)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM to the front end stops the evaluation as Ctrl-C does (torchrun, in its own
    session, would otherwise run on)."""
    raise KeyboardInterrupt


def stop_workers(proc: subprocess.Popen[bytes]) -> None:
    """Stop torchrun and every worker it started: SIGTERM (torchrun stops its workers), then
    SIGKILL to whatever is left after `STOP_GRACE_S` (workers run in sessions of their own)."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=STOP_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    proc.wait()


def _report(job: EvalJob, doc: dict[str, Any]) -> EvalReport:
    """The report from rank 0's result document."""
    figures = {k: doc[k] for k in ("world_size", "loss", "perplexity", "tokens", "real_tokens",
                                   "tokens_per_s", "seconds", "samples", "device", "dtype",
                                   "base")}  # fmt: skip
    return EvalReport(model=job.ref.name, data=job.data.path, seq_len=job.seq_len, **figures)


def _pair_report(job: EvalJob, doc: dict[str, Any]) -> PairEvalReport:
    """The pair report from rank 0's result document."""
    assert job.pairs is not None
    figures = {k: doc[k] for k in ("world_size", "loss", "reward_accuracy", "reward_margin",
                                   "rewards_chosen", "rewards_rejected", "pairs", "seconds",
                                   "device", "dtype", "base")}  # fmt: skip
    p = job.pairs
    return PairEvalReport(model=job.ref.name, data=job.data.path, reference=p.reference_label,
                          identical=p.identical, beta=p.beta, loss_type=p.loss_type,
                          label_smoothing=p.label_smoothing, seq_len=job.seq_len,
                          **figures)  # fmt: skip


def job_failure(folder: Path, rc: int, what: str = "eval") -> HomelabError:
    """The error of a failed torchrun job (``what``: "eval", "bench"): a worker's own error
    (bad input: exit 2), else the failing rank's log tail (exit 1). The folder stays for the
    full logs."""
    errors = sorted((folder / "errors").glob("rank-*.json"))
    if errors:
        err = json.loads(errors[0].read_text(encoding="utf-8"))
        if err.get("bad_input"):
            shutil.rmtree(folder, ignore_errors=True)
            return HomelabError(err["message"], hint=err.get("hint") or "")
        rank = err.get("rank", 0)
        first = f"{what} failed on rank {rank}: {err['message']}"
    else:  # killed, or torchrun itself failed: its log names the rank and the signal
        rank, first = None, f"{what} failed (torchrun exit code {rc})"
    tail = log_tail(folder, rank)
    return RunFailedError(f"{first}\n{tail}".rstrip(), hint=f"the logs are kept in {folder}")


def log_tail(folder: Path, rank: int | None, lines: int = 20) -> str:
    """The last lines a rank wrote on stderr (torchrun's per-rank log), else torchrun's own."""
    logs = [] if rank is None else sorted((folder / "logs").glob(f"*/attempt_*/{rank}/stderr.log"))
    try:
        text = (logs[-1] if logs else folder / "launcher.log").read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:])


def evaluate_model(model: str, data: str, fmt: str = "auto", seq_len: int | None = None,
                   gpus: str | None = None, split: str = "train",
                   reference: str | None = None) -> EvalReport | PairEvalReport:  # fmt: skip
    """`prepare` then `run_eval`: what `homelab-dp eval` does."""
    return run_eval(prepare(model, data, fmt, seq_len, gpus, split, reference))
