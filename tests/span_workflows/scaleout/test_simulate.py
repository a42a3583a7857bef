"""The trace-driven router simulator and the ``bench route --mode sim`` table."""

from __future__ import annotations

import json

import pytest

from span_workflows.apps.bench_route import run_route
from span_workflows.scaleout.affinity import AffinityOptions, SpanKey
from span_workflows.scaleout.simulate import (
    ROUTERS,
    LruSpanCache,
    PrefixSimRouter,
    Query,
    TraceOptions,
    make_router,
    make_trace,
    simulate,
)


def test_trace_is_reproducible_skewed_and_shuffled() -> None:
    options = TraceOptions(requests=400, documents=50, k=4, seed=3)
    trace = make_trace(options)
    assert trace == make_trace(options)
    assert all(len(set(q.docs)) == 4 for q in trace)
    counts = [0] * 50
    for q in trace:
        for d in q.docs:
            counts[d] += 1
    assert counts[0] > 3 * counts[40]  # Zipf: the most popular far above the tail
    assert any(list(q.docs) != sorted(q.docs) for q in trace)


def test_lru_cache_hits_and_evicts() -> None:
    cache = LruSpanCache(25)
    assert cache.read([SpanKey("a", 10), SpanKey("b", 10)]) == 0
    assert cache.read([SpanKey("a", 10)]) == 10
    cache.read([SpanKey("c", 10)])  # evicts b (least recent)
    assert cache.read([SpanKey("b", 10)]) == 0


def test_prefix_model_matches_order_not_content() -> None:
    router = PrefixSimRouter(system_tokens=2, question_tokens=4)
    q1 = Query((1, 2, 3), (10, 10, 10))
    router.routed(q1, 0)
    router.routed(Query((7, 8, 9), (10, 10, 10)), 1)
    assert router.choose(Query((1, 2, 3), (10, 10, 10)), {0: 0, 1: 0}) == 0
    # the same documents in another order match only the system prompt (< 10 %): replica 0
    # is not preferred; the smaller tree wins
    router.routed(Query((5,), (10,)), 1)
    assert router.choose(Query((3, 2, 1), (10, 10, 10)), {0: 0, 1: 0}) == 0
    router.routed(Query((4, 6), (50, 50)), 0)
    assert router.choose(Query((3, 2, 1), (10, 10, 10)), {0: 0, 1: 0}) == 1


def test_span_affinity_beats_the_others_at_scale() -> None:
    options = TraceOptions(requests=1500, documents=300, k=4, seed=1)
    trace = make_trace(options)
    affinity = AffinityOptions(capacity_tokens=8000, imbalance_threshold=0)
    results = {name: simulate(trace, make_router(name, options, affinity), 1 if name == "single"
                              else 16, 8000, name=name) for name in ROUTERS}
    span = results["span-affinity"]
    assert span.hit_rate >= 0.9 * results["single"].hit_rate
    assert span.hit_rate > results["prefix-affinity"].hit_rate
    assert span.hit_rate > results["power-of-two"].hit_rate
    assert span.max_load_ratio <= 1.5
    assert sum(span.per_replica) == 1500 and len(span.per_replica) == 16


def test_bad_simulation_input_is_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        simulate(make_trace(TraceOptions(requests=5)), make_router(
            "power-of-two", TraceOptions(), AffinityOptions()), 0, 100)
    with pytest.raises(ValueError, match="unknown router"):
        make_router("round-robin", TraceOptions(), AffinityOptions())
    with pytest.raises(ValueError, match="k must"):
        TraceOptions(documents=3, k=4)


def test_bench_route_sim_writes_json_markdown_and_plot(tmp_path) -> None:
    assert run_route(["--mode", "sim", "--replicas", "2,4", "--requests", "300",
                      "--documents", "60", "--cache-tokens", "3000", "--out",
                      str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "route.json").read_text())
    assert {r["router"] for r in rows} == set(ROUTERS)
    assert {"mode", "router", "replicas", "requests", "hit_rate", "single_node_hit_rate",
            "p50_ttft_s", "p95_ttft_s", "max_load_ratio"} <= set(rows[0])
    assert all(r["mode"] == "sim" and 0 <= r["hit_rate"] <= 1 for r in rows)
    assert "| sim | 4 | span-affinity |" in (tmp_path / "route.md").read_text()
    assert (tmp_path / "route.png").stat().st_size > 1000
