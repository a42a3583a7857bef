"""The wire protocol: what one side writes, the other reads back (no server, no engine)."""

from __future__ import annotations

import json

import pytest

from span_workflows.errors import ServerError, SpanQueryError
from span_workflows.query.builders import g, user
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.result import Metrics, Result
from span_workflows.serving import wire

QUERY = g(user("hi"), max_tokens=4, temperature=0.0)
RESULT = Result("hello", Metrics(0.25, 10, 4, 2, 1, 0.5, 0.125), ["hello"])


def test_a_request_body_parses_back_to_the_query_and_options() -> None:
    body = wire.request_body(QUERY, stream=True, optimize_query=False, span_options="self",
                             cache_salt="tenant-a")
    assert set(body) <= wire.WRAPPER_KEYS
    parsed = wire.parse_body(json.dumps(body).encode())
    assert parsed.node == QUERY and parsed.stream and not parsed.optimize
    assert parsed.span_options == SpanOptions(attend="self")
    assert parsed.cache_salt == "tenant-a"
    bare = wire.parse_body(json.dumps(body["query"]).encode())
    assert bare == wire.QueryBody(QUERY)


def test_json_text_is_checked_before_it_is_sent() -> None:
    with pytest.raises(SpanQueryError, match="malformed JSON"):
        wire.request_body('{"g": ', stream=False)


def test_a_result_body_parses_back_to_the_result() -> None:
    body = wire.result_body(RESULT)
    assert body["usage"] == {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 2,
                             "total_tokens": 12}
    back = wire.parse_result(wire.read_response(200, json.dumps(body), "http://t"))
    assert (back.text, back.texts, back.metrics) == (RESULT.text, RESULT.texts, RESULT.metrics)


def test_metrics_round_trip_and_missing_metrics_are_zero() -> None:
    assert Metrics.from_dict(RESULT.metrics.to_dict()) == RESULT.metrics
    assert Metrics.from_dict({"ttft_s": 1}) == Metrics(1.0, 0, 0, 0)


def test_error_answers_raise_what_the_server_reported() -> None:
    body = wire.error_body(SpanQueryError("input.cross[2]", "unknown node 'plux'"))
    with pytest.raises(SpanQueryError) as info:
        wire.read_response(400, json.dumps(body), "http://t")
    assert info.value.path == "input.cross[2]" and info.value.message == "unknown node 'plux'"
    with pytest.raises(SpanQueryError, match="request too large"):
        wire.read_response(413, json.dumps(wire.too_large_body(10)), "http://t")
    with pytest.raises(ServerError, match="HTTP 500"):
        wire.read_response(500, "Internal Server Error", "http://t")


def test_stream_events_read_back_as_deltas_then_the_result() -> None:
    lines = [wire.sse(wire.delta_event("hel")), wire.sse(wire.delta_event("lo")),
             wire.sse(wire.done_event(RESULT))]

    def data(event: bytes) -> str:  # an event's data, as an SSE reader gives it
        text = event.decode()
        assert text.startswith("data: ") and text.endswith("\n\n")
        return text[len("data: "):-2]

    items = [wire.parse_event(data(line), "http://t") for line in lines]
    assert items[:2] == ["hel", "lo"]
    assert isinstance(items[2], Result) and items[2].metrics == RESULT.metrics
    assert wire.parse_event("", "http://t") is None
    with pytest.raises(SpanQueryError, match="bad"):
        wire.parse_event(data(wire.sse(wire.error_event(SpanQueryError("", "bad")))), "http://t")
    with pytest.raises(ServerError, match="RuntimeError"):
        wire.parse_event(data(wire.sse(wire.error_event(RuntimeError()))), "http://t")
