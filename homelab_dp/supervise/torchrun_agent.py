"""torchrun, with its TCP stores listening on the loopback interface only (single-node runs).

``python -m homelab_dp.supervise.torchrun_agent TORCHRUN-ARGS…`` runs torchrun's own ``main`` unchanged. With
``HOMELAB_DP_LOOPBACK=1`` in the environment (the launcher sets it for single-node runs) every
TCPStore server the agent starts — the c10d rendezvous store and the store it shares with its
workers — listens on 127.0.0.1 instead of every interface: torch's TCPStore binds its server to
all interfaces ("::") whatever host it is given, so this module binds the listening socket
itself and hands it over (``master_listen_fd``, a documented TCPStore argument). Nothing on the
network can then reach an unauthenticated store of a run that is meant to stay on this machine.

Port 0 asks the kernel for a free port at bind time, so two runs started at once never race for
one (no "find a free port, release it, bind it later" window).
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any

LOOPBACK_ENV = "HOMELAB_DP_LOOPBACK"
LOOPBACK = "127.0.0.1"


def _loopback_store_class() -> type:
    import torch.distributed as dist

    base = dist.TCPStore

    class LoopbackTCPStore(base):  # type: ignore[misc, valid-type]
        """A TCPStore whose server socket is bound to 127.0.0.1 (clients are unchanged)."""

        _listening: dict[int, socket.socket] = {}  # port -> socket; keeps the fds open

        def __init__(
            self,
            host_name: str,
            port: int,
            world_size: int | None = None,
            is_master: bool = False,
            timeout: timedelta = timedelta(seconds=300),
            wait_for_workers: bool = True,
            multi_tenant: bool = False,
            master_listen_fd: int | None = None,
            use_libuv: bool = True,
        ) -> None:
            # A multi-tenant store on a port this process already serves reuses that server.
            if is_master and master_listen_fd is None and port not in self._listening:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((LOOPBACK, port))
                except OSError as exc:
                    sock.close()
                    # torch's own wording, so torchrun's callers recognise a taken port.
                    raise RuntimeError(
                        f"{LOOPBACK}:{port}: address already in use ({exc})"
                    ) from exc
                sock.listen(2048)
                port = sock.getsockname()[1]
                self._listening[port] = sock
                master_listen_fd = sock.fileno()
            kwargs: dict[str, Any] = {
                "world_size": world_size, "is_master": is_master, "timeout": timeout,
                "wait_for_workers": wait_for_workers, "multi_tenant": multi_tenant,
                "master_listen_fd": master_listen_fd, "use_libuv": use_libuv,
            }  # fmt: skip
            super().__init__(host_name, port, **kwargs)

    return LoopbackTCPStore


def install_loopback_stores() -> None:
    """Make every TCPStore this process creates listen on 127.0.0.1 only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    store = _loopback_store_class()
    dist.TCPStore = store  # the dynamic rendezvous's shared store looks it up here
    c10d_rendezvous_backend.TCPStore = store  # the rendezvous store imported it by name


def main(argv: list[str] | None = None) -> None:
    """Run torchrun with ``argv`` (default: this process's arguments)."""
    if os.environ.get(LOOPBACK_ENV) == "1":
        install_loopback_stores()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
