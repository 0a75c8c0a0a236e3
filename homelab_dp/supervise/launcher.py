"""Build and start the torchrun command of a run (PyTorch's own elastic launcher, no home-made one).

Single node: everything listens on 127.0.0.1 only — the c10d rendezvous on a port the kernel
picks at bind time (no race between two runs started at once), torchrun's TCP stores through
`homelab_dp.supervise.torchrun_agent` (torchrun's own main, with each store's socket bound to loopback), and
gloo / NCCL's socket bootstrap on the loopback interface. An explicit ``master_port`` that is
taken fails at once (``is_host=1``: never a client of someone else's store). Multi-node: the
same worker over c10d at ``master_addr:master_port``; checkpoints and resume then need the run
folder on a filesystem every node shares (training and the result on node 0 work without one).

torchrun runs in a new session with its output in ``RUN_DIR/logs/launcher.log`` (never a pipe to
the parent: a dead parent must not kill training); each rank's stdout/stderr are also written
under ``RUN_DIR/logs/<run>/attempt_0/<local rank>/``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from homelab_dp.probe.visible_gpus import cuda_device_env
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.run_spec import Rendezvous, RunSpec

WORKER_MODULE = "homelab_dp.train.loop.worker"
AGENT_MODULE = (
    "homelab_dp.supervise.torchrun_agent"  # torchrun's main, its stores on loopback (single node)
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_command(
    run_dir: Path,
    nproc_per_node: int,
    rendezvous: Rendezvous | None = None,
    *,
    resume: bool = False,
    worker: tuple[str, Path] | None = None,
) -> list[str]:
    """The argv that starts ``nproc_per_node`` workers of ``run_dir`` under torchrun.

    ``worker``: (module, its argument) in place of the training worker and ``run_dir`` (the
    eval worker and its job file); logs still go to ``run_dir/logs``.

    The rendezvous is named after the run folder on a single node, and
    ``homelab-dp-<master_addr>-<master_port>`` on several nodes, so that nodes whose run folders
    are named differently still meet.
    """
    run_dir = Path(run_dir).absolute()
    rdzv = rendezvous or Rendezvous()
    if rdzv.nnodes == 1:
        endpoint = f"127.0.0.1:{rdzv.master_port or 0}"  # 0: the kernel picks a free port at bind
        local = ["--local-addr", "127.0.0.1", "--rdzv-conf=is_host=1"]
        rdzv_id = run_dir.name
    else:
        if rdzv.master_port is None:
            raise ValueError("multi-node runs need master_port (the same on every node)")
        endpoint = f"{rdzv.master_addr}:{rdzv.master_port}"
        local = []
        rdzv_id = f"homelab-dp-{rdzv.master_addr}-{rdzv.master_port}"
    cmd = [
        sys.executable, "-m", AGENT_MODULE,
        f"--nnodes={rdzv.nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--node-rank={rdzv.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        *local,
        "--max-restarts=0",
        "--log-dir", str(run_dir / "logs"),
        "--redirects=3",
        "--tee=3",
        "-m", *((worker[0], str(worker[1])) if worker else (WORKER_MODULE, str(run_dir))),
    ]  # fmt: skip
    if resume:
        cmd.append("--resume")
    return cmd


def worker_env(spec: RunSpec) -> dict[str, str]:
    """The environment of the torchrun agent (inherited by its workers).

    The one place that sets ``CUDA_VISIBLE_DEVICES``: to the planned cards, so that the workers
    see exactly the devices that were planned and are monitored, rank i on the i-th of them.
    They are named by UUID when the spec has one per card (the probe's, so the same cards even
    if the bus order changed before a resume), else by NVML index; ``CUDA_DEVICE_ORDER`` is
    set to ``PCI_BUS_ID`` either way, because NVML indices are PCI bus order while CUDA counts
    the fastest card first by default. A multi-node run uses the indices: a UUID names a card
    of one machine, and each node runs the same device numbers. A user's own
    ``CUDA_VISIBLE_DEVICES`` is not lost: the probe already kept only the cards it leaves
    visible, so the planned ones are among them.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # rank logs reach their files as they are written
    nproc = spec.launch.nproc_per_node
    if spec.resolved.device == "cpu" and "OMP_NUM_THREADS" not in env:
        # torchrun would set 1; the cores are better shared out between the ranks.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, nproc)))
    if spec.resolved.device == "cpu":
        # OpenMP threads that spin at every barrier while another process holds a core ran
        # 10-25x slower on a shared 2-core machine (56-130 against 1,000-2,900 tokens/s):
        # waiting passively costs a dedicated machine little. A user's own choice is kept.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    launch = spec.launch
    if launch.gpu_indices:
        by_uuid = len(launch.gpu_uuids) == len(launch.gpu_indices) and launch.rendezvous.nnodes == 1
        names = launch.gpu_uuids if by_uuid else tuple(map(str, launch.gpu_indices))
        env = cuda_device_env(env, names)
    if spec.preset.train.deterministic:  # cuBLAS reads it when CUDA starts: before the workers
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if spec.launch.rendezvous.nnodes == 1:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env["HOMELAB_DP_LOOPBACK"] = (
            "1"  # homelab_dp.supervise.torchrun_agent: TCP stores on 127.0.0.1
        )
    return env


def launch(
    run_dir: Path, *, resume: bool = False, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start torchrun for ``run_dir`` as its spec.json says, in a new session; output goes to
    ``logs/launcher.log``."""
    run_dir = Path(run_dir).absolute()
    spec = read_run_spec(run_dir)
    cmd = torchrun_command(
        run_dir, spec.launch.nproc_per_node, spec.launch.rendezvous, resume=resume
    )
    env = worker_env(spec)
    env.update(extra_env or {})
    logs = run_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    with open(logs / "launcher.log", "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def run_foreground(
    run_dir: Path, *, resume: bool = False, extra_env: dict[str, str] | None = None
) -> int:
    """Launch and wait; returns torchrun's exit code (130 after Ctrl-C, once the run stopped).

    Ctrl-C asks torchrun for a graceful stop (SIGTERM, forwarded to the workers: they agree,
    checkpoint and exit) and waits for it.
    """
    proc = launch(run_dir, resume=resume, extra_env=extra_env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 130
