"""The load balancer: the least-loaded ready replica, ties by fewest taken, then id."""

from __future__ import annotations

from homelab_dp.serving.front.replica_relay import Balancer


def test_nothing_ready_picks_nothing() -> None:
    b = Balancer(range(2))
    assert b.pick([]) is None
    assert b.acquire([7]) is None  # not one of ours


def test_fewest_in_flight_wins() -> None:
    b = Balancer(range(3))
    b.begin(0)
    b.begin(0)
    b.begin(1)
    assert b.pick([0, 1, 2]) == 2
    assert b.pick([0, 1]) == 1
    b.end(0)
    b.end(0)
    assert b.pick([0, 1]) == 0  # 0 in flight beats 1


def test_ties_go_to_the_one_that_took_fewest_then_the_lowest_id() -> None:
    b = Balancer(range(3))
    assert b.pick([2, 1, 0]) == 0
    b.begin(0)
    b.end(0)
    assert b.pick([0, 1, 2]) == 1
    # Sequential requests on an idle server go round every replica.
    order = []
    for _ in range(6):
        chosen = b.acquire([0, 1, 2])
        order.append(chosen)
        b.end(chosen)
    assert order == [1, 2, 0, 1, 2, 0]


def test_concurrent_requests_spread_evenly_and_counts_add_up() -> None:
    b = Balancer(range(2))
    taken = [b.acquire([0, 1]) for _ in range(8)]
    assert taken.count(0) == taken.count(1) == 4
    assert b.loads[0].in_flight == b.loads[1].in_flight == 4
    for rid in taken:
        b.end(rid)
    assert [(b.loads[i].in_flight, b.loads[i].requests) for i in (0, 1)] == [(0, 4), (0, 4)]


def test_a_replica_not_ready_is_skipped_and_end_never_goes_negative() -> None:
    b = Balancer(range(2))
    for _ in range(3):
        assert b.acquire([1]) == 1
    b.end(0)
    assert b.loads[0].in_flight == 0
    assert b.pick([0, 1]) == 0
