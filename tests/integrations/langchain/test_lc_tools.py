"""``SpanChatModel``'s tool plumbing without an engine: what ``bind_tools`` binds, how a tool
history becomes a span query, and which options are refused."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from langchain_span_workflows import SpanChatModel
from span_workflows.query.ir import Assistant, Cross, Plus, User
from span_workflows.query.sampling import answer_schema


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "sunny"


@tool
def get_population(city: str) -> str:
    """How many people live in a city."""
    return "many"


HISTORY = [
    HumanMessage("Weather and population of Oslo?"),
    AIMessage("", tool_calls=[
        {"name": "get_weather", "args": {"city": "Oslo"}, "id": "c1"},
        {"name": "get_population", "args": {"city": "Oslo"}, "id": "c2"}]),
    ToolMessage("sunny", tool_call_id="c1"),
    ToolMessage("700,000", tool_call_id="c2"),
]


def test_bind_tools_binds_openai_tools_and_maps_tool_choice() -> None:
    llm = SpanChatModel()
    bound = llm.bind_tools([get_weather, get_population], tool_choice="any")
    assert bound.kwargs["tool_choice"] == "required"
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == [
        "get_weather", "get_population"]
    assert llm.bind_tools([get_weather], tool_choice="get_weather").kwargs["tool_choice"] == (
        "get_weather")
    assert llm.bind_tools([get_weather]).kwargs["tool_choice"] == "auto"
    with pytest.raises(ValueError, match="tool_choice must be auto, required, any, none or "
                                         "one of the bound tools"):
        llm.bind_tools([get_weather], tool_choice="get_time")


def test_a_tool_history_becomes_commuting_tool_results_after_the_rendered_calls() -> None:
    llm = SpanChatModel()
    tools = llm.bind_tools([get_weather, get_population]).kwargs
    query = llm.to_query(HISTORY, **tools)
    assert isinstance(query.input, Cross)
    user, call, results = query.input.children
    assert user == User("Weather and population of Oslo?")
    assert isinstance(call, Assistant)
    assert json.loads(call.text) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_population", "arguments": {"city": "Oslo"}}]}
    # The two results of one turn commute: one plus, each named after the call it answers.
    assert results == Plus((User("Tool get_weather returned: sunny"),
                            User("Tool get_population returned: 700,000")))
    assert query.sampling.tool_choice == "auto"
    assert [t.name for t in query.sampling.tools] == ["get_weather", "get_population"]


def test_sampling_options_come_from_fields_and_calls_and_unknown_ones_are_refused() -> None:
    llm = SpanChatModel(top_p=0.8, seed=5, stop=["END"])
    query = llm.to_query([HumanMessage("hi")], top_k=7, frequency_penalty=0.3)
    s = query.sampling
    assert (s.top_p, s.seed, s.top_k, s.frequency_penalty, s.stop) == (
        0.8, 5, 7, 0.3, ("END",))
    with pytest.raises(ValueError, match="SpanChatModel: unsupported sampling option.*"
                                         "best_of"):
        llm.to_query([HumanMessage("hi")], best_of=3)
    with pytest.raises(ValueError, match="cannot switch to model 'gpt-4o'"):
        llm.to_query([HumanMessage("hi")], model="gpt-4o")


def test_json_schema_method_binds_the_schema_as_the_output_constraint() -> None:
    schema = {"title": "Joke", "type": "object",
              "properties": {"setup": {"type": "string"}}, "required": ["setup"]}
    structured = SpanChatModel().with_structured_output(schema, method="json_schema")
    bound = structured.first
    query = bound.bound.to_query([HumanMessage("joke")], **bound.kwargs)
    assert json.loads(query.sampling.json_schema)["required"] == ["setup"]


def test_tool_once_per_turn_offers_only_the_tools_not_yet_called() -> None:
    llm = SpanChatModel(tool_once_per_turn=True)
    tools = llm.bind_tools([get_weather, get_population]).kwargs
    first = llm.to_query(HISTORY[:1], **tools).sampling
    assert first.used_tools == ()
    after_one = llm.to_query([*HISTORY[:1], AIMessage("", tool_calls=[
        {"name": "get_weather", "args": {"city": "Oslo"}, "id": "c1"}]),
        ToolMessage("sunny", tool_call_id="c1")], **tools).sampling
    assert after_one.used_tools == ("get_weather",)
    schema = answer_schema(after_one)
    calls = schema["anyOf"][0]["properties"]["tool_calls"]["items"]
    assert calls["properties"]["name"] == {"const": "get_population"}
    # Both called: only a plain answer is left; a new human message starts a new turn.
    assert answer_schema(llm.to_query(HISTORY, **tools).sampling)["required"] == ["content"]
    again = llm.to_query([*HISTORY, HumanMessage("And Bergen?")], **tools).sampling
    assert again.used_tools == ()
