"""A client of the span query server (``span-workflows serve``), over HTTP with httpx.

:class:`SpanServer` is a :class:`~span_workflows.runtime.backend.QueryBackend`, like the embedded
:class:`~span_workflows.runtime.engine.Engine`: ``execute``/``aexecute``/``execute_many`` return the
same :class:`~span_workflows.runtime.result.Result`, ``stream``/``astream`` the same text streams.
What goes over the wire is :mod:`span_workflows.serving.wire`'s business.

Errors: an invalid query (any 4xx answer) raises :class:`~span_workflows.errors.SpanQueryError`
with the server's message and path; a server that cannot be reached raises
:class:`~span_workflows.errors.ServerUnavailableError` (a :class:`ConnectionError`) naming the
URL, after ``retries`` further attempts; any other failure of the server raises
:class:`~span_workflows.errors.ServerError`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from typing import Any, TypeVar

import httpx
from httpx_sse import EventSource

from span_workflows.errors import ServerError, ServerUnavailableError, SpanQueryError
from span_workflows.query.ir import Node
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.result import BulkAnswer, Result
from span_workflows.runtime.streaming import AsyncTextStream, TextStream
from span_workflows.serving import wire

T = TypeVar("T")
Query = Node | dict | list | str
_RETRY_DELAY_S = 0.5


class SpanServer:
    """Runs span queries on a span server at ``url`` (e.g. ``http://127.0.0.1:8000``).

    ``api_key`` is sent as ``Authorization: Bearer``; ``timeout`` (seconds) bounds each
    request; ``retries`` is how many more times a request is tried when the server cannot be
    reached (never after it answered). A query is a tree, its JSON value or its JSON text.
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 0, transport: httpx.BaseTransport | None = None,
                 async_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries = max(0, int(retries))
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._async_transport = async_transport
        self._client = httpx.Client(base_url=self.url, headers=self._headers,
                                    timeout=timeout, transport=transport)

    # -- QueryBackend ---------------------------------------------------------------------------
    def execute(self, query: Query, *, optimize_query: bool = True,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None, weights: str | None = None) -> Result:
        """Run one query and return its result. ``span_options`` override the server's (what
        spans attend to, their layout); ``cache_salt`` keeps the query's cached KV apart from
        every other salt's; ``weights`` names the base or an adapter to run on (``None``: the
        server routes the query)."""
        body = wire.request_body(query, stream=False, optimize_query=optimize_query,
                                 span_options=span_options, cache_salt=cache_salt,
                                 weights=weights)
        response = self._retrying(lambda: self._client.post(wire.EXECUTE_PATH, json=body))
        return wire.parse_result(wire.read_response(response.status_code, response.text, self.url))

    async def aexecute(self, query: Query, *, optimize_query: bool = True,
                       span_options: SpanOptions | str | None = None,
                       cache_salt: str | None = None, weights: str | None = None) -> Result:
        """Async :meth:`execute`."""
        body = wire.request_body(query, stream=False, optimize_query=optimize_query,
                                 span_options=span_options, cache_salt=cache_salt,
                                 weights=weights)
        async with self._async_client() as client:
            response = await self._aretrying(lambda: client.post(wire.EXECUTE_PATH, json=body))
        return wire.parse_result(wire.read_response(response.status_code, response.text, self.url))

    def execute_many(self, queries: Sequence[Query], *, optimize_query: bool = True,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None, max_concurrency: int = 16,
                     weights: str | None = None) -> list[Result]:
        """Run several queries concurrently (the server batches them); results in order."""
        if not queries:
            return []
        workers = max(1, min(max_concurrency, len(queries)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(
                lambda q: self.execute(q, optimize_query=optimize_query,
                                       span_options=span_options, cache_salt=cache_salt,
                                       weights=weights),
                queries,
            ))

    def execute_bulk(self, queries: Sequence[Query], *, schedule: str = "cluster",
                     max_in_flight: int = 8, optimize_query: bool = True,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None) -> list[BulkAnswer]:
        """Run many queries in one ``POST /v1/query/bulk``, scheduled by the server (as
        :meth:`Engine.execute_bulk <span_workflows.runtime.engine.Engine.execute_bulk>`); one
        :class:`~span_workflows.runtime.result.BulkAnswer` per query, in input order. A query the
        client cannot even encode is refused here (:class:`SpanQueryError`, naming it)."""
        answers = list(self.iter_bulk(queries, schedule=schedule, max_in_flight=max_in_flight,
                                      optimize_query=optimize_query,
                                      span_options=span_options, cache_salt=cache_salt))
        by_index = {a.index: a for a in answers}
        missing = [i for i in range(len(queries)) if i not in by_index]
        if missing:
            raise ServerError(self.url, 200, f"the bulk answer lacks queries {missing[:10]}")
        return [by_index[i] for i in range(len(queries))]

    def iter_bulk(self, queries: Sequence[Query], *, schedule: str = "cluster",
                  max_in_flight: int = 8, optimize_query: bool = True,
                  span_options: SpanOptions | str | None = None,
                  cache_salt: str | None = None) -> Iterator[BulkAnswer]:
        """:meth:`execute_bulk`, each answer as the server sends it (when it is ready). A
        query given as JSON text is sent as it is (with the call's options where it sets
        none): one the server cannot parse is answered with its error, like any bad query."""
        lines = []
        for i, query in enumerate(queries):
            try:
                lines.append(wire.bulk_body([query], optimize_query=optimize_query,
                                            span_options=span_options, cache_salt=cache_salt))
            except SpanQueryError as exc:
                raise SpanQueryError(f"queries[{i}]" + (f".{exc.path}" if exc.path else ""),
                                     exc.message) from None
        return self._bulk_lines(b"".join(lines), schedule, max_in_flight)

    def _bulk_lines(self, body: bytes, schedule: str,
                    max_in_flight: int) -> Iterator[BulkAnswer]:
        request = self._client.build_request(
            "POST", wire.BULK_PATH, content=body,
            params={"schedule": schedule, "max_in_flight": str(max_in_flight)},
            headers={"Content-Type": wire.NDJSON_MEDIA_TYPE})
        with closing(self._stream(request, _ndjson_lines)) as lines:
            for line in lines:
                if line.strip():
                    yield wire.parse_bulk_answer(json.loads(line), self.url)

    def stream(self, query: Query, *, optimize_query: bool = True,
               span_options: SpanOptions | str | None = None,
               cache_salt: str | None = None, weights: str | None = None) -> TextStream:
        """The answer's text as it is generated (deltas that concatenate to ``text``); the
        stream's ``result`` once it is read to the end."""
        body = wire.request_body(query, stream=True, optimize_query=optimize_query,
                                 span_options=span_options, cache_salt=cache_salt,
                                 weights=weights)
        return TextStream(self._events(body))

    def astream(self, query: Query, *, optimize_query: bool = True,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None, weights: str | None = None) -> AsyncTextStream:
        """Async :meth:`stream`."""
        body = wire.request_body(query, stream=True, optimize_query=optimize_query,
                                 span_options=span_options, cache_salt=cache_salt,
                                 weights=weights)
        return AsyncTextStream(self._aevents(body))

    # -- the server -----------------------------------------------------------------------------
    def health(self) -> bool:
        """Whether the server answers ``/health`` with 200."""
        try:
            return self._client.get(wire.HEALTH_PATH,
                                    timeout=min(self.timeout, 10.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> SpanServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SpanServer({self.url!r})"

    # -- internals ------------------------------------------------------------------------------
    def _events(self, body: dict[str, Any]) -> Iterator[str | Result]:
        """The deltas, then the result, of a streamed request."""
        request = self._client.build_request("POST", wire.EXECUTE_PATH, json=body)
        with closing(self._stream(request, _event_data)) as events:
            for data in events:
                if (item := wire.parse_event(data, self.url)) is not None:
                    yield item
                    if isinstance(item, Result):
                        return

    def _stream(self, request: httpx.Request,
                read: Callable[[httpx.Response], Iterator[str]]) -> Iterator[str]:
        """What ``read`` makes of the streamed answer to ``request`` (sent again while the
        server cannot be reached); the server's error for an answer other than 200. Close it
        to close the response."""
        response = self._retrying(lambda: self._client.send(request, stream=True))
        try:
            with self._reachable():
                if response.status_code != 200:
                    response.read()
                    wire.read_response(response.status_code, response.text, self.url)  # raises
                yield from read(response)
        finally:
            response.close()

    async def _aevents(self, body: dict[str, Any]) -> AsyncIterator[str | Result]:
        """Async :meth:`_events`."""
        async with self._async_client() as client:
            request = client.build_request("POST", wire.EXECUTE_PATH, json=body)
            response = await self._aretrying(lambda: client.send(request, stream=True))
            try:
                with self._reachable():
                    if response.status_code != 200:
                        await response.aread()
                        wire.read_response(response.status_code, response.text, self.url)
                    async for event in EventSource(response).aiter_sse():
                        if (item := wire.parse_event(event.data, self.url)) is not None:
                            yield item
                            if isinstance(item, Result):
                                return
            finally:
                await response.aclose()

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        """Turns a transport failure (the server went away mid-answer) into the client's
        error."""
        try:
            yield
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc

    def _retrying(self, send: Callable[[], T]) -> T:
        """``send()``, tried again (``retries`` times) while the server cannot be reached."""
        for attempt in itertools.count():
            try:
                return send()
            except httpx.TransportError as exc:
                time.sleep(self._retry_delay(attempt, exc))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _aretrying(self, send: Callable[[], Awaitable[T]]) -> T:
        """Async :meth:`_retrying`."""
        for attempt in itertools.count():
            try:
                return await send()
            except httpx.TransportError as exc:
                await asyncio.sleep(self._retry_delay(attempt, exc))
        raise AssertionError("unreachable")  # pragma: no cover

    def _retry_delay(self, attempt: int, exc: httpx.TransportError) -> float:
        """The pause before trying again after ``attempt`` (0: the first) failed with ``exc``;
        raises the client's error when no retry is left or the request may have run (only
        failures to reach the server are retried)."""
        if attempt >= self.retries or not isinstance(exc, (httpx.ConnectError,
                                                           httpx.ConnectTimeout)):
            raise self._unavailable(exc) from exc
        return _RETRY_DELAY_S

    def _async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self._headers,
                                 timeout=self.timeout, transport=self._async_transport)

    def _unavailable(self, exc: httpx.TransportError) -> Exception:
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return ServerError(self.url, 0, f"no answer within {self.timeout} s ({exc!r})")
        return ServerUnavailableError(self.url, exc or type(exc).__name__)



def _event_data(response: httpx.Response) -> Iterator[str]:
    """The data of each server-sent event of ``response`` (``httpx-sse``: lines end at CR and
    LF only, so a U+2028 or U+0085 inside an answer stays in its event)."""
    return (event.data for event in EventSource(response).iter_sse())


def _ndjson_lines(response: httpx.Response) -> Iterator[str]:
    """The lines of an NDJSON ``response``, cut at LF only (httpx's text lines also end at
    U+2028, U+0085 and the like, which JSON strings may hold as they are)."""
    pending = b""
    for chunk in response.iter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        yield from (line.decode() for line in lines)
    if pending:
        yield pending.decode()

__all__ = ["ServerError", "ServerUnavailableError", "SpanServer"]
