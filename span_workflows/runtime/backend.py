"""What runs span queries: one interface for the embedded engine and the HTTP client.

:class:`QueryBackend` is implemented by :class:`span_workflows.runtime.engine.Engine` (vLLM in this
process) and :class:`span_workflows.serving.client.SpanServer` (a span server over HTTP), so an
application or a framework integration takes either and never asks which.

Contract, for every method: ``query`` is a span-query tree (``SpanServer`` also takes its JSON
value or text); ``optimize_query=False`` runs the tree as given (it must then be in the
optimizer's normal form); ``span_options`` (a
:class:`~span_workflows.query.span_options.SpanOptions` or a
preset name, ``"prefix"`` or ``"self"``) override the backend's for this call; ``cache_salt``
keeps the query's cached KV, spans included, apart from every other salt's; ``weights`` names
the weights to run on (the base model's name or a LoRA adapter's; ``None``: the backend routes
the query, :mod:`span_workflows.runtime.routing`, and ``Result.metrics.weights`` says which
answered). An invalid query
raises :class:`~span_workflows.errors.SpanQueryError`, except in ``execute_bulk``, where
it is that query's answer and the others run. ``stream``/``astream`` yield the
answer's text as it is generated, in deltas that concatenate to the result's ``text``; the
stream's ``result`` is the :class:`~span_workflows.runtime.result.Result` once it is read to the
end. Async methods never block the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from span_workflows.query.ir import Node
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.result import BulkAnswer, Result
from span_workflows.runtime.streaming import AsyncTextStream, TextStream


@runtime_checkable
class QueryBackend(Protocol):
    """Runs span queries: sync, async, several at once, streamed (see the module docstring)."""

    def execute(self, query: Node, *, optimize_query: bool = True,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None,
                weights: str | None = None) -> Result:
        """Run one query; its result."""
        ...

    async def aexecute(self, query: Node, *, optimize_query: bool = True,
                       span_options: SpanOptions | str | None = None,
                       cache_salt: str | None = None,
                       weights: str | None = None) -> Result:
        """Async :meth:`execute`."""
        ...

    def execute_many(self, queries: Sequence[Node], *, optimize_query: bool = True,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None,
                     weights: str | None = None) -> list[Result]:
        """Run several queries concurrently; their results, in order."""
        ...

    def execute_bulk(self, queries: Sequence[Node], *, schedule: str = "cluster",
                     max_in_flight: int = 8, optimize_query: bool = True,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None) -> list[BulkAnswer]:
        """Run many queries ordered by the spans they share (``schedule``: ``"cluster"``,
        ``"given"`` or ``"random"``), ``max_in_flight`` at a time; one answer per query, in
        input order, each its result or its own error (:mod:`span_workflows.runtime.bulk`)."""
        ...

    def stream(self, query: Node, *, optimize_query: bool = True,
               span_options: SpanOptions | str | None = None,
               cache_salt: str | None = None,
               weights: str | None = None) -> TextStream:
        """Run one query; its text as it is generated, then its ``result``."""
        ...

    def astream(self, query: Node, *, optimize_query: bool = True,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None,
                weights: str | None = None) -> AsyncTextStream:
        """Async :meth:`stream`."""
        ...


__all__ = ["QueryBackend"]
