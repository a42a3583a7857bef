"""SpanServer's mapping of HTTP answers to results and errors (no server: httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import g, user
from span_workflows.runtime.engine import Metrics, Result
from span_workflows.serving.client import ServerError, ServerUnavailableError, SpanServer
from span_workflows.serving.launch import free_port

QUERY = g(user("hi"), max_tokens=4, temperature=0.0)
ANSWER = {
    "text": "hello", "texts": ["hello"],
    "usage": {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 2,
              "total_tokens": 12},
    "metrics": {"ttft_s": 0.25, "prompt_tokens": 10, "cached_tokens": 4,
                "generated_tokens": 2, "prepare_requests": 1, "latency_s": 0.5,
                "final_ttft_s": 0.125},
}


def _server(handler, **kwargs) -> SpanServer:
    transport = httpx.MockTransport(handler)
    return SpanServer("http://span.test", transport=transport, async_transport=transport,
                      **kwargs)


def test_execute_returns_engine_types_and_sends_the_query() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=ANSWER)

    client = _server(handler, api_key="k")
    result = client.execute(QUERY)
    assert isinstance(result, Result) and isinstance(result.metrics, Metrics)
    assert result.text == "hello" and result.texts == ["hello"]
    assert result.metrics == Metrics(0.25, 10, 4, 2, 1, 0.5, 0.125)
    assert asyncio.run(client.aexecute(QUERY)).metrics == result.metrics
    assert [r.text for r in client.execute_many([QUERY, QUERY])] == ["hello", "hello"]
    body = json.loads(seen[0].content)
    assert body["stream"] is False and "g" in body["query"]
    assert seen[0].url.path == "/v1/query/execute"
    assert seen[0].headers["authorization"] == "Bearer k"


def test_invalid_query_raises_span_query_error_with_path() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {
            "message": "input.cross[2]: unknown node 'plux'", "type": "invalid_query",
            "path": "input.cross[2]"}})

    client = _server(handler)
    with pytest.raises(SpanQueryError) as info:
        client.execute({"g": {"input": {"plux": []}}})
    assert info.value.path == "input.cross[2]"
    assert str(info.value) == "input.cross[2]: unknown node 'plux'"
    with pytest.raises(SpanQueryError, match="plux"):
        asyncio.run(client.aexecute(QUERY))
    with pytest.raises(SpanQueryError, match="plux"):
        list(client.stream(QUERY))


@pytest.mark.parametrize(("status", "payload", "needle"), [
    (401, {"error": "Unauthorized"}, "unauthorized"),
    (413, {"error": {"message": "request body is larger than 4 bytes"}}, "too large"),
    (422, "not json", "not json"),
])
def test_other_4xx_are_span_query_errors(status: int, payload: object, needle: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(payload, str):
            return httpx.Response(status, text=payload)
        return httpx.Response(status, json=payload)

    with pytest.raises(SpanQueryError, match=needle):
        _server(handler).execute(QUERY)


def test_5xx_is_a_server_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="Internal Server Error")

    with pytest.raises(ServerError, match="HTTP 500"):
        _server(handler).execute(QUERY)


def test_unreachable_server_names_the_url_and_retries() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    client = _server(handler, retries=2)
    with pytest.raises(ServerUnavailableError, match="http://span.test") as info:
        client.execute(QUERY)
    assert isinstance(info.value, ConnectionError)
    assert len(calls) == 3
    assert client.health() is False
    with pytest.raises(ServerUnavailableError):
        asyncio.run(client.aexecute(QUERY))


def test_real_refused_connection() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = SpanServer(url, timeout=5)
    with pytest.raises(ServerUnavailableError, match=url):
        client.execute(QUERY)
    assert not client.health()


def test_stream_yields_deltas_until_done() -> None:
    events = [{"delta": "hel"}, {"delta": "lo"}, {"done": True, "usage": ANSWER["usage"]}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events)

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    assert list(_server(handler).stream(QUERY)) == ["hel", "lo"]


def test_stream_deltas_keep_unicode_line_separators() -> None:
    """The server writes deltas as they are (``ensure_ascii=False``): a delta holding U+2028,
    U+0085 or a form feed is one event, which only an SSE reader (lines end at CR and LF
    alone) reads back whole; a reader of text lines splits it and fails on the JSON."""
    from span_workflows.serving import wire

    deltas = ["a\u2028b", "c\x85d", "e\x0cf", "g\u2029"]
    body = b"".join(wire.sse(wire.delta_event(d)) for d in deltas)
    body += wire.sse({"done": True, "usage": ANSWER["usage"]})

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    assert list(_server(handler).stream(QUERY)) == deltas

    async def collect() -> list[str]:
        return [d async for d in _server(handler).astream(QUERY)]

    assert asyncio.run(collect()) == deltas


def test_bulk_answers_keep_unicode_line_separators() -> None:
    """A bulk answer's line is JSON written as it is: a text holding U+2028 or U+0085 is one
    answer, cut at LF only."""
    from span_workflows.runtime.result import BulkAnswer
    from span_workflows.serving import wire

    texts = ["a\u2028b", "c\x85d"]
    body = b"".join(wire.bulk_answer_line(BulkAnswer(i, result=Result(t, Metrics(0, 1, 0, 1))))
                    for i, t in enumerate(texts))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body,
                              headers={"content-type": wire.NDJSON_MEDIA_TYPE})

    answers = list(_server(handler).iter_bulk([QUERY, QUERY]))
    assert [a.result.text for a in answers] == texts


def test_stream_error_event_raises() -> None:
    sse = 'data: {"delta": "a"}\n\ndata: {"error": {"message": "boom", "type": "x"}}\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    with pytest.raises(ServerError, match="boom"):
        list(_server(handler).stream(QUERY))


def test_json_text_queries_are_parsed_locally() -> None:
    def handler(request: httpx.Request) -> httpx.Response:  # pragma: no cover - not reached
        return httpx.Response(200, json=ANSWER)

    with pytest.raises(SpanQueryError, match="malformed JSON"):
        _server(handler).execute('{"g": ')
