"""A LangGraph prebuilt ReAct agent (``create_react_agent``) with ``SpanChatModel`` on the
real engine: the model calls both tools, reads their results and answers; from its second call
on, the history is read from the cache. On the engine's routing (the base) and on the
span-ready adapter."""

from __future__ import annotations

import pytest
from agent_task import QUESTION, SYSTEM, get_population, get_weather
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

from langchain_span_workflows import SpanChatModel
from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME

pytestmark = pytest.mark.engine

TOOLS = [tool(get_weather), tool(get_population)]


@pytest.fixture(scope="module", params=[None, SPAN_MODEL_NAME], ids=["routed", "adapter"])
def run(engine, request) -> dict:
    """The agent on the engine's routing (tool calls on the base), and on the span-ready
    adapter (``weights``: it was trained with tool turns too)."""
    engine.reset_cache()
    model = SpanChatModel(engine=engine, max_tokens=64, tool_once_per_turn=True,
                          weights=request.param)
    messages = create_react_agent(model, TOOLS).invoke(
        {"messages": [SystemMessage(SYSTEM), HumanMessage(QUESTION)]},
        {"recursion_limit": 12},
    )
    assert model.last_result.metrics.weights == (request.param or BASE_MODEL_NAME)
    return messages


def test_agent_calls_both_tools_and_answers(run: dict) -> None:
    messages = run["messages"]
    called = {m.name for m in messages if isinstance(m, ToolMessage)}
    assert called == {"get_weather", "get_population"}
    for m in messages:
        if isinstance(m, ToolMessage):
            assert "Varnholm" in m.content  # the model passed the city as the argument
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content
    assert final.response_metadata["finish_reason"] == "stop"
    calls = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    assert all(m.response_metadata["finish_reason"] == "tool_calls" for m in calls)


def test_later_model_calls_read_the_history_from_the_cache(run: dict) -> None:
    turns = [m for m in run["messages"] if isinstance(m, AIMessage)]
    assert len(turns) >= 2
    first, second = turns[0].usage_metadata, turns[1].usage_metadata
    block = 32
    # The second prompt begins with the whole first prompt: all its full blocks are hits.
    assert second["input_token_details"]["cache_read"] >= first["input_tokens"] // block * block
    assert second["input_tokens"] > first["input_tokens"]
