"""``GET /v1/query/schema``: generated from the parser's own definitions, and agreeing with it."""

from __future__ import annotations

import jsonschema
import pytest

from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import chat, g, judge_generator, plus, rag, repeat, user
from span_workflows.query.json_ir import NODE_FIELDS, NODE_KINDS, from_json, to_obj
from span_workflows.serving import query_schema, wire

SCHEMA = query_schema.query_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

VALID = [
    to_obj(rag("Be brief.", ["doc one here", "doc two here"], "Q?", max_tokens=8)),
    to_obj(judge_generator(3, "Write.", "Pick the best.")),
    to_obj(repeat(2, g(user("Hi"), max_tokens=3))),
    to_obj(chat(user("Hello"), max_tokens=4)),
    to_obj(g(plus(user("a"), user("b")), n=2, temperature=0.0)),
    {"map": {"metadata": {"model": "spnl/x", "max_tokens": 4}, "inputs": ["a", "b"]}},
    {"repeat": {"n": 2, "generate": {"input": {"user": "hi"}}}},
    {"g": {"input": [{"system": "s"}, {"fragment": {"text": "t", "source": "f"}}]}},
    {"g": {"input": {"retrieve": {"query": "q", "fragments": [{"fragment": "x"}]}}}},
    {"g": {"input": {"prepare": {"plus": [{"user": "u"}]}}}},
    {"query": {"g": {"input": {"user": "hi"}}}, "stream": True, "optimize": False,
     "span_options": {"attend": "self", "pad": "before"}, "cache_salt": "t"},
    {"query": {"g": {"input": {"user": "hi"}}}, "span_options": "self"},
]
INVALID = [
    {"plux": [{"user": "a"}]},
    {"g": {"input": {"user": "a"}, "max_tokenz": 3}},
    {"g": {"input": {"user": "a"}, "temperature": "hot"}},
    {"g": {"input": {"user": "a"}, "max_tokens": -1}},
    {"g": {"input": {"user": "a"}, "n": 0}},
    {"g": {"max_tokens": 3}},
    {"user": 3},
    {"map": {"metadata": {}, "inputs": [1]}},
    {"repeat": {"g": {"input": {"user": "a"}}}},
    {"query": {"g": {"input": {"user": "hi"}}}, "span_options": {"attend": "nowhere"}},
    {"query": {"g": {"input": {"user": "hi"}}}, "cache_salt": ""},
    "just a string",
]


@pytest.mark.parametrize("body", VALID)
def test_what_the_server_reads_the_schema_accepts(body: object) -> None:
    wire.parse_body(wire.json.dumps(body).encode())  # the server reads it
    VALIDATOR.validate(body)


@pytest.mark.parametrize("body", INVALID)
def test_what_the_server_refuses_the_schema_refuses(body: object) -> None:
    with pytest.raises(SpanQueryError):
        wire.parse_body(wire.json.dumps(body).encode())
    assert not VALIDATOR.is_valid(body)


def test_the_schema_covers_every_kind_and_field_of_the_parser() -> None:
    kinds = [next(iter(s["properties"])) for s in SCHEMA["$defs"]["node"]["oneOf"][1:]]
    assert kinds == list(NODE_KINDS)
    for kind in NODE_KINDS:  # every kind the schema names is one the parser reads
        body = {"input": {"user": "x"}} if kind == "g" else None
        if body is not None:
            from_json({kind: body})
    for kind, fields in NODE_FIELDS.items():
        assert set(query_schema.FIELD_SCHEMAS[kind]) == set(fields), kind
    assert set(SCHEMA["$defs"]["wrapper"]["properties"]) == set(wire.WRAPPER_KEYS)
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
