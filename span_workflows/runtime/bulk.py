"""Bulk execution: many span queries at once, ordered so that queries sharing spans run together.

An offline job (a QA set, a backlog, a synthetic data set) sends thousands of span queries whose
documents overlap while the KV cache holds only part of them. Run in arrival order, a document
is evicted and computed again many times; run so that the queries sharing documents are close
together, each is computed about once. This module decides that order; the engines run it.

* **Keys.** Each query is keyed as the router keys it (:class:`~span_workflows.compiler.keys.
  QueryKeyer`: the block keys of its plus spans, the engine's own hash chain, so a document
  retrieved in another order has the same keys) and sized (:class:`BulkItem`: its prompt tokens
  and its *own* tokens, those not in shared spans: question, template, one link block per span).
* **Schedules** (:data:`SCHEDULES`): ``given`` (arrival order), ``random`` (a shuffle, seeded),
  ``cluster`` (greedy temporal clustering, :func:`cluster_items`): a cluster grows from the
  first query not yet placed by adding, one at a time, the query sharing the most span tokens
  with the cluster, while the cluster's *footprint* (its distinct span tokens plus every
  member's own tokens) fits :data:`CLUSTER_FILL` of the KV cache; clusters are then chained so
  that each follows the one it shares the most with (:func:`chain_clusters`). A cluster is the
  unit one engine runs whole (:mod:`span_workflows.scaleout.bulk`); only a single query larger
  than the cache makes a cluster over budget.
* **Windows** (:func:`windows`): the queries run in schedule order, ``max_in_flight`` at a time
  and no more than :data:`WINDOW_FILL` of the cache in prompt tokens; a window's queries run
  together (:func:`span_workflows.runtime.plan.gather`: their requests share engine steps, identical
  prepares run once), and the next window starts when it is done.

The order never changes an answer: each query's plan is the one it runs alone, and a span hit
reads the same KV a fresh computation would (greedy answers equal the individual runs; tested
on the real engine). A bad query fails alone (:class:`~span_workflows.runtime.result.BulkAnswer`
with its error); the others run.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from span_workflows.compiler.keys import SpanKey
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Node
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.query_body import QueryBody, parse_body, request_body
from span_workflows.runtime.result import BulkAnswer, Result

#: The orders a bulk can run in.
SCHEDULES = ("cluster", "given", "random")
DEFAULT_MAX_IN_FLIGHT = 8
#: The share of the KV cache one cluster's footprint may fill (the rest: what the queries of
#: other clusters left, and the engine's own slack).
CLUSTER_FILL = 0.75
#: The share of the KV cache the prompts of one window may fill together (each request holds
#: its whole prompt while it runs; a span placed at two positions at once is copied).
WINDOW_FILL = 0.5

Query = Node | dict | list | str | QueryBody
#: Runs the queries of one window together; one result, or the error it failed with, each.
WindowRunner = Callable[[Sequence[QueryBody]], list[Result | Exception]]


@dataclass(frozen=True, slots=True)
class BulkItem:
    """What the scheduler knows of one query of a bulk: its ``index`` in the input, its span
    keys, its prompt tokens, and its *own* tokens (not in keyed spans, one link block per span
    included: what it adds to the cache apart from the spans it may share)."""

    index: int
    keys: tuple[SpanKey, ...] = ()
    prompt_tokens: int = 0
    own_tokens: int = 0

    @property
    def span_tokens(self) -> int:
        """Tokens in the query's keyed spans."""
        return sum(k.tokens for k in self.keys)


@dataclass(frozen=True)
class BulkSchedule:
    """The order of a bulk: ``clusters`` of input indices, in execution order."""

    schedule: str
    clusters: list[list[int]] = field(default_factory=list)

    @property
    def order(self) -> list[int]:
        """Every scheduled index, in execution order."""
        return [i for c in self.clusters for i in c]


def check_options(schedule: str, max_in_flight: int) -> None:
    """Refuse an unknown schedule or a window size below 1 (:class:`SpanQueryError`)."""
    if schedule not in SCHEDULES:
        raise SpanQueryError("schedule", f"must be one of {', '.join(SCHEDULES)}, not "
                                         f"{schedule!r}")
    if not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1:
        raise SpanQueryError("max_in_flight", f"must be an integer >= 1, not {max_in_flight!r}")


# -- input -------------------------------------------------------------------------------------


def as_queries(queries: Iterable[Query], *, optimize_query: bool = True,
               span_options: SpanOptions | str | dict | None = None,
               cache_salt: str | None = None) -> list[QueryBody | SpanQueryError]:
    """Each query as a :class:`QueryBody` (a tree; its JSON value or text, bare or wrapped;
    or a parsed body as is) with the call's options where the query sets none, or the
    :class:`SpanQueryError` that it is not a valid query."""
    options = None if span_options is None else SpanOptions.coerce(span_options)
    out: list[QueryBody | SpanQueryError] = []
    for query in queries:
        try:
            if isinstance(query, QueryBody):
                out.append(query)
                continue
            if isinstance(query, Node):
                out.append(QueryBody(query, False, optimize_query, options, cache_salt))
                continue
            text = query if isinstance(query, str) else None
            if text is None:
                import json

                text = json.dumps(query)
            body = parse_body(text.encode())
            out.append(QueryBody(
                body.node, False, body.optimize and optimize_query,
                body.span_options if body.span_options is not None else options,
                body.cache_salt if body.cache_salt is not None else cache_salt))
        except SpanQueryError as exc:
            out.append(exc)
        except (RecursionError, MemoryError, TypeError, ValueError) as exc:
            out.append(SpanQueryError("", f"not a span query ({type(exc).__name__}: {exc})"))
    return out


def key_items(queries: Sequence[QueryBody | SpanQueryError], keyer: Any,
              default_options: SpanOptions | None = None) -> list[BulkItem]:
    """The :class:`BulkItem` of every valid query (``keyer``: a
    :class:`~span_workflows.compiler.keys.QueryKeyer` for the engines' block size)."""
    items = []
    for index, query in enumerate(queries):
        if isinstance(query, SpanQueryError):
            continue
        route = keyer.route(query.node, optimize_query=query.optimize,
                            span_options=query.span_options or default_options,
                            cache_salt=query.cache_salt)
        span_tokens = sum(k.tokens for k in route.keys)
        own = max(0, route.prompt_tokens - span_tokens) + keyer.block_size * route.spans
        items.append(BulkItem(index, tuple(route.keys), route.prompt_tokens, own))
    return items


# -- schedules ---------------------------------------------------------------------------------


def schedule_items(items: Sequence[BulkItem], schedule: str, cache_tokens: int, *,
                   seed: int = 0, fill: float = CLUSTER_FILL) -> BulkSchedule:
    """The order of ``items`` under ``schedule``; every schedule is cut into clusters whose
    footprint fits ``fill`` of ``cache_tokens`` (for ``given`` and ``random``: consecutive
    pieces of their order)."""
    check_options(schedule, 1)
    if cache_tokens <= 0:
        raise ValueError(f"cache_tokens must be positive, not {cache_tokens}")
    budget = max(1, int(fill * cache_tokens))
    if schedule == "cluster":
        return BulkSchedule(schedule, chain_clusters(cluster_items(items, budget), items))
    order = list(items)
    if schedule == "random":
        random.Random(seed).shuffle(order)
    return BulkSchedule(schedule, chunk(order, budget))


def footprint(members: Iterable[BulkItem]) -> int:
    """Tokens ``members`` hold in the cache while they run: their distinct span tokens and
    each one's own tokens."""
    seen: dict[Any, int] = {}
    own = 0
    for item in members:
        own += item.own_tokens
        for k in item.keys:
            seen[k.key] = k.tokens
    return own + sum(seen.values())


def chunk(order: Sequence[BulkItem], budget: int) -> list[list[int]]:
    """``order`` cut into consecutive pieces whose footprint fits ``budget`` (a query larger
    than the budget alone)."""
    pieces: list[list[int]] = []
    current: list[int] = []
    seen: set[Any] = set()
    used = 0
    for item in order:
        extra = item.own_tokens + sum(k.tokens for k in set(item.keys) if k.key not in seen)
        if current and used + extra > budget:
            pieces.append(current)
            current, seen, used = [], set(), 0
            extra = item.own_tokens + sum(k.tokens for k in set(item.keys))
        current.append(item.index)
        seen.update(k.key for k in item.keys)
        used += extra
    if current:
        pieces.append(current)
    return pieces


def cluster_items(items: Sequence[BulkItem], budget: int) -> list[list[int]]:
    """Greedy temporal clustering (see the module docstring): clusters of input indices, each
    in the order its members were added, seeded in arrival order."""
    pool = _KeyPool(items)
    clusters: list[list[int]] = []
    for start in range(len(items)):
        if not pool.placed[start]:
            clusters.append([items[p].index for p in pool.grow(start, budget)])
    return clusters


class _KeyPool:
    """The queries of a bulk by span key, for growing clusters (positions in ``items``)."""

    def __init__(self, items: Sequence[BulkItem]) -> None:
        self.items = items
        self.tokens: dict[Any, int] = {}
        self.holders: dict[Any, list[int]] = {}
        self.keys: list[tuple[Any, ...]] = []
        for p, item in enumerate(items):
            keys = tuple(dict.fromkeys(k.key for k in item.keys))
            self.keys.append(keys)
            for k in item.keys:
                self.tokens[k.key] = k.tokens
            for key in keys:
                self.holders.setdefault(key, []).append(p)
        self.placed = [False] * len(items)

    def grow(self, start: int, budget: int) -> list[int]:
        """A cluster from ``start``: add the unplaced query sharing the most span tokens with
        the cluster (ties: the earliest) while the footprint fits ``budget``."""
        self.placed[start] = True
        members = [start]
        union: set[Any] = set(self.keys[start])
        used = self.items[start].own_tokens + sum(self.tokens[k] for k in union)
        score: dict[int, int] = {}
        heap: list[tuple[int, int]] = []
        self._share(union, score, heap)
        too_big: set[int] = set()
        while heap:
            negative, q = heapq.heappop(heap)
            if self.placed[q] or q in too_big or -negative != score[q]:
                continue
            new = [k for k in self.keys[q] if k not in union]
            extra = self.items[q].own_tokens + sum(self.tokens[k] for k in new)
            if used + extra > budget:  # the union only grows: it will not fit later either
                too_big.add(q)
                continue
            self.placed[q] = True
            members.append(q)
            union.update(new)
            used += extra
            self._share(new, score, heap)
        return members

    def _share(self, new_keys: Iterable[Any], score: dict[int, int],
               heap: list[tuple[int, int]]) -> None:
        """Credit every unplaced holder of ``new_keys`` with their tokens."""
        for key in new_keys:
            for q in self.holders[key]:
                if not self.placed[q]:
                    score[q] = score.get(q, 0) + self.tokens[key]
                    heapq.heappush(heap, (-score[q], q))


def chain_clusters(clusters: list[list[int]], items: Sequence[BulkItem]) -> list[list[int]]:
    """``clusters`` reordered so that each follows the one it shares the most span tokens with
    (starting from the first; ties in the given order): what one cluster leaves in the cache,
    the next reads."""
    if len(clusters) <= 2:
        return clusters
    by_index = {item.index: item for item in items}
    keysets: list[dict[Any, int]] = []
    for cluster in clusters:
        keys: dict[Any, int] = {}
        for i in cluster:
            for k in by_index[i].keys:
                keys[k.key] = k.tokens
        keysets.append(keys)
    left = list(range(1, len(clusters)))
    chain = [0]
    while left:
        last = keysets[chain[-1]]
        best = max(left, key=lambda c: (sum(t for k, t in keysets[c].items() if k in last), -c))
        left.remove(best)
        chain.append(best)
    return [clusters[c] for c in chain]


def windows(order: Sequence[int], items: Sequence[BulkItem], max_in_flight: int,
            cache_tokens: int, fill: float = WINDOW_FILL) -> list[list[int]]:
    """``order`` cut into consecutive windows of at most ``max_in_flight`` queries whose prompt
    tokens fit ``fill`` of ``cache_tokens`` together (a larger query alone)."""
    sizes = {item.index: item.prompt_tokens for item in items}
    budget = fill * cache_tokens
    out: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in order:
        size = sizes.get(index, 0)
        if current and (len(current) >= max_in_flight or used + size > budget):
            out.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        out.append(current)
    return out


# -- running -----------------------------------------------------------------------------------


def run_bulk(queries: Sequence[QueryBody | SpanQueryError], keyer: Any, cache_tokens: int,
             runner: WindowRunner, *, schedule: str = "cluster",
             max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, seed: int = 0,
             default_options: SpanOptions | None = None) -> Iterator[BulkAnswer]:
    """Key, schedule and run ``queries`` window by window with ``runner``; the answers as
    each window ends (the invalid queries' first), in execution order."""
    check_options(schedule, max_in_flight)
    for index, query in enumerate(queries):
        if isinstance(query, SpanQueryError):
            yield BulkAnswer(index, error=query)
    items = key_items(queries, keyer, default_options)
    plan = schedule_items(items, schedule, cache_tokens, seed=seed)
    for window in windows(plan.order, items, max_in_flight, cache_tokens):
        batch = [queries[i] for i in window]
        for index, outcome in zip(window, run_window(runner, batch), strict=True):
            yield (BulkAnswer(index, error=outcome) if isinstance(outcome, Exception)
                   else BulkAnswer(index, result=outcome))


def run_window(runner: WindowRunner, batch: Sequence[QueryBody]) -> list[Result | Exception]:
    """``runner(batch)``; if the window fails as a whole (an error outside any one query's
    plan, e.g. the engine refusing a request), each query once more alone, so that only the
    failing one fails."""
    try:
        return runner(batch)
    except Exception as exc:  # noqa: BLE001 - reported per query
        if len(batch) == 1:
            return [exc]
    out: list[Result | Exception] = []
    for query in batch:
        try:
            out.extend(runner([query]))
        except Exception as exc:  # noqa: BLE001 - this query's answer
            out.append(exc)
    return out


def in_input_order(answers: Iterable[BulkAnswer], count: int) -> list[BulkAnswer]:
    """``answers`` sorted by index; every index in ``range(count)`` exactly once."""
    by_index = {a.index: a for a in answers}
    missing = [i for i in range(count) if i not in by_index]
    if missing or len(by_index) != count:
        raise RuntimeError(f"bulk answers missing for indices {missing[:10]}")
    return [by_index[i] for i in range(count)]


def query_line(query: QueryBody) -> str:
    """``query`` as one JSON line (wrapped, with its options), e.g. to send it elsewhere."""
    import json

    body = request_body(query.node, stream=False, optimize_query=query.optimize,
                        span_options=query.span_options, cache_salt=query.cache_salt)
    del body["stream"]
    return json.dumps(body, ensure_ascii=False)


__all__ = [
    "CLUSTER_FILL", "DEFAULT_MAX_IN_FLIGHT", "SCHEDULES", "WINDOW_FILL", "BulkItem",
    "BulkSchedule", "as_queries", "chain_clusters", "check_options", "chunk", "cluster_items",
    "footprint", "in_input_order", "key_items", "query_line", "run_bulk", "run_window",
    "schedule_items", "windows",
]
