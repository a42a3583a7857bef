"""Span-affinity routing: which replica to send a query to, from the spans it reads.

A query is routed by its **span keys** (:class:`SpanKey`: a key naming a piece of span KV and
how many tokens it holds; in the server, the position-independent block keys of its plus spans,
:mod:`span_workflows.compiler.keys`). :class:`SpanAffinityPolicy` keeps, per replica, an
approximate picture of that replica's span cache (:class:`ReplicaSpanCache`: the keys routed
there, least recently routed first, bounded in tokens like the KV cache it stands for) and
sends a query to the replica that holds the most of its span tokens, unless that replica's
load exceeds the lightest one's by more than ``imbalance_threshold`` (then to the lightest),
or it took more than ``max_share`` times its fair share of the recent queries (bounded-load
affinity: popular documents cannot pile their queries onto one replica; they spread to a
second holder, which then holds them too).

The policy is plain Python, with no Ray in it: the Ray Serve ``RequestRouter``
(:mod:`span_workflows.scaleout.ray_router`) and the trace-driven simulator
(:mod:`span_workflows.scaleout.simulate`) both call it.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from span_workflows.compiler.keys import SpanKey

ReplicaName = Hashable


@dataclass(frozen=True, slots=True)
class AffinityOptions:
    """Settings of :class:`SpanAffinityPolicy`.

    ``capacity_tokens``: span tokens remembered per replica (set it to the replica's KV cache
    size in tokens: older keys are forgotten as the cache would evict them).
    ``imbalance_threshold``: a replica whose load (requests in flight) exceeds the lightest
    replica's by more than this is not chosen for affinity. ``min_match_tokens``: a replica
    must hold at least this many of the query's span tokens to be chosen for affinity.
    ``max_share``: a replica that took more than this times its fair share of the last
    ``window_per_replica`` × replicas queries is not chosen for affinity (``None``: no bound).
    """

    capacity_tokens: int = 65_536
    imbalance_threshold: int = 2
    min_match_tokens: int = 1
    max_share: float | None = 1.25
    window_per_replica: int = 16

    def __post_init__(self) -> None:
        if self.capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, not {self.capacity_tokens}")
        if self.imbalance_threshold < 0:
            raise ValueError("imbalance_threshold must be >= 0, "
                             f"not {self.imbalance_threshold}")
        if self.min_match_tokens < 1:
            raise ValueError(f"min_match_tokens must be >= 1, not {self.min_match_tokens}")
        if self.max_share is not None and self.max_share < 1:
            raise ValueError(f"max_share must be >= 1 (or None), not {self.max_share}")
        if self.window_per_replica < 1:
            raise ValueError(f"window_per_replica must be >= 1, not {self.window_per_replica}")


@dataclass
class ReplicaSpanCache:
    """The span keys believed to be cached on one replica, least recently used first; their
    tokens never exceed ``capacity_tokens`` (the oldest are dropped first)."""

    capacity_tokens: int
    entries: OrderedDict[Hashable, int] = field(default_factory=OrderedDict)
    tokens: int = 0

    def add(self, keys: Iterable[SpanKey]) -> list[Hashable]:
        """Record ``keys`` as just used here; return the keys dropped to stay in capacity."""
        for k in keys:
            old = self.entries.pop(k.key, None)
            if old is not None:
                self.tokens -= old
            self.entries[k.key] = k.tokens
            self.tokens += k.tokens
        dropped = []
        while self.tokens > self.capacity_tokens and self.entries:
            key, size = self.entries.popitem(last=False)
            self.tokens -= size
            dropped.append(key)
        return dropped

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries


class SpanAffinityPolicy:
    """Chooses a replica per query from its span keys and the replicas' loads.

    Contract: :meth:`choose` reads the map and never changes it (it only lets the oldest
    queries leave the window of recent ones that ``max_share`` counts); :meth:`record` must follow
    with the replica the query was actually sent to (a request routed elsewhere, e.g. after a
    failure, is recorded there). :meth:`drop` forgets a replica (it died: its cache is gone);
    a replica seen again starts empty. Ties go to the lighter load, then at random (``seed``).
    """

    def __init__(self, options: AffinityOptions | None = None, *, seed: int | None = 0) -> None:
        self.options = options or AffinityOptions()
        self._caches: dict[ReplicaName, ReplicaSpanCache] = {}
        #: key -> replicas believed to hold it (the inverse of ``_caches``)
        self._holders: dict[Hashable, set[ReplicaName]] = {}
        self._rng = random.Random(seed)
        #: the replicas of the latest routed queries, oldest first, and their counts
        self._recent: deque[ReplicaName] = deque()
        self._recent_counts: Counter[ReplicaName] = Counter()

    # -- the map ---------------------------------------------------------------------------

    def record(self, replica: ReplicaName, keys: Sequence[SpanKey]) -> None:
        """``keys`` were just sent to ``replica`` (it computes or reads them: it holds them)."""
        self._recent.append(replica)
        self._recent_counts[replica] += 1
        cache = self._caches.get(replica)
        if cache is None:
            cache = self._caches[replica] = ReplicaSpanCache(self.options.capacity_tokens)
        for k in keys:
            self._holders.setdefault(k.key, set()).add(replica)
        for key in cache.add(keys):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[key]

    def drop(self, replica: ReplicaName) -> None:
        """Forget everything ``replica`` was believed to hold (it died or left)."""
        cache = self._caches.pop(replica, None)
        if cache is None:
            return
        for key in cache.entries:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[key]

    def keep_only(self, replicas: Iterable[ReplicaName]) -> None:
        """Drop every replica not in ``replicas`` (the deployment's current set)."""
        alive = set(replicas)
        for replica in [r for r in self._caches if r not in alive]:
            self.drop(replica)

    def held_tokens(self, replica: ReplicaName, keys: Sequence[SpanKey]) -> int:
        """How many of ``keys``' tokens ``replica`` is believed to hold."""
        cache = self._caches.get(replica)
        if cache is None:
            return 0
        return sum(k.tokens for k in _unique(keys) if k.key in cache)

    def replicas(self) -> list[ReplicaName]:
        """The replicas the map knows."""
        return list(self._caches)

    # -- routing ---------------------------------------------------------------------------

    def scores(self, keys: Sequence[SpanKey],
               candidates: Iterable[ReplicaName]) -> dict[ReplicaName, int]:
        """Span tokens of ``keys`` held by each candidate holding any (others are left out)."""
        allowed = set(candidates)
        found: dict[ReplicaName, int] = {}
        for k in _unique(keys):
            for replica in self._holders.get(k.key, ()):
                if replica in allowed:
                    found[replica] = found.get(replica, 0) + k.tokens
        return found

    def choose(self, keys: Sequence[SpanKey], loads: Mapping[ReplicaName, int]) -> ReplicaName:
        """The replica for a query reading ``keys``, given each candidate's load (requests in
        flight). Raises ``ValueError`` when there is no candidate."""
        if not loads:
            raise ValueError("no replica to route to")
        lightest = min(loads.values())
        limit = lightest + self.options.imbalance_threshold
        busy = self._over_share(loads)
        scores = self.scores(keys, loads)
        eligible = [(s, r) for r, s in scores.items()
                    if s >= self.options.min_match_tokens and loads[r] <= limit
                    and r not in busy]
        if eligible:
            best = max(s for s, _ in eligible)
            tied = [r for s, r in eligible if s == best]
        else:
            tied = [r for r in loads if r not in busy] or list(loads)
        low = min(loads[r] for r in tied)
        tied = [r for r in tied if loads[r] == low]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _over_share(self, loads: Mapping[ReplicaName, int]) -> set[ReplicaName]:
        """The candidates that took more than ``max_share`` × their fair share of the recent
        queries (the window is trimmed to ``window_per_replica`` × candidates first)."""
        share = self.options.max_share
        if share is None or len(loads) < 2:
            return set()
        window = self.options.window_per_replica * len(loads)
        while len(self._recent) > window:
            old = self._recent.popleft()
            self._recent_counts[old] -= 1
            if not self._recent_counts[old]:
                del self._recent_counts[old]
        if len(self._recent) < window:
            return set()  # too few queries yet to tell a busy replica from chance
        cap = share * len(self._recent) / len(loads)
        return {r for r in loads if self._recent_counts.get(r, 0) > cap}


class InFlight:
    """Requests in flight per replica, counted from two notices that may come in either order:
    ``routed`` (the request went to a replica) and ``completed`` (it ended). Ray Serve sends
    the completion from a done-callback that can run before the routing notice when a replica
    answers at once; a completion seen first is remembered, so the request is never counted
    (counting it would leave the replica one request heavier for good)."""

    def __init__(self, remembered: int = 4096) -> None:
        self._remembered = remembered
        self._where: dict[Hashable, ReplicaName] = {}
        self._ended_early: OrderedDict[Hashable, None] = OrderedDict()
        self._load: Counter[ReplicaName] = Counter()

    def routed(self, request: Hashable, replica: ReplicaName) -> None:
        """``request`` was sent to ``replica``."""
        if request in self._ended_early:
            del self._ended_early[request]
            return
        self._where[request] = replica
        self._load[replica] += 1

    def completed(self, request: Hashable) -> None:
        """``request`` ended (answered, failed or cancelled)."""
        replica = self._where.pop(request, None)
        if replica is None:
            self._ended_early[request] = None
            while len(self._ended_early) > self._remembered:
                self._ended_early.popitem(last=False)
        elif self._load[replica] > 0:
            self._load[replica] -= 1

    def load(self, replica: ReplicaName) -> int:
        """Requests in flight on ``replica``."""
        return self._load.get(replica, 0)

    def drop(self, replica: ReplicaName) -> None:
        """Forget ``replica``'s requests (it died: they end without it)."""
        self._load.pop(replica, None)
        self._where = {q: r for q, r in self._where.items() if r != replica}

    def keep_only(self, replicas: Iterable[ReplicaName]) -> None:
        """Forget the requests of every replica not in ``replicas`` (they died or left)."""
        alive = set(replicas)
        for gone in [r for r in self._load if r not in alive]:
            self.drop(gone)


def _unique(keys: Sequence[SpanKey]) -> list[SpanKey]:
    seen: set[Hashable] = set()
    out = []
    for k in keys:
        if k.key not in seen:
            seen.add(k.key)
            out.append(k)
    return out


__all__ = ["AffinityOptions", "InFlight", "ReplicaSpanCache", "SpanAffinityPolicy", "SpanKey"]
