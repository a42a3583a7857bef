"""The span-affinity policy: map, decay by size, load threshold, dropping replicas."""

from __future__ import annotations

import pytest

from span_workflows.scaleout import AffinityOptions, ReplicaSpanCache, SpanAffinityPolicy, SpanKey


def keys(*names: str, tokens: int = 10) -> list[SpanKey]:
    return [SpanKey(n, tokens) for n in names]


def test_routes_to_the_replica_holding_most_span_tokens_in_any_order() -> None:
    policy = SpanAffinityPolicy(AffinityOptions(capacity_tokens=1000))
    policy.record("r1", keys("a", "b", "c"))
    policy.record("r2", keys("d"))
    # the same documents in another order, plus one new: still r1
    assert policy.choose(keys("c", "x", "a", "b"), {"r1": 0, "r2": 0, "r3": 0}) == "r1"
    # most span *tokens*, not most keys
    policy.record("r3", [SpanKey("big", 500)])
    assert policy.choose([SpanKey("big", 500), *keys("a", "b")],
                         {"r1": 0, "r2": 0, "r3": 0}) == "r3"


def test_a_busy_holder_is_skipped_beyond_the_threshold() -> None:
    policy = SpanAffinityPolicy(AffinityOptions(capacity_tokens=1000, imbalance_threshold=2))
    policy.record("r1", keys("a"))
    assert policy.choose(keys("a"), {"r1": 2, "r2": 0}) == "r1"  # within the threshold
    assert policy.choose(keys("a"), {"r1": 3, "r2": 0}) == "r2"  # beyond: the lightest


def test_without_a_match_the_lightest_replica() -> None:
    policy = SpanAffinityPolicy(AffinityOptions(capacity_tokens=1000))
    assert policy.choose(keys("new"), {"r1": 4, "r2": 1, "r3": 2}) == "r2"


def test_the_map_decays_by_size_like_an_lru_cache() -> None:
    policy = SpanAffinityPolicy(AffinityOptions(capacity_tokens=30))
    policy.record("r1", keys("a", "b", "c"))
    policy.record("r1", keys("a"))  # a is now the most recent
    policy.record("r1", keys("d"))  # over capacity: b, the least recent, is forgotten
    assert policy.held_tokens("r1", keys("a", "b", "c", "d")) == 30
    assert policy.scores(keys("b"), ["r1"]) == {}
    cache = ReplicaSpanCache(15)
    assert cache.add([SpanKey("x", 10), SpanKey("y", 10)]) == ["x"] and cache.tokens == 10


def test_a_dropped_replica_is_forgotten_and_refills() -> None:
    policy = SpanAffinityPolicy(AffinityOptions(capacity_tokens=1000))
    policy.record("r1", keys("a", "b"))
    policy.drop("r1")
    assert policy.scores(keys("a", "b"), ["r1", "r2"]) == {}
    assert policy.choose(keys("a"), {"r2": 0}) == "r2"
    policy.record("r2", keys("a"))
    policy.keep_only(["r2"])
    assert policy.choose(keys("a"), {"r1": 0, "r2": 0}) == "r2"
    policy.keep_only([])
    assert policy.replicas() == []


def test_duplicate_keys_count_once() -> None:
    policy = SpanAffinityPolicy(AffinityOptions(capacity_tokens=1000))
    policy.record("r1", keys("a"))
    assert policy.held_tokens("r1", keys("a", "a")) == 10


@pytest.mark.parametrize("bad", [
    lambda: AffinityOptions(capacity_tokens=0),
    lambda: AffinityOptions(imbalance_threshold=-1),
    lambda: AffinityOptions(min_match_tokens=0),
    lambda: SpanKey("a", 0),
    lambda: SpanAffinityPolicy().choose(keys("a"), {}),
])
def test_bad_input_is_refused(bad) -> None:
    with pytest.raises(ValueError):
        bad()


def test_in_flight_counts_requests_whatever_order_the_notices_come_in() -> None:
    from span_workflows.scaleout.affinity import InFlight

    flight = InFlight()
    flight.routed("q1", "A")
    flight.routed("q2", "A")
    assert flight.load("A") == 2
    flight.completed("q1")
    assert flight.load("A") == 1
    # a replica that answers at once: the completion comes before the routing notice
    flight.completed("q3")
    flight.routed("q3", "B")
    assert flight.load("B") == 0
    flight.completed("q2")
    assert flight.load("A") == 0
    flight.routed("q4", "A")
    flight.drop("A")
    flight.completed("q4")  # the dead replica's request ends: nothing is counted for it
    flight.routed("q5", "A")
    assert flight.load("A") == 1
