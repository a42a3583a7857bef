"""Trace-driven simulation of span routing over N replicas.

A trace (:func:`make_trace`) is a stream of RAG queries over a shared pool of documents: each
query retrieves ``k`` documents drawn with a Zipf-skewed popularity, in a random order, after a
shared system prompt and before its own question. Each replica is modeled by an LRU cache of
span KV of a fixed size in tokens (:class:`LruSpanCache`: a document read from the cache is a
hit, one not there is computed and cached, the least recently used leave first) and by one FIFO
server whose time per request is :class:`CostModel`'s (prefill of the missed tokens, a small
cost per cached token, a fixed decode time).

The routers (:class:`SimRouter`) are the ones compared by ``span-workflows bench route``:

* ``span-affinity`` — :class:`~span_workflows.scaleout.affinity.SpanAffinityPolicy`, the same
  code the Ray Serve router runs (keys: one per document, its token count);
* ``prefix-affinity`` — a model of Ray Serve LLM's ``PrefixCacheAffinityRouter`` with its
  defaults: the replicas whose prompt tree matches the longest prefix of the prompt text, if
  the match covers at least 10 % of it, else the replicas with the smallest trees; the least
  loaded of those (no load threshold, no tree eviction: Ray's defaults);
* ``power-of-two`` — two replicas at random, the less loaded;
* ``single`` — one replica (the reference: the same trace on one node);
* ``stock-prefix-affinity`` — what a cluster of stock vLLM replicas gets today: the prefix
  router in front of replicas with vLLM's own prefix cache (:class:`PrefixLruCache`: a
  document is read from the cache only when every document before it, in this order, was too).

Every other router runs against the same span-cache replicas: they differ only in where
queries go.
"""

from __future__ import annotations

import bisect
import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from span_workflows.scaleout.affinity import AffinityOptions, SpanAffinityPolicy, SpanKey

ROUTERS = ("span-affinity", "prefix-affinity", "power-of-two", "single",
           "stock-prefix-affinity")
#: The replicas' cache model of each router (the others: span caches).
STOCK_ROUTERS = frozenset({"stock-prefix-affinity"})


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """Shape of a synthetic RAG trace (all sizes in tokens)."""

    requests: int = 4000
    documents: int = 1000
    k: int = 5
    zipf_s: float = 0.9
    doc_tokens: tuple[int, int] = (128, 384)
    system_tokens: int = 64
    question_tokens: int = 32
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.documents < 1:
            raise ValueError("a trace needs at least one request and one document")
        if not 1 <= self.k <= self.documents:
            raise ValueError(f"k must be in 1..documents ({self.documents}), not {self.k}")
        lo, hi = self.doc_tokens
        if not 0 < lo <= hi:
            raise ValueError(f"doc_tokens must be 0 < low <= high, not {self.doc_tokens}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, not {self.zipf_s}")


@dataclass(frozen=True, slots=True)
class Query:
    """One query of a trace: its documents in prompt order and their sizes."""

    docs: tuple[int, ...]
    doc_tokens: tuple[int, ...]
    arrival_s: float = 0.0

    @property
    def span_tokens(self) -> int:
        """Tokens in the query's documents (its plus spans)."""
        return sum(self.doc_tokens)

    def span_keys(self) -> list[SpanKey]:
        """The query's span keys (one per document)."""
        return [SpanKey(("doc", d), n) for d, n in zip(self.docs, self.doc_tokens, strict=True)]

    def prefix_keys(self) -> list[SpanKey]:
        """The query's keys in a prefix cache: document ``j`` is named by every document up
        to it, in order (vLLM's block hash chain, one piece per document)."""
        return [SpanKey(("prefix", *self.docs[:j + 1]), n)
                for j, n in enumerate(self.doc_tokens)]


def make_trace(options: TraceOptions) -> list[Query]:
    """The queries of a trace (arrival times unset: see :func:`simulate`), reproducible from
    ``options.seed``."""
    rng = random.Random(options.seed)
    lo, hi = options.doc_tokens
    sizes = [rng.randint(lo, hi) for _ in range(options.documents)]
    weights = [1.0 / (rank + 1) ** options.zipf_s for rank in range(options.documents)]
    cumulative = []
    total = 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    queries = []
    for _ in range(options.requests):
        picked: list[int] = []
        while len(picked) < options.k:
            d = bisect.bisect_left(cumulative, rng.random() * total)
            d = min(d, options.documents - 1)
            if d not in picked:
                picked.append(d)
        if options.shuffle:
            rng.shuffle(picked)
        else:
            picked.sort()
        queries.append(Query(tuple(picked), tuple(sizes[d] for d in picked)))
    return queries


@dataclass
class LruSpanCache:
    """The span KV cache of one replica, by document: LRU, ``capacity_tokens`` in all."""

    capacity_tokens: int
    entries: OrderedDict[object, int] = field(default_factory=OrderedDict)
    tokens: int = 0
    #: keys chain (a prefix cache): nothing after the first key not cached is read from it
    chained: ClassVar[bool] = False

    def read(self, keys: Sequence[SpanKey]) -> int:
        """Serve a query reading ``keys``: return the tokens found cached; cache the rest."""
        hit = 0
        missed = False
        for k in keys:
            if k.key in self.entries:
                self.entries.move_to_end(k.key)
                if not (self.chained and missed):
                    hit += k.tokens
                    continue
            else:
                self.entries[k.key] = k.tokens
                self.tokens += k.tokens
            missed = True
        while self.tokens > self.capacity_tokens and self.entries:
            _, size = self.entries.popitem(last=False)
            self.tokens -= size
        return hit


@dataclass
class PrefixLruCache(LruSpanCache):
    """A stock prefix cache over :meth:`Query.prefix_keys`: reading stops at the first key
    not cached (what follows a miss is computed again, as in vLLM, whose block hashes
    chain)."""

    chained: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time a replica spends per request: ``prefill_s_per_token`` per prompt token not in the
    cache, ``hit_s_per_token`` per cached span token (repositioning), ``decode_s`` after the
    first token. ``utilization``: arrival rate per replica as a share of what one replica
    serves when nothing is cached."""

    prefill_s_per_token: float = 5e-5
    hit_s_per_token: float = 2e-6
    decode_s: float = 0.05
    utilization: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.utilization < 1:
            raise ValueError(f"utilization must be in (0, 1), not {self.utilization}")


class SimRouter(Protocol):
    """What the simulator asks of a router."""

    def choose(self, query: Query, loads: Mapping[int, int]) -> int:
        """The replica for ``query`` given each replica's requests in flight."""

    def routed(self, query: Query, replica: int) -> None:
        """``query`` was sent to ``replica``."""


class AffinitySimRouter:
    """:class:`SpanAffinityPolicy` over document keys."""

    def __init__(self, options: AffinityOptions, seed: int = 0) -> None:
        self.policy = SpanAffinityPolicy(options, seed=seed)

    def choose(self, query: Query, loads: Mapping[int, int]) -> int:
        return self.policy.choose(query.span_keys(), loads)

    def routed(self, query: Query, replica: int) -> None:
        self.policy.record(replica, query.span_keys())


class PrefixSimRouter:
    """A model of Ray Serve LLM's ``PrefixCacheAffinityRouter`` (defaults: match-rate
    threshold 0.1, no load threshold, no eviction): prompts are sequences of pieces (system
    prompt, documents in order, the query's own question), a piece's length in tokens standing
    for its characters."""

    def __init__(self, system_tokens: int, question_tokens: int,
                 match_rate_threshold: float = 0.1, seed: int = 0) -> None:
        self.system_tokens = system_tokens
        self.question_tokens = question_tokens
        self.match_rate_threshold = match_rate_threshold
        self._holders: dict[tuple[int, ...], set[int]] = {}
        self._size: dict[int, int] = {}
        self._rng = random.Random(seed)

    def choose(self, query: Query, loads: Mapping[int, int]) -> int:
        total = self.system_tokens + query.span_tokens + self.question_tokens
        for replica in loads:
            self._size.setdefault(replica, 0)
        matched, tenants = 0, set()
        root = self._holders.get((), set()) & set(loads)
        if root:
            matched, tenants = self.system_tokens, root
            for j in range(1, len(query.docs) + 1):
                holders = self._holders.get(query.docs[:j], set()) & tenants
                if not holders:
                    break
                matched += query.doc_tokens[j - 1]
                tenants = holders
        if matched / total < self.match_rate_threshold:
            smallest = min(self._size[r] for r in loads)
            tenants = {r for r in loads if self._size[r] == smallest}
        low = min(loads[r] for r in tenants)
        best = sorted(r for r in tenants if loads[r] == low)
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def routed(self, query: Query, replica: int) -> None:
        prefixes = [query.docs[:j] for j in range(len(query.docs) + 1)]
        sizes = [self.system_tokens, *query.doc_tokens]
        for prefix, size in zip(prefixes, sizes, strict=True):
            holders = self._holders.setdefault(prefix, set())
            if replica not in holders:
                holders.add(replica)
                self._size[replica] = self._size.get(replica, 0) + size
        # the question is unique to the query: it always adds a new leaf
        self._size[replica] = self._size.get(replica, 0) + self.question_tokens


class PowerOfTwoSimRouter:
    """Two distinct replicas at random; the less loaded (Ray Serve's default router)."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, query: Query, loads: Mapping[int, int]) -> int:
        names = list(loads)
        if len(names) == 1:
            return names[0]
        a, b = self._rng.sample(names, 2)
        return a if loads[a] <= loads[b] else b

    def routed(self, query: Query, replica: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one simulated run measured."""

    router: str
    replicas: int
    requests: int
    hit_rate: float
    p50_ttft_s: float
    p95_ttft_s: float
    max_load_ratio: float
    per_replica: tuple[int, ...]


def make_router(name: str, trace: TraceOptions, affinity: AffinityOptions,
                seed: int = 0) -> SimRouter:
    """The simulated router called ``name`` (one of :data:`ROUTERS`)."""
    if name == "span-affinity":
        return AffinitySimRouter(affinity, seed)
    if name in ("prefix-affinity", "stock-prefix-affinity"):
        return PrefixSimRouter(trace.system_tokens, trace.question_tokens, seed=seed)
    if name in ("power-of-two", "single"):
        return PowerOfTwoSimRouter(seed)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")


def simulate(queries: Sequence[Query], router: SimRouter, replicas: int,
             capacity_tokens: int, cost: CostModel | None = None, *, name: str = "",
             system_tokens: int = 64, question_tokens: int = 32, seed: int = 0,
             stock: bool = False) -> SimResult:
    """Route ``queries`` over ``replicas`` simulated replicas of ``capacity_tokens`` of span
    cache each (``stock``: of a stock prefix cache, :class:`PrefixLruCache`), arriving as a
    Poisson stream at ``cost.utilization`` of what the replicas serve uncached; measure hit
    rate (span tokens read from cache / span tokens), TTFT percentiles and the busiest
    replica's requests over the mean."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, not {replicas}")
    if not queries:
        raise ValueError("no queries to simulate")
    cost = cost or CostModel()
    rng = random.Random(seed)
    kind = PrefixLruCache if stock else LruSpanCache
    caches = [kind(capacity_tokens) for _ in range(replicas)]
    free_at = [0.0] * replicas
    finishing: list[deque[float]] = [deque() for _ in range(replicas)]
    counts = [0] * replicas
    mean_prompt = sum(system_tokens + q.span_tokens + question_tokens
                      for q in queries) / len(queries)
    uncached_s = mean_prompt * cost.prefill_s_per_token + cost.decode_s
    rate = cost.utilization * replicas / uncached_s
    now = 0.0
    hits = spans = 0
    ttfts = []
    for query in queries:
        now += rng.expovariate(rate)
        loads = {}
        for r in range(replicas):
            queue = finishing[r]
            while queue and queue[0] <= now:
                queue.popleft()
            loads[r] = len(queue)
        replica = router.choose(query, loads)
        router.routed(query, replica)
        hit = caches[replica].read(query.prefix_keys() if stock else query.span_keys())
        hits += hit
        spans += query.span_tokens
        missed = system_tokens + question_tokens + query.span_tokens - hit
        prefill = missed * cost.prefill_s_per_token + hit * cost.hit_s_per_token
        start = max(now, free_at[replica])
        free_at[replica] = start + prefill + cost.decode_s
        finishing[replica].append(free_at[replica])
        ttfts.append(start + prefill - now)
        counts[replica] += 1
    ttfts.sort()
    mean = len(queries) / replicas
    return SimResult(name, replicas, len(queries), hits / spans, _percentile(ttfts, 0.5),
                     _percentile(ttfts, 0.95), max(counts) / mean, tuple(counts))


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[index])


__all__ = [
    "ROUTERS", "STOCK_ROUTERS", "AffinitySimRouter", "CostModel", "LruSpanCache",
    "PowerOfTwoSimRouter", "PrefixLruCache", "PrefixSimRouter", "Query", "SimResult",
    "SimRouter", "TraceOptions", "make_router", "make_trace", "simulate",
]
