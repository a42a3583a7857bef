"""Sampling options: how a schema or a tool list becomes the answer's constraint."""

from __future__ import annotations

from span_workflows.query.sampling import Sampling, answer_schema

JOKE = {"type": "object", "properties": {"setup": {"type": "string"},
                                         "punchline": {"type": "string"}},
        "required": ["setup", "punchline"]}


def test_fields_are_generated_in_the_schema_s_order() -> None:
    # xgrammar makes the model write the properties in the schema's order: a punchline
    # before its setup would be a worse answer than the one the caller asked for
    schema = answer_schema(Sampling.from_options({"json_schema": JOKE}))
    assert list(schema["properties"]) == ["setup", "punchline"]
    tools = Sampling.from_options({"tools": [{"type": "function", "function": {
        "name": "Joke", "parameters": JOKE}}], "tool_choice": "Joke"})
    call = answer_schema(tools)["properties"]["tool_calls"]["items"]
    assert list(call["properties"]["arguments"]["properties"]) == ["setup", "punchline"]


def test_equal_options_are_equal_and_hash_alike() -> None:
    a = Sampling.from_options({"json_schema": JOKE, "stop": "END"})
    b = Sampling.from_options({"json_schema": dict(JOKE), "stop": ["END"]})
    assert a == b and hash(a) == hash(b)
