"""Tests for span_workflows.query.json_ir: spnl JSON samples, round trips and error reporting."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Plus,
    Prepare,
    Repeat,
    Retrieve,
    Seq,
    System,
    User,
)
from span_workflows.query.json_ir import dump_json, from_json, parse_json, to_json, to_obj
from span_workflows.query.validate import MAX_DEPTH

MODEL = "ollama/granite3.2:2b"


def _error(text: object) -> SpanQueryError:
    with pytest.raises(SpanQueryError) as err:
        from_json(text)  # type: ignore[arg-type]
    return err.value


# ---------------------------------------------------------------------------------------------
# spnl samples


def test_spnl_chat_as_g_over_cross() -> None:
    text = json.dumps({"g": {
        "model": MODEL,
        "input": {"cross": [
            {"system": "You are a helpful assistant."},
            {"user": "Hi!"}, {"assistant": "Hello."}, {"user": "Tell me a joke."},
        ]},
        "max_tokens": 100, "temperature": 0.0,
    }})
    assert from_json(text) == Generate(
        Cross((System("You are a helpful assistant."), User("Hi!"), Assistant("Hello."),
               User("Tell me a joke."))),
        100, 0.0, model=MODEL,
    )


def test_chat_extension() -> None:
    obj = {"chat": {"model": "m", "messages": [{"system": "s"}, {"user": "u"}],
                    "max_tokens": 3, "temperature": 0.1}}
    node = from_json(obj)
    assert node == Chat((System("s"), User("u")), 3, 0.1, "m")
    assert to_obj(node) == obj
    assert from_json({"chat": {"messages": [{"user": "u"}]}}) == Chat((User("u"),))


def test_spnl_rag_with_plus() -> None:
    text = """
    {"g": {"model": "m", "input": {"cross": [
        {"system": "Answer from the documents."},
        {"plus": [{"user": "doc A"}, {"user": "doc B"}]},
        {"user": "Which is older?"}]},
      "max_tokens": 256, "temperature": 0.0}}
    """
    assert from_json(text) == Generate(
        Cross((System("Answer from the documents."), Plus((User("doc A"), User("doc B"))),
               User("Which is older?"))),
        256, 0.0, model="m",
    )


def test_spnl_judge_generator_with_repeat() -> None:
    text = json.dumps({"g": {
        "model": MODEL,
        "input": {"cross": [
            {"system": "You judge emails by scoring them"},
            {"plus": [{"repeat": {"n": 4, "g": {
                "model": MODEL, "input": {"user": "Generate a fun email"},
                "max_tokens": 1000, "temperature": 0.3}}}]},
            {"user": "I am looking for a job at NASA"},
        ]},
        "max_tokens": 0, "temperature": 0.6,
    }})
    generator = Generate(User("Generate a fun email"), 1000, 0.3, model=MODEL)
    expected = Generate(
        Cross((System("You judge emails by scoring them"), Plus((Repeat(4, generator),)),
               User("I am looking for a job at NASA"))),
        model=MODEL,
    )
    assert from_json(text) == expected
    # A canonical compact spnl text is reproduced exactly.
    assert to_json(from_json(text)) == json.dumps(json.loads(text), separators=(",", ":"))


@pytest.mark.parametrize(
    "repeat_body",
    [
        {"n": 2, "g": {"input": {"user": "x"}, "max_tokens": 5}},
        {"n": 2, "g": {"g": {"input": {"user": "x"}, "max_tokens": 5}}},
        {"n": 2, "query": {"g": {"input": {"user": "x"}, "max_tokens": 5}}},
        {"n": 2, "generate": {"input": {"user": "x"}, "max_tokens": 5}},
    ],
    ids=["current", "g-wrapped", "query", "generate"],
)
def test_repeat_spellings(repeat_body: dict) -> None:
    node = from_json({"repeat": repeat_body})
    assert node == Repeat(2, Generate(User("x"), 5))
    assert to_obj(node) == {"repeat": {"n": 2, "g": {
        "input": {"user": "x"}, "max_tokens": 5, "temperature": 0.6}}}


def test_spnl_map() -> None:
    obj = {"map": {"metadata": {"model": "m", "max_tokens": 10, "temperature": 0.2},
                   "inputs": ["one", "two"]}}
    node = from_json(obj)
    assert node == Map(("one", "two"), 10, 0.2, "m")
    assert to_obj(node) == obj
    assert to_obj(Map(("x",))) == {"map": {"metadata": {"max_tokens": 0, "temperature": 0.6},
                                           "inputs": ["x"]}}


def test_spnl_list_as_input_is_a_seq() -> None:
    text = '{"g": {"model": "ollama/granite3.2:2b", "input": [{"user": "Hello world"}]}}'
    node = from_json(text)
    assert node == Generate(Seq((User("Hello world"),), as_list=True), model=MODEL)
    assert to_json(node) == (
        '{"g":{"model":"ollama/granite3.2:2b","input":[{"user":"Hello world"}],'
        '"max_tokens":0,"temperature":0.6}}'
    )


def test_spnl_seq() -> None:
    node = from_json({"seq": [{"system": "s"}, {"user": "u"}]})
    assert node == Seq((System("s"), User("u")), as_list=False)
    assert to_obj(node) == {"seq": [{"system": "s"}, {"user": "u"}]}


def test_g_defaults_follow_spnl() -> None:
    node = from_json({"g": {"input": {"user": "x"}}})
    assert node == Generate(User("x"), 0, 0.6, 1, None, False)
    assert isinstance(node.temperature, float)
    assert from_json({"g": {"input": {"user": "x"}, "temperature": 1}}).temperature == 1.0


# ---------------------------------------------------------------------------------------------
# Extensions and canonical writing


def test_fragment_spellings() -> None:
    assert from_json({"fragment": "doc"}) == Fragment("doc")
    assert from_json({"fragment": {"text": "doc"}}) == Fragment("doc")
    assert from_json({"fragment": {"text": "doc", "source": "a.txt"}}) == Fragment("doc", "a.txt")
    assert to_obj(Fragment("doc")) == {"fragment": "doc"}
    assert to_obj(Fragment("doc", "a.txt")) == {"fragment": {"text": "doc", "source": "a.txt"}}


def test_retrieve_and_prepare() -> None:
    obj = {"retrieve": {"query": "q", "fragments": [{"fragment": "a"}, {"fragment": "b"}]}}
    assert from_json(obj) == Retrieve("q", (Fragment("a"), Fragment("b")))
    assert to_obj(from_json(obj)) == obj
    prep = {"prepare": {"plus": [{"fragment": "a"}]}}
    assert from_json(prep) == Prepare(Plus((Fragment("a"),)))
    assert to_obj(from_json(prep)) == prep


def test_g_key_order_and_optional_fields() -> None:
    node = Generate(User("x"), 5, 0.5, n=3, model="m", inline_prompt=True)
    assert to_json(node) == (
        '{"g":{"model":"m","input":{"user":"x"},"max_tokens":5,"temperature":0.5,'
        '"n":3,"inline_prompt":true}}'
    )
    assert to_json(Generate(User("x"))) == (
        '{"g":{"input":{"user":"x"},"max_tokens":0,"temperature":0.6}}'
    )


def test_to_json_indent_matches_pretty_printing() -> None:
    node = Generate(Cross((System("s"), Plus((Fragment("é"),)))), model="m")
    assert to_json(node, indent=2) == json.dumps(to_obj(node), indent=2, ensure_ascii=False)
    assert "é" in to_json(node)


def test_to_json_validates() -> None:
    with pytest.raises(SpanQueryError, match="plus has no children"):
        to_json(Generate(Plus(())))


@pytest.mark.parametrize(
    "text",
    [
        '{"g":{"model":"m","input":{"cross":[{"system":"s"},{"plus":[{"user":"a"},'
        '{"user":"b"}]},{"user":"q"}]},"max_tokens":64,"temperature":0.0}}',
        '{"plus":[{"repeat":{"n":3,"g":{"input":{"user":"x"},"max_tokens":1,'
        '"temperature":1.5}}},{"map":{"metadata":{"max_tokens":0,"temperature":0.6},'
        '"inputs":["a"]}}]}',
        '[{"system":"s"},{"seq":[{"assistant":"a"}]},{"fragment":{"text":"t","source":"u"}}]',
    ],
)
def test_canonical_text_round_trips_exactly(text: str) -> None:
    assert to_json(from_json(text)) == text


# ---------------------------------------------------------------------------------------------
# Errors


def test_unknown_node_path() -> None:
    text = '{"g": {"input": {"cross": [{"system": "s"}, {"user": "u"}, {"plux": []}]}}}'
    err = _error(text)
    assert str(err) == "input.cross[2]: unknown node 'plux'"
    assert err.path == "input.cross[2]"


def test_unsupported_spnl_node() -> None:
    err = _error({"plus": [{"zip": {"first": {"user": "a"}, "second": {"user": "b"}}}]})
    assert str(err) == "plus[0]: spnl node 'zip' is not supported here"


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ('{"g": ', 1, 7),
        ('{"user": "x",}', 1, 14),
        ('{"user": "x"} extra', 1, 15),
        ('{\n  "plus": [\n    {"user": "a"}\n    {"user": "b"}\n  ]\n}', 4, 5),
        ('{"user": NaN}', 1, 10),
        ("", 1, 1),
        ('{"user": "unterminated}', 1, 10),
        ("{'user': 'x'}", 1, 2),
    ],
)
def test_malformed_json(text: str, line: int, column: int) -> None:
    err = _error(text)
    assert err.path == ""
    assert err.message.startswith(f"malformed JSON at line {line} column {column}: ")


def test_malformed_json_message_names_the_problem() -> None:
    assert _error('{"user" "x"}').message == (
        "malformed JSON at line 1 column 9: Expecting ':' delimiter"
    )


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"user": "a", "system": "b"},
         "a node object must have exactly one key, got 2: 'user', 'system'"),
        ({}, "a node object must have exactly one key, got 0: none"),
    ],
)
def test_node_objects_need_exactly_one_key(obj: dict, message: str) -> None:
    err = _error({"cross": [{"user": "ok"}, obj]})
    assert (err.path, err.message) == ("cross[1]", message)


@pytest.mark.parametrize(
    ("obj", "path", "message"),
    [
        ({"user": 5}, "", "user must be a string, got a number"),
        ({"plus": {"user": "a"}}, "", "plus must be a list, got an object"),
        ({"g": {"input": {"user": "x"}, "max_tokens": "5"}}, "",
         "g max_tokens must be an integer, got a string"),
        ({"g": {"input": {"user": "x"}, "max_tokens": 5.0}}, "",
         "g max_tokens must be an integer, got a number"),
        ({"g": {"input": {"user": "x"}, "temperature": "hot"}}, "",
         "g temperature must be a number, got a string"),
        ({"g": {"input": {"user": "x"}, "temperature": True}}, "",
         "g temperature must be a number, got a boolean"),
        ({"g": {"input": {"user": "x"}, "model": 7}}, "", "g model must be a string, got a number"),
        ({"g": {"input": {"user": "x"}, "n": None}}, "", "g n must be an integer, got null"),
        ({"g": {"input": {"user": "x"}, "inline_prompt": "yes"}}, "",
         "g inline_prompt must be a boolean, got a string"),
        ({"g": {"input": {"user": "x"}, "max_token": 5}}, "",
         "unknown field 'max_token' in g (expected model, input, max_tokens, temperature, n, "
         "inline_prompt, align, top_p, top_k, seed, logprobs, presence_penalty, frequency_penalty, "
         "stop, json_schema, tools, tool_choice, used_tools)"),
        ({"g": "x"}, "", "g must be an object, got a string"),
        ({"plus": ["text"]}, "plus[0]", "expected a node object, got a string"),
        ({"fragment": {"source": "s"}}, "", "fragment is missing 'text'"),
        ({"repeat": {"g": {"input": {"user": "x"}}}}, "", "repeat is missing 'n'"),
        ({"repeat": {"n": 2}}, "", "repeat needs exactly one of 'g', 'query' or 'generate'"),
        ({"repeat": {"n": 2, "query": {"user": "x"}}}, "repeat.g",
         "a repeat's query must be a g node"),
        ({"map": {"metadata": {}, "inputs": ["a", 3]}}, "map.inputs[1]",
         "map input must be a string, got a number"),
        ({"map": {"metadata": {}}}, "", "map is missing 'inputs'"),
        ({"chat": {"model": "m"}}, "", "chat is missing 'messages'"),
        ({"retrieve": {"query": "q"}}, "", "retrieve is missing 'fragments'"),
        ({"retrieve": {"query": "q", "fragments": [{"user": "u"}]}}, "retrieve.fragments[0]",
         "a retrieve holds fragments, got user"),
        ({"prepare": {"cross": [{"user": "u"}]}}, "prepare",
         "a prepare must wrap a plus, got cross"),
    ],
)
def test_field_errors(obj: dict, path: str, message: str) -> None:
    err = _error(obj)
    assert (err.path, err.message) == (path, message)


def test_missing_input() -> None:
    err = _error('{"cross": [{"user": "a"}, {"g": {"model": "m", "max_tokens": 3}}]}')
    assert str(err) == "cross[1]: g is missing 'input'"


def test_range_errors_come_from_validate_with_paths() -> None:
    err = _error({"g": {"input": {"plus": [{"g": {"input": {"user": "x"}, "max_tokens": -1}}]}}})
    assert err.path == "input.plus[0]"
    assert err.message.startswith("max_tokens must be an integer between 0 and 1000000")
    err = _error({"repeat": {"n": 0, "g": {"input": {"user": "x"}}}})
    assert err.message.startswith("n must be an integer between 1 and 128")
    assert _error({"plus": []}).message == "plus has no children"
    assert _error([]).message == "seq has no children"


def test_repeat_inner_paths() -> None:
    err = _error({"repeat": {"n": 2, "g": {"input": {"bogus": 1}}}})
    assert str(err) == "repeat.g.input: unknown node 'bogus'"
    err = _error({"repeat": {"n": 2, "query": {"g": {"input": {"user": 1}}}}})
    assert str(err) == "repeat.g.input: user must be a string, got a number"


def test_invalid_utf8_bytes() -> None:
    err = _error(b'{"user": "caf\xe9"}')
    assert err.path == ""
    assert err.message.startswith("query is not valid UTF-8: byte 0xe9 at offset 13")
    with_bom = _error(b'\xef\xbb\xbf{"user": "\xff"}')
    assert with_bom.message.startswith("query is not valid UTF-8: byte 0xff at offset 13")


def test_bytes_input_is_accepted() -> None:
    assert from_json('{"user": "café"}'.encode()) == User("café")
    assert from_json(bytearray(b'{"user": "x"}')) == User("x")
    assert from_json(b'\xef\xbb\xbf{"user": "bom"}') == User("bom")


def test_non_json_python_value() -> None:
    assert _error(42).message == "expected a node object, got a number"


def test_5000_deep_json_nesting_is_a_span_query_error() -> None:
    text = '{"plus": [' * 5000 + '{"user": "x"}' + "]}" * 5000
    err = _error(text)
    assert err.path == ""
    assert "deeper than" in err.message
    assert _error("[" * 100_000).path == ""


def test_5000_deep_python_object_is_a_span_query_error() -> None:
    obj: object = {"user": "x"}
    for _ in range(5000):
        obj = {"plus": [obj]}
    assert _error(obj).message == f"tree is deeper than {MAX_DEPTH} levels"


def test_tree_depth_limit_applies_to_json_within_bracket_limit() -> None:
    ok = '{"plus": [' * (MAX_DEPTH - 1) + '{"user": "x"}' + "]}" * (MAX_DEPTH - 1)
    assert isinstance(from_json(ok), Plus)
    too_deep = '{"plus": [' * MAX_DEPTH + '{"user": "x"}' + "]}" * MAX_DEPTH
    assert _error(too_deep).message == f"tree is deeper than {MAX_DEPTH} levels"


def test_deepest_valid_trees_round_trip() -> None:
    node: object = User("leaf")
    for _ in range(MAX_DEPTH - 1):
        node = Generate(node)  # type: ignore[arg-type]
    text = to_json(node)  # type: ignore[arg-type]
    assert text.count("{") == 2 * MAX_DEPTH - 1
    assert to_json(from_json(text)) == text  # == on such deep trees would recurse
    assert _error({"g": {"input": json.loads(text)}}).message == (
        f"tree is deeper than {MAX_DEPTH} levels"
    )


# ---------------------------------------------------------------------------------------------
# The JSON reader and writer themselves

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids,
                                                               max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json_values)
def test_parse_json_agrees_with_json_loads(value: object) -> None:
    for text in (json.dumps(value), json.dumps(value, indent=1, ensure_ascii=False)):
        assert parse_json(text) == json.loads(text)


@settings(max_examples=300, deadline=None)
@given(_json_values)
def test_dump_json_agrees_with_json_dumps(value: object) -> None:
    assert dump_json(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert dump_json(value, indent=2) == json.dumps(value, indent=2, ensure_ascii=False)


def test_dump_json_rejects_non_json() -> None:
    with pytest.raises(ValueError):
        dump_json(float("nan"))
    with pytest.raises(TypeError):
        dump_json({1: "a"})
    with pytest.raises(TypeError):
        dump_json({"a": object()})


def test_parse_json_is_strict() -> None:
    for bad in ("Infinity", "-", "01", "[1,]", '{"a":1,}', '"\x01"', "tru", "[1 2]"):
        with pytest.raises(SpanQueryError, match="^malformed JSON"):
            parse_json(bad)
    assert parse_json(' {"a": [1, 2.5e3, -0, true, null, "x\\u00e9"]} ') == {
        "a": [1, 2500.0, 0, True, None, "xé"]
    }


def test_sampling_options_round_trip_and_unknown_ones_are_refused() -> None:
    text = ('{"g": {"input": {"user": "hi"}, "max_tokens": 5, "top_p": 0.9, "top_k": 4, '
            '"seed": 3, "stop": ["\\n"], "tools": [{"type": "function", "function": '
            '{"name": "f", "description": "d", "parameters": {"type": "object"}}}], '
            '"tool_choice": "f"}}')
    node = from_json(text)
    assert node.sampling.top_k == 4 and node.sampling.tools[0].name == "f"
    assert from_json(to_json(node)) == node
    schema = from_json('{"g": {"input": {"user": "hi"}, "json_schema": {"type": "object"}}}')
    assert schema.sampling.json_schema == '{"type":"object"}'
    plain = from_json('{"g": {"input": {"user": "hi"}}}')
    assert "top_p" not in to_json(plain)  # spnl queries are written as before
    with pytest.raises(SpanQueryError, match="g: tool_choice must be one of"):
        from_json('{"g": {"input": {"user": "hi"}, "tool_choice": "f"}}')
    with pytest.raises(SpanQueryError, match="top_p must be a number"):
        from_json('{"g": {"input": {"user": "hi"}, "top_p": "high"}}')
