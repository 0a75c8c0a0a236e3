"""`homelab-dp doctor`: is this machine ready to train? Facts are gathered, then checked.

Gathering (`gather`) reads the machine: the probe, the installed torch (imported here, inside
functions only, so `plan` and `probe` stay torch-free), bitsandbytes, free disk for the runs
folder, /dev/shm and the open-file limit. The checks (`run_checks`) are pure functions of those
`Facts`, so tests feed recorded facts; each gives a `Check`: ok, warn, fail or skip (nothing to
check: no GPU, no torch), a detail and a hint saying what to do.

The run controller's preflight uses `torch_facts` and `torch_mismatch` too: a CUDA plan is
refused (exit 2) when the installed torch cannot see the planned cards.

Whether the installed torch can drive these cards, and how to install one that can.

Pure: reads the probe (`HardwareReport`) and what torch said (`TorchFacts`). Used by
`homelab-dp doctor` and by the run controller's preflight, which refuses a CUDA plan (exit 2)
when the installed torch cannot see the planned cards.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from homelab_dp.byte_units import GiB, format_bytes
from homelab_dp.planning.memory.layer_kinds import KERNELS, installed_kernels
from homelab_dp.probe.hardware import (
    BF16_MIN_CAPABILITY,
    GpuInfo,
    HardwareReport,
    mig_off,
    mig_on,
    mig_slice,
)
from homelab_dp.probe.machine_facts import (
    Facts,
    TorchFacts,
    bnb_facts,
    disk_facts,
    nofile_limit,
    shm_bytes,
    torch_facts,
)

WHEEL_INDEX = "https://download.pytorch.org/whl/"
MIN_DRIVER = {11: "450.80", 12: "525.60", 13: "580"}
"""The oldest Linux driver for each CUDA major version (minor versions are compatible)."""


def parse_version(text: str | None) -> tuple[int, int] | None:
    """``"12.4"`` -> (12, 4); None for anything else."""
    m = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def short_name(name: str) -> str:
    """``NVIDIA GeForce RTX 3090`` -> ``RTX 3090``: what both NVML and torch call a card."""
    return name.removeprefix("NVIDIA ").removeprefix("GeForce ").strip()


def card_key(name: str) -> str:
    """A card's name as both NVML and torch spell it, lower case, single spaces."""
    return " ".join(short_name(name).lower().split())


def same_card(a: str, b: str) -> bool:
    return card_key(a) == card_key(b)


def is_mig_device(name: str) -> bool:
    """A torch device that is a MIG slice: CUDA names it ``<card> MIG <profile>``."""
    return " mig " in f" {card_key(name)} "


def mig_parent(name: str, cards: Sequence[GpuInfo]) -> GpuInfo | None:
    """The card with MIG on that the MIG slice torch calls ``name`` belongs to."""
    key = card_key(name)
    found = [g for g in cards if mig_on(g) and key.startswith(card_key(g.name) + " mig ")]
    return found[0] if found else None


def card_names(names: Sequence[str]) -> str:
    """Short names, comma-separated ("none" for none)."""
    return ", ".join(short_name(n) for n in names) if names else "none"


def is_consumer(name: str) -> bool:
    """GeForce and TITAN cards: NVIDIA turns PCIe peer-to-peer off on most of them."""
    lowered = name.lower()
    return "geforce" in lowered or "titan" in lowered


def capability_of(gpu: GpuInfo, torch: TorchFacts) -> tuple[int, int] | None:
    """The card's compute capability: from the probe, else from the torch device of that name."""
    if gpu.compute_capability:
        return (int(gpu.compute_capability[0]), int(gpu.compute_capability[1]))
    same = [d for d in torch.devices if same_card(d.name, gpu.name) and d.capability]
    return same[0].capability if same else None


def wheel_tag(
    driver_cuda: str | None, capabilities: Sequence[tuple[int, int] | None] = ()
) -> str | None:
    """The PyTorch wheel index (``cu126``…) for this driver and these cards, or None when the
    driver is too old for any current build.

    CUDA minor versions are compatible, so a CUDA 12.x driver runs the cu126 build (which still
    has kernels for Pascal and Volta); Blackwell cards (10.x, 12.x) need cu128 or newer; the
    CUDA 13 builds drop cards older than Turing (7.5).
    """
    driver = parse_version(driver_cuda)
    if driver is None:
        return None
    known = [c for c in capabilities if c]
    blackwell = any(c >= (10, 0) for c in known)
    old = any(c < (7, 5) for c in known)
    if driver >= (13, 0):
        return "cu126" if old else "cu130"
    if driver >= (12, 0):
        return "cu128" if blackwell and driver >= (12, 8) else "cu126"
    if driver >= (11, 8):
        return "cu118"
    return None


def install_hint(report: HardwareReport, torch: TorchFacts) -> str:
    """How to install the CUDA build of torch that this driver runs."""
    caps = [capability_of(g, torch) for g in report.gpus]
    tag = wheel_tag(report.cuda_driver_version, caps)
    driver = report.cuda_driver_version
    if driver is None:
        return (
            "install the CUDA build of torch for your driver (`nvidia-smi` shows its CUDA "
            f"version), e.g. for CUDA 12: pip uninstall -y torch && pip install torch "
            f"--index-url {WHEEL_INDEX}cu126"
        )
    if tag is None:
        return (
            f"the driver supports CUDA {driver}, older than any current torch build: update the "
            "NVIDIA driver (CUDA 12 needs 525.60 or newer), then install the CUDA build of torch"
        )
    built = f"{tag[2:-1]}.{tag[-1]}"
    return (
        f"install the CUDA build of torch: pip uninstall -y torch && "
        f"pip install torch --index-url {WHEEL_INDEX}{tag} (CUDA {built}; "
        f"the driver supports CUDA {driver})"
    )


def no_gpu(report: HardwareReport) -> str:
    """Why GPU checks are skipped, from the probe's notice: ``no GPU: no NVIDIA driver found``."""
    reason = re.sub(r"\s*\(.*\)$", "", (report.notice or "").split(";")[0].strip().rstrip("."))
    return f"no GPU: {reason[:1].lower()}{reason[1:]}" if reason else "no GPU"


def visible_hint(torch: TorchFacts) -> str:
    if torch.visible_devices is None:
        return ""
    return (
        f"CUDA_VISIBLE_DEVICES={torch.visible_devices} is set: torch reads its numbers in CUDA's "
        "order (the fastest card first unless CUDA_DEVICE_ORDER=PCI_BUS_ID), `homelab-dp probe` "
        "in PCI bus order; export CUDA_DEVICE_ORDER=PCI_BUS_ID or name the cards by UUID "
        "(`nvidia-smi -L`). "
    )


def torch_unusable(report: HardwareReport, torch: TorchFacts) -> tuple[str, str] | None:
    """Why the installed torch cannot drive the probed GPUs at all, as (problem, hint): not
    importable, a CPU-only (or ROCm) build, or CUDA would not start. None when it can."""
    if not report.gpus:
        return None
    if torch.version is None:
        return (
            f"torch cannot be imported ({torch.error})",
            "install torch into this environment: " + install_hint(report, torch),
        )
    if not torch.cuda or torch.hip:
        build = f"a ROCm build (HIP {torch.hip})" if torch.hip else "a CPU-only build"
        return (
            f"the installed torch {torch.version} is {build}: it cannot use the GPUs",
            install_hint(report, torch) + "; or run on the CPU with --gpus cpu:N",
        )
    if not torch.cuda_available:
        why = f": {torch.error}" if torch.error else ""
        built, driver = parse_version(torch.cuda), parse_version(report.cuda_driver_version)
        if built and driver and built[0] > driver[0]:
            hint = (
                f"torch was built for CUDA {torch.cuda} but the driver supports CUDA "
                f"{report.cuda_driver_version}: update the driver (CUDA {built[0]} needs "
                f"{MIN_DRIVER.get(built[0], 'a newer one')} or newer), or "
                + install_hint(report, torch)
            )
        else:
            hint = (
                visible_hint(torch) + "check that `nvidia-smi` works and that you may open "
                "/dev/nvidia*; in a container, start it with --gpus all"
            )
        return f"torch {torch.version} (CUDA {torch.cuda}) cannot start CUDA{why}", hint
    return None


def torch_mismatch(report: HardwareReport, torch: TorchFacts) -> tuple[str, str] | None:
    """Why the installed torch cannot train on the probed cards, as (problem, hint), naming
    both lists of cards; None when it sees them all (same count, same names; torch may number
    them in another order). A card with MIG on counts as seen whether torch shows one of its
    MIG slices or none: CUDA gives a process one MIG slice, and the run names its own."""
    if not report.gpus:
        return None
    nvml_names = [g.name for g in report.gpus]
    listed = f"NVML lists {len(nvml_names)} ({card_names(nvml_names)})"
    unusable = torch_unusable(report, torch)
    if unusable:
        return f"{unusable[0]}; {listed}", unusable[1]
    torch_names = [d.name for d in torch.devices]
    # A card with MIG on shows CUDA at most one of its slices (one per process), named
    # "<card> MIG <profile>": the whole cards must match, and each slice be of a MIG card.
    whole = [g.name for g in report.gpus if not mig_on(g)]
    torch_whole = [n for n in torch_names if not is_mig_device(n)]
    strays = [n for n in torch_names if is_mig_device(n) and mig_parent(n, report.gpus) is None]
    if strays or sorted(map(card_key, whole)) != sorted(map(card_key, torch_whole)):
        return (
            f"torch sees {len(torch_names)} GPU{'s' if len(torch_names) != 1 else ''} "
            f"({card_names(torch_names)}) but {listed}",
            visible_hint(torch) + "`nvidia-smi` and torch should list the same cards; check "
            "the driver and that no card is held by another container or VM",
        )
    return None


Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "skip")

# -- thresholds --------------------------------------------------------------------------------
DISK_WARN = 20 * GiB
"""Free space for the runs folder below which `disk` warns (a few checkpoints of a 7B LoRA, or
one full checkpoint of a 1B model with its optimizer state)."""
DISK_FAIL = 2 * GiB
"""Below this `disk` fails: the first checkpoint of even a small model may not fit."""
RAM_WARN = 4 * GiB
"""Available host RAM below which `host RAM` warns: every rank loads the weights into RAM first."""
SHM_WARN = 1 * GiB
"""/dev/shm below this warns: NCCL and the data loader share memory through it (Docker's default
is 64 MiB)."""
NOFILE_WARN = 4096
"""An open-file limit below this warns: NCCL, the ranks' logs and the data loader open many."""
MEMORY_TOLERANCE = 0.05
"""torch's and NVML's memory size of one card may differ by this fraction (CUDA reserves some)."""


@dataclass(frozen=True)
class Check:
    """One check's answer; `doctor --json` prints these as they are."""

    name: str
    status: Status
    detail: str
    hint: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def gather(report: HardwareReport | None = None) -> Facts:
    """Read this machine: the probe (unless given), torch, bitsandbytes, disk, shm, rlimit."""
    from homelab_dp.probe import nvml
    from homelab_dp.runs.folder.run_folder import runs_root

    report = report if report is not None else nvml.probe()
    return Facts(
        report=report,
        torch=torch_facts(),
        bnb=bnb_facts(want_cuda=bool(report.gpus)),
        disk=disk_facts(runs_root()),
        shm_bytes=shm_bytes(),
        nofile=nofile_limit(),
        kernels=frozenset(installed_kernels()),
    )


# ---------------------------------------------------------------------- the checks (pure)
def check_driver(f: Facts) -> Check:
    r = f.report
    if not r.gpus:
        said, _, advice = (r.notice or "no GPU found").partition("; ")
        return Check("nvml driver", "skip", said, advice)
    detail = f"driver {r.driver_version or 'n/a'}, CUDA {r.cuda_driver_version or 'n/a'}"
    detail += f", {len(r.gpus)} GPU{'s' if len(r.gpus) > 1 else ''}"
    if r.notice:
        return Check("nvml driver", "warn", f"{detail}; {r.notice}", "see `homelab-dp probe`")
    return Check("nvml driver", "ok", detail)


def check_torch_build(f: Facts) -> Check:
    t, r = f.torch, f.report
    name = "torch build"
    if t.version is None:
        hint = install_hint(r, t) if r.gpus else "pip install torch"
        return Check(name, "fail", f"torch cannot be imported: {t.error}", hint)
    build = f"torch {t.version}" + (f" (CUDA {t.cuda})" if t.cuda else "")
    if not r.gpus:
        kind = "a CUDA build" if t.cuda else "a CPU build"
        return Check(name, "skip", f"{no_gpu(r)}; {build} is {kind}, fine for CPU runs")
    unusable = torch_unusable(r, t)
    if unusable:
        return Check(name, "fail", *unusable)
    detail = f"{build}; the driver supports CUDA {r.cuda_driver_version or 'n/a'}"
    built, driver = parse_version(t.cuda), parse_version(r.cuda_driver_version)
    if built and driver and built > driver:
        detail += " (runs through CUDA minor-version compatibility)"
    return Check(name, "ok", detail)


def check_torch_devices(f: Facts) -> Check:
    t, r = f.torch, f.report
    name = "torch sees the cards"
    if not r.gpus:
        return Check(name, "skip", no_gpu(r))
    if not t.cuda_available:
        return Check(name, "skip", "torch cannot use CUDA (see torch build)")
    mismatch = torch_mismatch(r, t)
    if mismatch:
        return Check(name, "fail", *mismatch)
    # pair each NVML card with a torch device of the same name, in order
    unused = list(t.devices)
    far = []
    for g in r.gpus:
        if g.mig is not None and g.mig.enabled:
            continue  # torch shows at most one MIG slice, never the card: the MIG check says
        d = next(d for d in unused if same_card(d.name, g.name))
        unused.remove(d)
        if (
            g.memory_total
            and abs(d.memory_total - g.memory_total) > MEMORY_TOLERANCE * g.memory_total
        ):
            far.append(
                f"GPU {g.index}: torch {format_bytes(d.memory_total)}, NVML "
                f"{format_bytes(g.memory_total)}"
            )
    detail = f"{len(t.devices)} GPU{'s' if len(t.devices) > 1 else ''}: {card_names([d.name for d in t.devices])}"
    if far:
        return Check(
            name,
            "warn",
            f"{detail}; memory differs by more than {MEMORY_TOLERANCE:.0%}: " + "; ".join(far),
            "a MIG slice, a virtual GPU or memory held by another process; `nvidia-smi` shows which",
        )
    return Check(name, "ok", detail)


def check_compute(f: Facts) -> list[Check]:
    r = f.report
    if not r.gpus:
        return [Check("compute capability", "skip", no_gpu(r))]
    caps = {g.index: capability_of(g, f.torch) for g in r.gpus}
    no_bf16 = [i for i, c in caps.items() if c is not None and c < BF16_MIN_CAPABILITY]
    out = []
    for g in r.gpus:
        name = f"GPU {g.index} compute"
        cap = caps[g.index]
        card = short_name(g.name)
        if cap is None:
            out.append(Check(name, "skip", f"{card}: compute capability not reported"))
            continue
        cc = f"{card}: compute capability {cap[0]}.{cap[1]}"
        if cap < BF16_MIN_CAPABILITY:
            out.append(
                Check(
                    name,
                    "warn",
                    f"{cc}, no bf16 (needs 8.0): fp16 will be used",
                    'fp16 trains with loss scaling; set model.dtype = "fp32" if the loss '
                    "turns NaN, or plan on an Ampere or newer card for bf16",
                )
            )
            continue
        others = [i for i in no_bf16 if i != g.index]
        if others:
            cc += f", bf16 supported; with GPU {', '.join(map(str, others))} in the run, fp16"
        else:
            cc += ", bf16 supported"
        out.append(Check(name, "ok", cc))
    return out


def check_mig(f: Facts) -> list[Check]:
    """Each card that has MIG: off (ok, the whole card is planned), or on (warn: a plan uses
    one slice in one process), or about to change at the next reset (warn). No check at all
    where no card has MIG."""
    return [_mig_check(g, f.report.visible_mig) for g in f.report.gpus if g.mig is not None]


def _mig_check(g: GpuInfo, wanted: str | None) -> Check:
    assert g.mig is not None
    name, card, i = f"GPU {g.index} MIG", short_name(g.name), g.index
    off = mig_off(i)
    if not g.mig.enabled:
        if g.mig.pending:
            return Check(
                name,
                "warn",
                f"{card}: MIG off now, on after the card's next reset; until then the whole card "
                "is planned",
                f"reset the card to apply it (sudo nvidia-smi -i {i} -r), or keep the whole card: "
                f"sudo nvidia-smi -i {i} -mig 0",
            )
        return Check(name, "ok", f"{card}: MIG off: the whole card is planned")
    chosen = mig_slice(g, wanted)
    if chosen is None:
        return Check(
            name,
            "warn",
            f"{card}: MIG on but no MIG instance CUDA can be given: nothing can run on this card",
            f"create one: sudo nvidia-smi mig -i {i} -cgi <profile> -C (`nvidia-smi mig -i {i} "
            f"-lgip` lists the profiles), or turn MIG off: {off}",
        )
    n = len(g.mig.slices)
    listed = ", ".join(
        f"{s.profile} {format_bytes(s.memory_bytes)} ({s.uuid or 'no UUID'})" for s in g.mig.slices
    )
    why = "named by CUDA_VISIBLE_DEVICES" if chosen.uuid == wanted else "the most free memory"
    detail = (
        f"{card}: MIG on, {n} slice{'s' if n != 1 else ''}: {listed}; a plan uses one slice in "
        f"one process, never the whole card (now {chosen.uuid}, {why}); no run across cards"
    )
    if not g.mig.pending:
        detail += "; MIG goes off at the card's next reset"
    return Check(
        name,
        "warn",
        detail,
        f"to train on the whole card (or across cards), turn MIG off: {off}; to pick a slice, "
        "set CUDA_VISIBLE_DEVICES to its MIG UUID",
    )


def check_nccl(f: Facts) -> Check:
    t = f.torch
    if not f.report.gpus:
        return Check("nccl", "skip", f"{no_gpu(f.report)}; CPU runs use gloo")
    if t.version is None or not t.cuda:
        return Check("nccl", "skip", "torch has no CUDA (see torch build)")
    if not t.nccl:
        return Check(
            "nccl",
            "fail",
            f"torch {t.version} has no NCCL: CUDA runs cannot start their process group",
            "install the Linux CUDA build of torch from pytorch.org (it ships NCCL)",
        )
    return Check("nccl", "ok", "torch.distributed has NCCL")


def check_links(f: Facts) -> list[Check]:
    r = f.report
    if not r.gpus:
        return [Check("peer-to-peer", "skip", no_gpu(r))]
    if len(r.gpus) < 2:
        return [Check("peer-to-peer", "skip", "one card: no traffic between cards")]
    names = {g.index: g.name for g in r.gpus}
    out = []
    for link in r.links:
        name = f"GPU {link.a}↔{link.b} link"
        where = f" ({link.topology})" if link.topology else ""
        if link.kind == "nvlink":
            out.append(Check(name, "ok", f"NVLink ×{link.nvlink_links}{where}"))
            continue
        if link.kind == "p2p":
            out.append(Check(name, "ok", f"PCIe peer-to-peer{where}"))
            continue
        consumer = is_consumer(names.get(link.a, "")) or is_consumer(names.get(link.b, ""))
        said = "no peer-to-peer" if link.kind == "pcie" else "peer-to-peer not reported"
        detail = f"{said}{where}: gradient sync goes through host memory"
        if consumer:
            detail += " (GeForce cards usually have P2P turned off)"
        hint = (
            "if NCCL hangs at the first all-reduce, run with NCCL_P2P_DISABLE=1 "
            "(e.g. NCCL_P2P_DISABLE=1 homelab-dp run PRESET)"
        )
        if not consumer:
            hint += "; on workstation cards, check that IOMMU/ACS is off in the BIOS"
        out.append(Check(name, "warn", detail, hint))
    return out


def check_bitsandbytes(f: Facts) -> Check:
    b, t = f.bnb, f.torch
    name = "bitsandbytes"
    version = f"bitsandbytes {b.version}"
    if not f.report.gpus:
        if b.version is None:
            said = "bitsandbytes is not installed"
        elif b.imported:
            said = f"{version} imports"
        else:
            said = f"{version} does not import ({b.error})"
        return Check(name, "skip", f"{no_gpu(f.report)}; QLoRA needs CUDA; {said}")
    if b.version is None:
        return Check(
            name,
            "fail",
            "bitsandbytes is not installed: QLoRA presets cannot run",
            "pip install bitsandbytes",
        )
    if not b.imported:
        return Check(
            name,
            "fail",
            f"{version} does not import: {b.error}",
            "pip install --force-reinstall bitsandbytes",
        )
    if not t.cuda_available:
        return Check(name, "skip", f"{version} imports; torch cannot use CUDA (see torch build)")
    if not b.cuda_kernels:
        return Check(
            name,
            "fail",
            f"{version} imports but its CUDA kernels did not load: {b.error}",
            "QLoRA needs them: pip install -U bitsandbytes (its wheels carry kernels for each "
            f"CUDA; torch's is {t.cuda})",
        )
    return Check(name, "ok", f"{version}, CUDA kernels loaded")


def check_kernels(f: Facts) -> Check:
    """The fast kernels of linear-attention and state-space layers (Qwen3.5 and Qwen3-Next's
    Gated DeltaNet, Nemotron-H / Falcon-H1 / Granite-4's Mamba-2, LFM2's short convolution).
    Without them those layers run transformers' torch reference path: correct, slower. Attention
    models are not affected, so a missing kernel is said, not warned about."""
    name = "state-space kernels"
    if not f.report.gpus:
        return Check(name, "skip", f"{no_gpu(f.report)}; the fast kernels run on CUDA only")
    missing = [(kind, pkg, slow) for kind, (pkg, module, slow) in KERNELS.items()
               if module not in f.kernels]  # fmt: skip
    if not missing:
        return Check(name, "ok", "flash-linear-attention, mamba-ssm and causal-conv1d installed")
    slow = ", ".join(f"{kind.replace('_', ' ')} about {factor:g}x" for kind, _, factor in missing)
    pkgs = " and ".join(sorted({pkg for _, pkg, _ in missing}))
    return Check(
        name,
        "ok",
        f"{pkgs} not installed: a hybrid model's layers run the torch reference path ({slow} "
        "slower per mixer); attention-only models are not affected",
        "pip install 'homelab-dp[kernels]' before training Qwen3.5, Qwen3-Next, Nemotron-H or "
        "Falcon-H1 on this machine",
    )


def check_disk(f: Facts) -> Check:
    d = f.disk
    if d is None:
        return Check("disk", "skip", "the runs folder's disk could not be read")
    detail = f"{format_bytes(d.free)} free of {format_bytes(d.total)} for {d.path}"
    hint = "checkpoints and the final model go under the runs folder: free space or point "
    hint += "HOMELAB_DP_RUNS at a bigger disk"
    if d.free < DISK_FAIL:
        return Check("disk", "fail", detail, hint)
    if d.free < DISK_WARN:
        return Check("disk", "warn", detail, hint)
    return Check("disk", "ok", detail)


def check_ram(f: Facts) -> Check:
    h = f.report.host
    detail = f"{format_bytes(h.ram_total)} total"
    if h.ram_available is None:
        return Check("host RAM", "ok", detail + ", available n/a")
    detail += f", {format_bytes(h.ram_available)} available"
    if h.ram_available < RAM_WARN:
        return Check(
            "host RAM",
            "warn",
            detail,
            "every rank loads the weights into RAM before its card: close other programs",
        )
    return Check("host RAM", "ok", detail)


def check_shm(f: Facts) -> Check:
    if f.shm_bytes is None:
        return Check("/dev/shm", "skip", "no /dev/shm on this system")
    detail = format_bytes(f.shm_bytes)
    if f.shm_bytes < SHM_WARN:
        return Check(
            "/dev/shm",
            "warn",
            f"{detail}: NCCL and the data loader may run out of shared memory",
            "in Docker, start the container with --shm-size=8g (or --ipc=host)",
        )
    return Check("/dev/shm", "ok", detail)


def check_nofile(f: Facts) -> Check:
    if f.nofile is None:
        return Check("open files", "skip", "the open-file limit cannot be read here")
    soft, hard = f.nofile
    limit = "unlimited" if soft < 0 else str(soft)
    detail = f"limit {limit} (hard {'unlimited' if hard < 0 else hard})"
    if 0 <= soft < NOFILE_WARN:
        target = 65536 if hard < 0 else min(65536, hard)
        return Check(
            "open files",
            "warn",
            detail,
            f"raise it before running: ulimit -n {target}",
        )
    return Check("open files", "ok", detail)


def run_checks(f: Facts) -> list[Check]:
    """Every check, in the order a person reads them: GPUs and torch first, then the host."""
    return [
        check_driver(f),
        check_torch_build(f),
        check_torch_devices(f),
        *check_compute(f),
        *check_mig(f),
        check_nccl(f),
        *check_links(f),
        check_bitsandbytes(f),
        check_kernels(f),
        check_disk(f),
        check_ram(f),
        check_shm(f),
        check_nofile(f),
    ]


def failed(checks: Sequence[Check]) -> bool:
    """Any check failed (`doctor` exits 1)."""
    return any(c.status == "fail" for c in checks)


def counts(checks: Sequence[Check]) -> dict[str, int]:
    """How many checks ended in each status, in `STATUSES` order."""
    return {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
