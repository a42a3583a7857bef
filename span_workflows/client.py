"""A client of the span query server (``span-workflows serve``), over HTTP with httpx.

:class:`SpanServer` is a drop-in for the embedded :class:`~span_workflows.engine.Engine` where
queries are concerned: ``execute``/``execute_many`` return the same
:class:`~span_workflows.engine.Result` with the same :class:`~span_workflows.engine.Metrics`.

Errors: an invalid query (any 4xx answer) raises :class:`~span_workflows.errors.SpanQueryError`
with the server's message and path; a server that cannot be reached raises
:class:`ServerUnavailableError` (a :class:`ConnectionError`) naming the URL, after ``retries``
further attempts; any other failure of the server raises :class:`ServerError`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from span_workflows.errors import SpanQueryError
from span_workflows.ir import Node
from span_workflows.json_ir import to_obj
from span_workflows.layout import SpanOptions
from span_workflows.result import Metrics, Result

EXECUTE_PATH = "/v1/query/execute"
_RETRY_DELAY_S = 0.5


class ServerUnavailableError(ConnectionError):
    """The span server at ``url`` could not be reached."""

    def __init__(self, url: str, reason: object) -> None:
        self.url = url
        super().__init__(f"span server at {url} is unavailable: {reason}")


class ServerError(RuntimeError):
    """The span server failed to answer a valid request (HTTP 5xx or a broken answer)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        self.url = url
        self.status = status
        super().__init__(f"span server at {url} failed (HTTP {status}): {message}")


class SpanServer:
    """Runs span queries on a span server at ``url`` (e.g. ``http://127.0.0.1:8000``).

    ``api_key`` is sent as ``Authorization: Bearer``; ``timeout`` (seconds) bounds each
    request; ``retries`` is how many more times a request is tried when the server cannot be
    reached (never after it answered).
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0,
                 retries: int = 0, transport: httpx.BaseTransport | None = None,
                 async_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.retries = max(0, int(retries))
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._async_transport = async_transport
        self._client = httpx.Client(base_url=self.url, headers=self._headers,
                                    timeout=timeout, transport=transport)

    # -- public API -----------------------------------------------------------------------------
    def execute(self, query: Node | dict | list | str, *, optimize_query: bool = True,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None) -> Result:
        """Run one query (a tree, or its JSON text/value) and return its result.
        ``span_options`` override the server's (what spans attend to, their layout);
        ``cache_salt`` keeps the query's cached KV apart from every other salt's."""
        body = _body(query, stream=False, optimize_query=optimize_query,
                     span_options=span_options, cache_salt=cache_salt)
        response = self._send(lambda: self._client.post(EXECUTE_PATH, json=body))
        return _result(self._json(response))

    def execute_many(self, queries: Sequence[Node | dict | list | str], *,
                     optimize_query: bool = True, max_concurrency: int = 16,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None) -> list[Result]:
        """Run several queries concurrently (the server batches them); results in order."""
        if not queries:
            return []
        workers = max(1, min(max_concurrency, len(queries)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(
                lambda q: self.execute(q, optimize_query=optimize_query,
                                       span_options=span_options, cache_salt=cache_salt),
                queries,
            ))

    async def aexecute(self, query: Node | dict | list | str, *,
                       optimize_query: bool = True,
                       span_options: SpanOptions | str | None = None,
                       cache_salt: str | None = None) -> Result:
        """Async :meth:`execute`."""
        body = _body(query, stream=False, optimize_query=optimize_query,
                     span_options=span_options, cache_salt=cache_salt)
        async with self._async_client() as client:
            for attempt in range(self.retries + 1):
                try:
                    response = await client.post(EXECUTE_PATH, json=body)
                    break
                except httpx.TransportError as exc:
                    if attempt >= self.retries or not _retryable(exc):
                        raise self._unavailable(exc) from exc
                    await asyncio.sleep(_RETRY_DELAY_S)
        return _result(self._json(response))

    def stream(self, query: Node | dict | list | str, *,
               optimize_query: bool = True,
               span_options: SpanOptions | str | None = None,
               cache_salt: str | None = None) -> Iterator[str]:
        """Yield the answer's text as it is generated (deltas; they concatenate to ``text``)."""
        body = _body(query, stream=True, optimize_query=optimize_query,
                     span_options=span_options, cache_salt=cache_salt)
        for attempt in range(self.retries + 1):
            try:
                with self._client.stream("POST", EXECUTE_PATH, json=body) as response:
                    if response.status_code != 200:
                        response.read()
                        self._json(response)  # raises the mapped error
                    for line in response.iter_lines():
                        delta = _event(line, self.url)
                        if delta is None:
                            continue
                        if delta is _DONE:
                            return
                        yield delta
                return
            except httpx.TransportError as exc:
                if attempt >= self.retries or not _retryable(exc):
                    raise self._unavailable(exc) from exc
                time.sleep(_RETRY_DELAY_S)

    async def astream(self, query: Node | dict | list | str, *,
                      optimize_query: bool = True,
                      span_options: SpanOptions | str | None = None,
                      cache_salt: str | None = None) -> AsyncIterator[str]:
        """Async :meth:`stream`."""
        body = _body(query, stream=True, optimize_query=optimize_query,
                     span_options=span_options, cache_salt=cache_salt)
        async with self._async_client() as client:
            try:
                async with client.stream("POST", EXECUTE_PATH, json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        self._json(response)
                    async for line in response.aiter_lines():
                        delta = _event(line, self.url)
                        if delta is None:
                            continue
                        if delta is _DONE:
                            return
                        yield delta
            except httpx.TransportError as exc:
                raise self._unavailable(exc) from exc

    def health(self) -> bool:
        """Whether the server answers ``/health`` with 200."""
        try:
            return self._client.get("/health", timeout=min(self.timeout, 10.0)).status_code == 200
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
    def _async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self._headers,
                                 timeout=self.timeout, transport=self._async_transport)

    def _send(self, call: Any) -> httpx.Response:
        for attempt in range(self.retries + 1):
            try:
                return call()
            except httpx.TransportError as exc:
                if attempt >= self.retries or not _retryable(exc):
                    raise self._unavailable(exc) from exc
                time.sleep(_RETRY_DELAY_S)
        raise AssertionError("unreachable")  # pragma: no cover

    def _unavailable(self, exc: httpx.TransportError) -> Exception:
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return ServerError(self.url, 0, f"no answer within {self.timeout} s ({exc!r})")
        return ServerUnavailableError(self.url, exc or type(exc).__name__)

    def _json(self, response: httpx.Response) -> dict[str, Any]:
        status = response.status_code
        try:
            data = response.json()
        except ValueError:
            data = None
        if 400 <= status < 500:
            raise _query_error(status, data, response.text)
        if status != 200:
            raise ServerError(self.url, status, _message(data) or response.text[:500])
        if not isinstance(data, dict):
            raise ServerError(self.url, status, "the answer is not a JSON object")
        return data


_DONE: Any = object()


def _retryable(exc: httpx.TransportError) -> bool:
    """Only failures to reach the server are retried (the request never ran)."""
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def _body(query: Node | dict | list | str, *, stream: bool, optimize_query: bool,
          span_options: SpanOptions | str | None = None,
          cache_salt: str | None = None) -> dict:
    if isinstance(query, str):
        from span_workflows.json_ir import from_json

        query = from_json(query)
    obj = to_obj(query) if isinstance(query, Node) else query
    body: dict[str, Any] = {"query": obj, "stream": stream}
    if not optimize_query:
        body["optimize"] = False
    if span_options is not None:
        body["span_options"] = SpanOptions.coerce(span_options).as_dict()
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def _message(data: Any) -> str | None:
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return None


def _query_error(status: int, data: Any, text: str) -> SpanQueryError:
    message = _message(data) or text.strip()[:500] or f"HTTP {status}"
    path = ""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        path = str(data["error"].get("path") or "")
    if path and message.startswith(f"{path}: "):
        message = message[len(path) + 2:]
    if status == 401:
        message = f"unauthorized: {message} (wrong or missing API key)"
    elif status == 413:
        message = f"request too large: {message}"
    return SpanQueryError(path, message)


def _event(line: str, url: str) -> Any:
    """The delta of one SSE line; ``None`` for lines without one; ``_DONE`` at the end."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return _DONE if payload == "[DONE]" else None
    event = json.loads(payload)
    if "delta" in event:
        return str(event["delta"])
    if event.get("done"):
        return _DONE
    if "error" in event:
        err = event["error"]
        message = _message(event) or "unknown error"
        if isinstance(err, dict) and err.get("type") == "invalid_query":
            raise SpanQueryError("", message)
        raise ServerError(url, 200, message)
    return None


def _result(data: dict[str, Any]) -> Result:
    m = data.get("metrics") or {}
    metrics = Metrics(
        ttft_s=float(m.get("ttft_s", 0.0)),
        prompt_tokens=int(m.get("prompt_tokens", 0)),
        cached_tokens=int(m.get("cached_tokens", 0)),
        generated_tokens=int(m.get("generated_tokens", 0)),
        prepare_requests=int(m.get("prepare_requests", 0)),
        latency_s=float(m.get("latency_s", 0.0)),
        final_ttft_s=float(m.get("final_ttft_s", 0.0)),
    )
    text = str(data.get("text", ""))
    texts = [str(t) for t in data.get("texts") or [text]]
    return Result(text, metrics, texts)


__all__ = ["ServerError", "ServerUnavailableError", "SpanServer"]
