"""``SpanAffinityRouter``: the span-affinity policy as a Ray Serve request router.

Ray Serve calls a deployment handle's request router (the public ``ray.serve.request_router``
API) in the process that holds the handle — here the ingress, which has already computed each
query's span keys (:mod:`span_workflows.compiler.keys`) and sends them along as the first
argument of the call, a :class:`RoutedQuery`. The router:

* ``choose_replicas`` — ranks the candidates: first the replica
  :class:`~span_workflows.scaleout.affinity.SpanAffinityPolicy` picks from the query's keys and
  the replicas' loads (requests in flight from this handle, or the queue length Ray last saw,
  whichever is larger), then the others, least loaded first (Ray sends to the first of a rank
  that accepts the request);
* ``on_request_routed`` / ``on_request_completed`` — record the query's keys on the replica it
  went to, and count requests in flight;
* ``on_replica_actor_died`` / ``update_replicas`` — drop a dead or removed replica from the
  map; a restarted replica comes back empty and refills as queries are routed to it.

A :class:`RoutedQuery` with ``target`` set goes to that replica only (the ingress asks every
replica for its metrics that way); ``avoid`` names replicas not to use (a retry after a
failure). Queries of other types are routed to the least loaded replica.

One query is one call: its prepares and its main request run in the replica it is routed to.
"""

from __future__ import annotations

import importlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from span_workflows.scaleout.affinity import AffinityOptions, InFlight, SpanAffinityPolicy, SpanKey

#: Routers alive in this process, by Serve application name (the ingress asks its own).
_ACTIVE: dict[str, SpanAffinityRouter] = {}
#: How many query ids are remembered with the replica they went to.
_REMEMBERED = 4096


@dataclass(frozen=True)
class RoutedQuery:
    """The first argument of a call routed by span affinity.

    ``body``: the request body as received; ``keys``: the query's span keys; ``prompt``: its
    messages' text in order (for Ray's text-prefix router); ``query_id``: names the call for
    :meth:`SpanAffinityRouter.replica_of`; ``target``: a replica's ``unique_id`` to send to
    (nothing else); ``avoid``: replica ``unique_id`` s not to send to; ``content_type``:
    the body's, as received (spnl's clients send ``text/plain``)."""

    body: bytes = b""
    keys: tuple[SpanKey, ...] = ()
    prompt: str = ""
    query_id: str = ""
    target: str | None = None
    avoid: frozenset[str] = field(default_factory=frozenset)
    content_type: str = "application/json"


class SpanAffinityRouter(RequestRouter):
    """Routes each query to the replica holding most of its span tokens (see module doc).

    ``request_router_kwargs``: ``capacity_tokens`` (span tokens remembered per replica: its
    KV cache size in tokens), ``imbalance_threshold`` (requests in flight beyond the lightest
    replica's before affinity gives way to load), ``min_match_tokens``, ``max_share`` (the
    bounded-load factor; ``None``: no bound)."""

    def initialize_state(self, capacity_tokens: int = 65_536, imbalance_threshold: int = 2,
                         min_match_tokens: int = 1, max_share: float | None = 1.25,
                         **_: Any) -> None:
        """Called by Ray Serve with ``request_router_kwargs``."""
        self.policy = SpanAffinityPolicy(AffinityOptions(
            capacity_tokens=capacity_tokens, imbalance_threshold=imbalance_threshold,
            min_match_tokens=min_match_tokens, max_share=max_share), seed=None)
        self._in_flight = InFlight()
        self._routed: OrderedDict[str, ReplicaID] = OrderedDict()
        # Ray may ship this class by value: register in the module as imported here.
        registry = importlib.import_module(__name__)._ACTIVE
        try:
            registry[self.app_name] = self
        except AttributeError:  # pragma: no cover - built outside a deployment
            pass

    # -- what the ingress asks ------------------------------------------------------------

    def replica_of(self, query_id: str) -> str | None:
        """The ``unique_id`` of the replica the call ``query_id`` was routed to, if known."""
        replica = self._routed.get(query_id)
        return None if replica is None else replica.unique_id

    def forget(self, unique_id: str) -> None:
        """Drop the replica ``unique_id`` from the map (a call to it failed: its cache is
        presumed lost; Ray's own notice of its death may come later)."""
        for replica in [r for r in self.policy.replicas() if r.unique_id == unique_id]:
            self.policy.drop(replica)

    def replica_ids(self) -> list[str]:
        """The ``unique_id`` of every replica currently routable."""
        return sorted(r.unique_id for r in self.curr_replicas)

    def load_of(self, replica: ReplicaID) -> int:
        """Requests in flight on ``replica``: sent by this router and not completed, or the
        queue length Ray last probed, whichever is larger."""
        probed = self.replica_queue_len_cache.get(replica)
        return max(self._in_flight.load(replica), int(probed or 0))

    # -- RequestRouter --------------------------------------------------------------------

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """Ranks of replicas for ``pending_request`` (see the module doc)."""
        query = _query_of(pending_request)
        if query is not None and query.target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == query.target]]
        candidates = [r for r in candidate_replicas
                      if query is None or r.replica_id.unique_id not in query.avoid]
        if not candidates:
            candidates = list(candidate_replicas)
        if not candidates:
            return []
        loads = {r.replica_id: self.load_of(r.replica_id) for r in candidates}
        by_id = {r.replica_id: r for r in candidates}
        if query is not None and query.keys:
            first = by_id[self.policy.choose(query.keys, loads)]
        else:
            low = min(loads.values())
            first = random.choice([r for r in candidates if loads[r.replica_id] == low])
        rest = sorted((r for r in candidates if r is not first),
                      key=lambda r: loads[r.replica_id])
        return [[first], rest] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        """Record the query's keys on ``replica_id``; count it in flight."""
        query = _query_of(pending_request)
        if query is not None and query.target is None:
            self.policy.record(replica_id, query.keys)
            if query.query_id:
                self._routed[query.query_id] = replica_id
                while len(self._routed) > _REMEMBERED:
                    self._routed.popitem(last=False)
        internal = _internal_id(pending_request)
        if internal is not None:
            self._in_flight.routed(internal, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The call ended (answered or failed): no longer in flight."""
        self._in_flight.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Ray's notice that a replica died: its cache is gone."""
        super().on_replica_actor_died(replica_id)
        self.policy.drop(replica_id)
        self._in_flight.drop(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's current replica set: forget replicas no longer in it."""
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        self.policy.keep_only(alive)
        self._in_flight.keep_only(alive)


def router_for(app_name: str) -> SpanAffinityRouter | None:
    """The span-affinity router of application ``app_name`` in this process, once the first
    call has created it."""
    return _ACTIVE.get(app_name)


def _query_of(pending_request: PendingRequest | None) -> RoutedQuery | None:
    """The call's :class:`RoutedQuery`, if its first argument is one (by its fields: Ray may
    ship this module's classes by value, so two copies of the class can meet)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    if type(first).__name__ == "RoutedQuery" and all(
            hasattr(first, name) for name in ("keys", "target", "avoid", "query_id")):
        return first
    return None


def _internal_id(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    return getattr(pending_request.metadata, "internal_request_id", None)


__all__ = ["RoutedQuery", "SpanAffinityRouter", "router_for"]
