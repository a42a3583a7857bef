"""spnl's form of /v1/query/execute: URL options and the OpenAI-shaped answers."""

from __future__ import annotations

import pytest

from span_workflows.compiler.optimize import optimize
from span_workflows.errors import SpanQueryError
from span_workflows.query.json_ir import from_json
from span_workflows.runtime.result import Metrics, Result
from span_workflows.serving import spnl_wire

INPUTS = ["zebra one", "apple two", "mango three", "apple two"]


def test_url_options() -> None:
    assert spnl_wire.url_stream({"stream": "true"}) is True
    assert spnl_wire.url_stream({"stream": "false"}) is False
    assert spnl_wire.url_stream({}) is None
    with pytest.raises(SpanQueryError, match="stream: must be true or false"):
        spnl_wire.url_stream({"stream": "yes please"})
    assert spnl_wire.openai_form({}, "text/plain; charset=utf-8")
    assert not spnl_wire.openai_form({}, "application/json")
    assert spnl_wire.openai_form({"format": "openai"}, "application/json")
    assert not spnl_wire.openai_form({"format": "span"}, "text/plain")
    with pytest.raises(SpanQueryError, match="format: must be one of span, openai"):
        spnl_wire.openai_form({"format": "xml"}, None)


def test_map_choices_follow_the_inputs_not_the_optimized_order() -> None:
    query = from_json({"map": {"metadata": {"max_tokens": 4}, "inputs": INPUTS}})
    normalized = optimize(query)
    order = spnl_wire.choice_order(query, normalized)
    assert sorted(order) == [0, 1, 2, 3]
    for k, part in enumerate(normalized.children):
        assert INPUTS[order[k]] == part.input.text
    result = Result("", Metrics(0.1, 10, 4, 8), [p.input.text.upper() for p in
                                                  normalized.children])
    body = spnl_wire.completion_body(result, is_map=True, order=order, request_id="cmpl-1",
                                     created=1, model="m", finish_reasons={})
    assert body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == [t.upper() for t in INPUTS]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


def test_repeat_answers_a_chat_completion_and_chunks() -> None:
    query = from_json({"repeat": {"n": 2, "g": {"input": {"user": "hi"}}}})
    assert spnl_wire.choice_order(query, optimize(query)) == [0, 1]
    result = Result("a", Metrics(0.1, 10, 4, 8), ["a", "b"])
    body = spnl_wire.completion_body(result, is_map=False, order=[0, 1], request_id="x",
                                     created=1, model="m", finish_reasons={1: "length"})
    assert body["object"] == "chat.completion"
    assert [(c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        ("a", "stop"), ("b", "length")]
    chunk = spnl_wire.chunk_body(1, "b", is_map=False, request_id="x", created=1, model="m")
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": "b"},
                                 "logprobs": None, "finish_reason": None}]
    text = spnl_wire.chunk_body(2, "t", is_map=True, request_id="x", created=1, model="m")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "t"
