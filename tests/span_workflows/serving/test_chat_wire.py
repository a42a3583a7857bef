"""Chat-completions requests with ``spans``: from an OpenAI body to a span query, and back."""

from __future__ import annotations

import json

import pytest

from span_workflows.errors import SpanQueryError
from span_workflows.ir import Cross, Fragment, Plus, System, User
from span_workflows.result import Metrics, Result
from span_workflows.serving import chat_wire

DOC_A = "The Eiffel Tower was completed in 1889 for the World's Fair."
DOC_B = "Mount Fuji is the highest mountain in Japan."


def _body(**extra: object) -> dict:
    return {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Documents:\n{DOC_A}\n\n{DOC_B}\n\nQuestion: where?"}],
        "spans": [DOC_B, DOC_A], **extra}


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
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"messages": [{"role": "tool", "content": DOC_A}]}, "messages[0].role", "'tool'"),
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
