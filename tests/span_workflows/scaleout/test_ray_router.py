"""The Ray Serve request router's bookkeeping, fed Ray's notices directly (no cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")


def test_a_request_completed_before_its_routing_notice_leaves_no_load() -> None:
    """Ray runs the done-callback and the routing notice on one event loop, in either order:
    a replica that answers at once must not stay one request heavier."""
    from span_workflows.scaleout.ray_router import RoutedQuery, SpanAffinityRouter

    class Unprobed(SpanAffinityRouter):
        replica_queue_len_cache: dict = {}  # noqa: RUF012 - Ray probed no queue length

    router = object.__new__(Unprobed)
    router.initialize_state()
    pending = SimpleNamespace(args=(RoutedQuery(query_id="q1"),),
                              metadata=SimpleNamespace(internal_request_id="i1"))
    router.on_request_completed("A", "i1")
    router.on_request_routed(pending, "A", None)
    assert router.load_of("A") == 0
    slow = SimpleNamespace(args=(RoutedQuery(query_id="q2"),),
                           metadata=SimpleNamespace(internal_request_id="i2"))
    router.on_request_routed(slow, "A", None)
    assert router.load_of("A") == 1
    router.on_request_completed("A", "i2")
    assert router.load_of("A") == 0
