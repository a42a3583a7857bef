"""The trace-driven router simulator and the ``bench route --mode sim`` table."""

from __future__ import annotations

import json

import pytest

from span_workflows.apps.bench.route import run_route
from span_workflows.scaleout.affinity import AffinityOptions, SpanKey
from span_workflows.scaleout.simulate import (
    ROUTERS,
    STOCK_ROUTERS,
    LruSpanCache,
    PrefixLruCache,
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


def test_stock_prefix_cache_reads_only_the_same_order() -> None:
    cache = PrefixLruCache(1000)
    first = Query((1, 2, 3), (10, 20, 30))
    assert cache.read(first.prefix_keys()) == 0
    assert cache.read(first.prefix_keys()) == 60
    assert cache.read(Query((1, 2, 4), (10, 20, 5)).prefix_keys()) == 30  # the shared prefix
    assert cache.read(Query((2, 1, 3), (20, 10, 30)).prefix_keys()) == 0  # another order
    assert cache.read(Query((1, 3), (10, 30)).prefix_keys()) == 10  # after a miss: nothing
    small = PrefixLruCache(25)
    small.read(first.prefix_keys())  # 60 tokens in a 25-token cache: only the last stays
    assert small.read(first.prefix_keys()) == 0


def test_bounded_load_spreads_a_hot_document() -> None:
    from span_workflows.scaleout.affinity import SpanAffinityPolicy

    hot = [SpanKey("hot", 100)]
    loads = {r: 0 for r in range(4)}

    def homes(options: AffinityOptions) -> list[int]:
        policy = SpanAffinityPolicy(options, seed=0)
        out = []
        for _ in range(64):
            replica = policy.choose(hot, loads)
            policy.record(replica, hot)
            out.append(replica)
        return out

    unbounded = homes(AffinityOptions(imbalance_threshold=0, max_share=None))
    assert len(set(unbounded)) == 1  # pure affinity: every query on one replica
    bounded = homes(AffinityOptions(imbalance_threshold=0, max_share=1.25,
                                    window_per_replica=4))
    # the bound holds once a window (4 × 4 queries) has been seen: no replica takes more
    # than 1.25 × its share of the later queries (one query of slack per window)
    later = bounded[16:]
    counts = [later.count(r) for r in range(4)]
    assert max(counts) <= 1.25 * len(later) / 4 + len(later) / 16, counts
    assert len(set(later)) >= 3


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
                              else 16, 8000, name=name, stock=name in STOCK_ROUTERS)
               for name in ROUTERS}
    span = results["span-affinity"]
    assert span.hit_rate >= 0.9 * results["single"].hit_rate
    assert span.hit_rate > results["prefix-affinity"].hit_rate
    # stock replicas reuse a document only after the same documents in the same order
    assert span.hit_rate >= 2 * results["stock-prefix-affinity"].hit_rate
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
