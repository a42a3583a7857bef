"""Both backends answer the same interface: the HTTP client (mock transport) and the embedded
engine (real, marked ``engine``), including token-by-token streaming."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from span_workflows.query.builders import g, plus, user
from span_workflows.runtime.backend import QueryBackend
from span_workflows.runtime.result import Result
from span_workflows.serving.client import SpanServer

QUERY = g(user("Count from one to ten."), max_tokens=8, temperature=0.0)
DONE = {"done": True, "text": "hello", "texts": ["hello"],
        "metrics": {"ttft_s": 0.1, "prompt_tokens": 5, "cached_tokens": 0,
                    "generated_tokens": 2}}


def _sse(*events: dict) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events)


def test_the_http_client_is_a_query_backend() -> None:
    assert isinstance(SpanServer("http://span.test"), QueryBackend)


def test_the_async_stream_retries_an_unreachable_server_and_keeps_the_result() -> None:
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, text=_sse({"delta": "hel"}, {"delta": "lo"}, DONE),
                              headers={"content-type": "text/event-stream"})

    server = SpanServer("http://span.test", retries=1,
                        async_transport=httpx.MockTransport(handler))

    async def read() -> tuple[list[str], Result | None]:
        stream = server.astream(QUERY)
        return [d async for d in stream], stream.result

    deltas, result = asyncio.run(read())
    assert deltas == ["hel", "lo"] and len(calls) == 2
    assert result is not None and result.text == "hello" and result.metrics.prompt_tokens == 5


def test_the_stream_result_comes_from_the_done_event() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=_sse({"delta": "hel"}, {"delta": "lo"}, DONE),
                              headers={"content-type": "text/event-stream"})

    with SpanServer("http://span.test", transport=httpx.MockTransport(handler)) as server:
        stream = server.stream(QUERY)
        assert stream.result is None
        assert "".join(stream) == "hello"
        assert stream.result is not None and stream.result.texts == ["hello"]


@pytest.mark.engine
def test_the_engine_streams_token_by_token(engine) -> None:
    assert isinstance(engine, QueryBackend)
    whole = engine.execute(QUERY)
    stream = engine.stream(QUERY)
    deltas = list(stream)
    assert len(deltas) > 1  # one per engine step, not the answer at once
    assert "".join(deltas) == stream.result.text == whole.text


@pytest.mark.engine
def test_the_engine_streams_a_join_in_part_order_and_async(engine) -> None:
    query = plus(g(user("Say hi."), max_tokens=4, temperature=0.0),
                 g(user("Say bye."), max_tokens=4, temperature=0.0))
    whole = engine.execute(query)

    async def read() -> tuple[str, Result | None, Result]:
        stream = engine.astream(query)
        text = "".join([d async for d in stream])
        return text, stream.result, await engine.aexecute(query)

    text, result, again = asyncio.run(read())
    assert text == result.text == whole.text == again.text


@pytest.mark.engine
def test_closing_an_engine_stream_early_aborts_the_query(engine) -> None:
    long = g(user("Write a long story about the sea."), max_tokens=64, temperature=0.0)
    with engine.stream(long) as stream:
        first = next(stream)
    assert first and stream.result is None
    assert engine.execute(QUERY).text  # the engine serves the next query as usual
