"""Which replica takes the next request: the least loaded ready one (pure bookkeeping).

The pick is the ready replica with the fewest requests in flight; ties go to the one that has
taken the fewest requests so far, then to the lowest id, so an idle server still spreads
sequential requests over every replica. The counts are per replica id and survive a restart
(the id is the slot, the process behind it may change).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Load:
    """One replica's counts."""

    in_flight: int = 0
    """Requests sent to it and not finished yet."""
    requests: int = 0
    """Requests sent to it in total (retries included: each try counts where it went)."""


class Balancer:
    """Least-in-flight load balancing over replica ids."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.loads: dict[int, Load] = {i: Load() for i in ids}

    def pick(self, ready: Iterable[int]) -> int | None:
        """The replica among ``ready`` that should take the next request; None if none is."""
        candidates = [i for i in ready if i in self.loads]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (self.loads[i].in_flight, self.loads[i].requests, i))

    def begin(self, replica: int) -> None:
        """A request was sent to ``replica``."""
        load = self.loads[replica]
        load.in_flight += 1
        load.requests += 1

    def end(self, replica: int) -> None:
        """A request sent to ``replica`` is over (answered, failed or abandoned)."""
        load = self.loads[replica]
        load.in_flight = max(0, load.in_flight - 1)

    def acquire(self, ready: Iterable[int]) -> int | None:
        """Pick a replica and count the request on it (`pick` then `begin`)."""
        chosen = self.pick(ready)
        if chosen is not None:
            self.begin(chosen)
        return chosen
