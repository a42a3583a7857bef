"""The bulk scheduler without an engine: clusters that fit the cache, windows, schedules, errors
that stay with their query, and (against an LRU model of the cache) that clustering computes
less than arrival order when the working set exceeds the cache."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from span_workflows.compiler.keys import SpanKey
from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import rag
from span_workflows.runtime import bulk
from span_workflows.runtime.bulk import BulkItem, chunk, cluster_items, footprint, windows
from span_workflows.runtime.plan import Output, Request, guarded, share_prepares
from span_workflows.runtime.result import BulkAnswer, Metrics, Result
from span_workflows.serving import wire
from span_workflows.serving.wire import QueryBody

BLOCK = 32


def item(index: int, docs: list[int], blocks: int = 4, own: int = 64) -> BulkItem:
    keys = tuple(SpanKey((d, b), BLOCK) for d in docs for b in range(blocks))
    return BulkItem(index, keys, len(keys) * BLOCK + own, own)


def topical_items(count: int, topics: int, seed: int = 0) -> list[BulkItem]:
    """Queries of 5 documents: 4 from their topic's 8, one from anywhere; topics in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        t = rng.randrange(topics)
        docs = rng.sample(range(8 * t, 8 * t + 8), 4)
        docs.append(rng.choice([d for d in range(8 * topics) if d not in docs]))
        out.append(item(i, docs))
    return out


def test_clusters_hold_every_query_once_and_fit_the_budget() -> None:
    items = topical_items(60, topics=6)
    budget = 2048
    clusters = cluster_items(items, budget)
    assert sorted(i for c in clusters for i in c) == list(range(60))
    by_index = {it.index: it for it in items}
    for c in clusters:
        assert footprint(by_index[i] for i in c) <= budget
    # a cluster is mostly one topic: its members share documents
    assert len(clusters) < 30


def test_a_query_larger_than_the_budget_is_a_cluster_of_its_own() -> None:
    items = [item(0, [1, 2]), item(1, list(range(10, 40))), item(2, [1, 3])]
    clusters = cluster_items(items, budget=1024)
    assert [1] in clusters
    assert [0, 2] in clusters  # they share document 1


def test_given_keeps_the_order_and_random_is_a_seeded_permutation() -> None:
    items = topical_items(30, topics=3)
    given = bulk.schedule_items(items, "given", 4096)
    assert given.order == list(range(30))
    shuffled = bulk.schedule_items(items, "random", 4096, seed=1)
    assert sorted(shuffled.order) == list(range(30)) and shuffled.order != given.order
    assert bulk.schedule_items(items, "random", 4096, seed=1).order == shuffled.order
    by_index = {it.index: it for it in items}
    for piece in given.clusters:  # consecutive pieces, each within the cluster budget
        assert footprint(by_index[i] for i in piece) <= bulk.CLUSTER_FILL * 4096 or \
            len(piece) == 1


def test_unknown_schedules_and_window_sizes_are_refused() -> None:
    with pytest.raises(SpanQueryError, match="schedule"):
        bulk.check_options("fastest", 4)
    with pytest.raises(SpanQueryError, match="max_in_flight"):
        bulk.check_options("cluster", 0)


def test_windows_respect_the_count_and_half_the_cache() -> None:
    items = [BulkItem(i, (), prompt_tokens=300) for i in range(10)]
    assert windows(range(10), items, 4, cache_tokens=10_000) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                  [8, 9]]
    # 1000 tokens of cache: at most 500 in flight, so one query of 300 at a time
    assert windows([3, 1, 2], items, 8, cache_tokens=1000) == [[3], [1], [2]]
    big = [BulkItem(0, (), prompt_tokens=5000), BulkItem(1, (), prompt_tokens=10)]
    assert windows([0, 1], big, 8, cache_tokens=1000) == [[0], [1]]  # alone, never dropped


def test_chunks_are_consecutive_and_fit() -> None:
    items = [item(i, [i % 3]) for i in range(9)]
    pieces = chunk(items, budget=3 * 4 * BLOCK + 3 * 64)
    assert [i for p in pieces for i in p] == list(range(9))
    assert all(len(p) >= 3 for p in pieces[:-1])


def _lru_computed(order: list[int], items: list[BulkItem], cache: int) -> int:
    """Tokens an LRU cache of ``cache`` tokens computes serving ``order`` one by one."""
    lru: OrderedDict = OrderedDict()
    used = computed = 0
    by_index = {it.index: it for it in items}
    for index in order:
        it = by_index[index]
        for k in it.keys:
            if k.key in lru:
                lru.move_to_end(k.key)
            else:
                lru[k.key] = k.tokens
                used += k.tokens
                computed += k.tokens
        lru[("own", index)] = it.own_tokens
        used += it.own_tokens
        computed += it.own_tokens
        while used > cache:
            used -= lru.popitem(last=False)[1]
    return computed


def test_clustering_computes_less_than_arrival_order_when_the_documents_do_not_fit() -> None:
    items = topical_items(120, topics=12)  # 96 documents of 128 tokens: 12288 tokens
    cache = 3072  # a quarter of the working set
    cost = {s: _lru_computed(bulk.schedule_items(items, s, cache).order, items, cache)
            for s in bulk.SCHEDULES}
    assert cost["cluster"] * 1.4 < cost["given"]
    assert cost["cluster"] * 1.4 < cost["random"]
    # when everything fits, clustering is no worse than arrival order
    few = topical_items(40, topics=1)
    fits = {s: _lru_computed(bulk.schedule_items(few, s, 8192).order, few, 8192)
            for s in ("given", "cluster")}
    assert fits["cluster"] <= fits["given"]


# -- running ------------------------------------------------------------------------------------


def result(text: str) -> Result:
    return Result(text, Metrics(0.0, 10, 4, 1))


class FakeKeyer:
    """Keys a query by the documents of its plus (one key each)."""

    block_size = BLOCK

    def route(self, node, **_):
        from span_workflows.compiler.keys import QueryRoute
        from span_workflows.query.ir import Fragment, iter_nodes

        docs = [n.text for n in iter_nodes(node) if isinstance(n, Fragment)]
        return QueryRoute(tuple(SpanKey(d, 64) for d in docs), "", 64 * len(docs) + 40,
                          len(docs))


def test_run_bulk_answers_every_query_once_and_keeps_errors_apart() -> None:
    queries = bulk.as_queries([
        rag("s", ["a", "b"], "q0"), "{not json", rag("s", ["c"], "q2"),
        {"g": {"input": [{"user": "x"}], "max_tokens": "many"}}, rag("s", ["a"], "q4")])
    assert isinstance(queries[1], SpanQueryError) and isinstance(queries[3], SpanQueryError)
    seen: list[list[str]] = []

    def runner(batch: list[QueryBody]) -> list:
        seen.append([q.node.input.children[-1].text for q in batch])  # type: ignore[union-attr]
        return [result(t) for t in seen[-1]]

    answers = list(bulk.run_bulk(queries, FakeKeyer(), 10_000, runner, max_in_flight=2))
    ordered = bulk.in_input_order(answers, 5)
    assert [a.ok for a in ordered] == [True, False, True, False, True]
    assert [a.result.text for a in ordered if a.ok] == ["q0", "q2", "q4"]
    # clustered: the two queries reading "a" run together, the other after them
    assert seen == [["q0", "q4"], ["q2"]]


def test_a_window_that_fails_as_a_whole_is_run_query_by_query() -> None:
    def runner(batch: list) -> list:
        if any(q == "bad" for q in batch):
            raise RuntimeError("the engine refused a request")
        return [result(q) for q in batch]

    out = bulk.run_window(runner, ["x", "bad", "y"])
    assert [o.text if isinstance(o, Result) else "error" for o in out] == ["x", "error", "y"]
    assert "refused" in str(out[1])


def test_queries_are_taken_as_trees_json_and_wrapped_lines() -> None:
    tree = rag("s", ["a"], "q")
    wrapped = wire.bulk_line(tree, cache_salt="tenant")
    parsed = bulk.as_queries([tree, wire.bulk_line(tree), wrapped, "[1, 2]"],
                             cache_salt="call")
    assert parsed[0].cache_salt == "call" and parsed[1].cache_salt == "call"
    assert parsed[2].cache_salt == "tenant"  # the line's own option wins
    assert parsed[0].node == parsed[1].node == tree
    assert isinstance(parsed[3], SpanQueryError)


def test_bulk_lines_round_trip() -> None:
    body = wire.bulk_body([rag("s", ["a"], "q"), "{broken"], span_options="self")
    lines = body.decode().splitlines()
    assert len(lines) == 2 and lines[1] == "{broken"
    parsed = wire.parse_bulk_body(body + b"\n\n")
    assert parsed[0].span_options.attend == "self" and isinstance(parsed[1], SpanQueryError)
    ok = wire.parse_bulk_answer(wire.bulk_answer(BulkAnswer(3, result=result("hi"))))
    assert ok.index == 3 and ok.result.text == "hi" and ok.result.metrics.cached_tokens == 4
    bad = wire.parse_bulk_answer(wire.bulk_answer(
        BulkAnswer(4, error=SpanQueryError("input.cross[1]", "unknown node 'x'"))))
    assert isinstance(bad.error, SpanQueryError) and bad.error.path == "input.cross[1]"
    assert bad.error.message == "unknown node 'x'"
    with pytest.raises(ValueError):
        BulkAnswer(0)


def test_identical_prepares_of_one_batch_run_once() -> None:
    ran: list[list[int]] = []

    def run(requests: list[Request]) -> list[Output]:
        ran.extend(list(r.prompt) for r in requests)
        return [Output([""], [[0]], len(r.prompt), 0, 0.0, 0.0, 0.0) for r in requests]

    shared = share_prepares(run)
    a, b = Request([1, 2, 3], 1, 0.0), Request([1, 2, 3], 1, 0.0)
    answer = Request([1, 2, 3], 8, 0.0, part=0)
    outs = shared([a, answer, b, Request([4], 1, 0.0)])
    assert ran == [[1, 2, 3], [1, 2, 3], [4]]  # the answer is not a prepare: it runs
    assert outs[0].cached_tokens == 0 and outs[2].cached_tokens == 3  # b computed nothing
    assert len(outs) == 4


def test_a_guarded_plan_returns_its_error() -> None:
    def plan():
        yield [Request([1], 1, 0.0)]
        raise SpanQueryError("input", "too long")

    g = guarded(plan())
    assert isinstance(next(g), list)
    with pytest.raises(StopIteration) as stop:
        g.send([None])
    assert isinstance(stop.value.value, SpanQueryError)
