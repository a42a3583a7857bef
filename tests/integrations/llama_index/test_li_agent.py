"""LlamaIndex's ``FunctionAgent`` with ``SpanLLM`` on the real engine: the same two-tool task
as the LangGraph agent, through ``chat_with_tools`` / ``get_tool_calls_from_response``."""

from __future__ import annotations

import asyncio

import pytest
from agent_task import QUESTION, SYSTEM, get_population, get_weather
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ChatMessage, MessageRole

from llama_index.llms.span_workflows import SpanLLM

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(engine) -> SpanLLM:
    return SpanLLM(engine=engine, max_tokens=64, tool_once_per_turn=True)


def test_span_llm_is_a_function_calling_llm_with_the_engine_context_window(llm, engine) -> None:
    meta = llm.metadata
    assert meta.is_function_calling_model
    assert meta.context_window == engine.max_model_len - engine.block_size


def test_function_agent_runs_the_two_tool_task(llm) -> None:
    agent = FunctionAgent(tools=[get_weather, get_population], llm=llm, system_prompt=SYSTEM)

    async def run() -> object:
        return await agent.run(QUESTION, max_iterations=10)

    response = asyncio.run(run())
    called = {c.tool_name for c in response.tool_calls}
    assert called == {"get_weather", "get_population"}
    assert all("Varnholm" in str(c.tool_output) for c in response.tool_calls)
    assert response.response.role == MessageRole.ASSISTANT and response.response.content
    assert llm.last_result.finish_reason == "stop"
    assert llm.last_result.metrics.cached_tokens > 0  # the history came from the cache


def test_chat_with_tools_required_returns_a_tool_call(llm) -> None:
    from llama_index.core.tools import FunctionTool

    tools = [FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(get_population)]
    response = llm.chat_with_tools(tools, user_msg="How many people live in Oslo?",
                                   tool_required=True)
    calls = llm.get_tool_calls_from_response(response)
    assert calls and calls[0].tool_name in {"get_weather", "get_population"}
    assert isinstance(calls[0].tool_kwargs["city"], str)
    with pytest.raises(ValueError, match="SpanLLM: unsupported sampling option"):
        llm.chat([ChatMessage(role=MessageRole.USER, content="hi")], best_of=2)
