"""Chat-completions requests with ``spans``: from an OpenAI body to a span query, and back."""

from __future__ import annotations

import json

import pytest

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Cross, Fragment, Plus, System, User
from span_workflows.runtime.result import Metrics, Result
from span_workflows.serving import chat_wire

DOC_A = "The Eiffel Tower was completed in 1889 for the World's Fair."
DOC_B = "Mount Fuji is the highest mountain in Japan."


def _body(**extra: object) -> dict:
    return {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Documents:\n{DOC_A}\n\n{DOC_B}\n\nQuestion: where?"}],
        "spans": [DOC_B, DOC_A], **extra}


WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_listed_texts_become_one_plus_wherever_the_template_put_them() -> None:
    chat = chat_wire.parse_span_chat(_body(max_tokens=7, temperature=0, n=2, seed=5,
                                           stop="END", top_p=0.5, cache_salt="t",
                                           stream=True,
                                           stream_options={"include_usage": True}))
    assert chat.node.input == Cross((System("Be brief."), User("Documents:"),
                                     Plus((Fragment(DOC_A), Fragment(DOC_B))),
                                     User("Question: where?")))
    assert (chat.node.max_tokens, chat.node.temperature, chat.node.n) == (7, 0.0, 2)
    assert chat.sampling == {"seed": 5, "stop": ["END"], "top_p": 0.5}
    assert (chat.model, chat.stream, chat.include_usage, chat.cache_salt) == ("m", True, True,
                                                                              "t")


def test_defaults_come_from_the_model_then_openai() -> None:
    chat = chat_wire.parse_span_chat(_body(), {"temperature": 0.3, "top_k": 20})
    assert chat.node.temperature == 0.3 and chat.sampling == {"top_k": 20}
    assert chat.node.max_tokens == 0  # up to the context limit
    assert chat_wire.parse_span_chat(_body()).node.temperature == 1.0


def test_text_parts_and_developer_role() -> None:
    body = _body()
    body["messages"][0] = {"role": "developer", "content": [{"type": "text", "text": "Hi."}]}
    assert chat_wire.parse_span_chat(body).node.input.children[0] == System("Hi.")


@pytest.mark.parametrize(("change", "path", "words"), [
    ({"spans": [DOC_A, "Not in the prompt at all."]}, "spans", "Not in the prompt"),
    ({"spans": []}, "spans", "non-empty list"),
    ({"spans": [DOC_A, 3]}, "spans[1]", "non-empty string"),
    ({"spans": ["Tower was complete"]}, "spans", "not found"),  # inside a word only
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "non-empty 'name'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tools", "tool_choice"),
    ({"tools": [WEATHER], "n": 2}, "n", "must be 1"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "JSON schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"messages": [{"role": "tool", "content": DOC_A, "tool_call_id": "c1"}]},
     "messages[0].tool_call_id", "names no tool call"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "robot", "content": DOC_A}]}, "messages[0].role", "'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "only text"),
])
def test_bad_requests_name_the_field(change: dict, path: str, words: str) -> None:
    body = {**_body(), **change}
    with pytest.raises(SpanQueryError) as err:
        chat_wire.parse_span_chat(body)
    assert err.value.path == path and words in str(err.value)
    answer = chat_wire.query_error_body(err.value)
    assert answer["error"]["code"] == 400 and answer["error"]["param"] == path


def test_has_spans_looks_at_the_top_level_key_only() -> None:
    assert chat_wire.has_spans(json.dumps(_body()).encode())
    assert not chat_wire.has_spans(b'{"messages": [{"role": "user", "content": "\\"spans\\""}]}')
    assert not chat_wire.has_spans(b'not json "spans"')


def test_answer_shapes() -> None:
    result = Result("a", Metrics(0.1, 50, 45, 3, prepared_tokens=5), ["a", "b"])
    body = chat_wire.completion_body(result, request_id="chatcmpl-1", created=1, model="m",
                                     finish_reasons={1: "length"})
    assert body["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in body["choices"]] == [(0, "a", "stop"), (1, "b", "length")]
    assert body["usage"] == {"prompt_tokens": 50, "completion_tokens": 3, "total_tokens": 53,
                             "prompt_tokens_details": {"cached_tokens": 40}}
    last = chat_wire.usage_chunk_body(result, request_id="x", created=1, model="m")
    assert last["object"] == "chat.completion.chunk" and last["choices"] == []


def test_tools_and_a_tool_turn_become_the_engine_s_sampling_and_history() -> None:
    body = _body(tools=[WEATHER], tool_choice={"type": "function",
                                               "function": {"name": "weather"}})
    body["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain."},
        {"role": "tool", "tool_call_id": "c1", "content": "Sun."}]
    chat = chat_wire.parse_span_chat(body)
    sampling = chat.node.sampling
    assert chat.uses_tools and [t.name for t in sampling.tools] == ["weather"]
    assert sampling.tool_choice == "weather"
    kids = chat.node.input.children
    assert json.loads(kids[-2].text)["tool_calls"][1] == {"name": "weather",
                                                          "arguments": {"city": "Tokyo"}}
    # the two results of one turn commute
    assert kids[-1] == Plus((User("Tool weather returned: Rain."),
                             User("Tool weather returned: Sun.")))


def test_response_format_constrains_the_answer_to_a_schema() -> None:
    schema = {"type": "object", "properties": {"year": {"type": "integer"}}}
    chat = chat_wire.parse_span_chat(_body(response_format={
        "type": "json_schema", "json_schema": {"name": "y", "schema": schema}}))
    assert json.loads(chat.node.sampling.json_schema) == schema and not chat.uses_tools
    loose = chat_wire.parse_span_chat(_body(response_format={"type": "json_object"}))
    assert json.loads(loose.node.sampling.json_schema) == {"type": "object"}


def test_a_tool_answer_is_shaped_as_openai_tool_calls() -> None:
    from span_workflows.query.sampling import ToolCall

    calls = [ToolCall("weather", {"city": "Paris"}, "call_1")]
    result = Result("", Metrics(0.1, 50, 0, 9), ['{"tool_calls":[...]}'],
                    finish_reason="tool_calls", tool_calls=calls)
    body = chat_wire.completion_body(result, request_id="r", created=1, model="m",
                                     finish_reasons={}, uses_tools=True)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call == {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    plain = Result("Sunny.", Metrics(0.1, 50, 0, 9), ['{"content":"Sunny."}'])
    body = chat_wire.completion_body(plain, request_id="r", created=1, model="m",
                                     finish_reasons={}, uses_tools=True)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
