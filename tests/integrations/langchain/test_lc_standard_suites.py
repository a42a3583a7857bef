"""LangChain's standard test suites (langchain-tests) for SpanChatModel and SpanRetriever.

Features the model does not have are skipped through the suites' own switches (each property
below says why: multimodal inputs, a per-call model switch); the rest, tool calling and
structured output included, runs on the real engine of the session (``engine`` fixture)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import (
    ChatModelIntegrationTests,
    RetrieversIntegrationTests,
)
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_span_workflows import SpanChatModel, SpanRetriever

SERVER_URL = "http://127.0.0.1:8000"


class TestSpanChatModelUnit(ChatModelUnitTests):
    """Construction-only tests: no engine is started (it is created on first use)."""

    @property
    def chat_model_class(self) -> type[SpanChatModel]:
        return SpanChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"SPAN_WORKFLOWS_SERVER_URL": SERVER_URL, "SPAN_WORKFLOWS_API_KEY": "secret"},
            {},
            {"server_url": SERVER_URL, "api_key": "secret"},
        )


@pytest.mark.engine
@pytest.mark.asyncio
class TestSpanChatModelIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _session_engine(self, engine: Any) -> None:
        type(self).engine = engine

    @property
    def chat_model_class(self) -> type[SpanChatModel]:
        return SpanChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Short answers keep the suite fast on a CPU; a tool call or a joke in JSON needs
        # a few dozen tokens.
        return {"engine": type(self).engine, "max_tokens": 48}

    @property
    def supports_model_override(self) -> bool:
        """An engine serves the one model it loaded: no per-call model switch."""
        return False

    @property
    def has_tool_calling(self) -> bool:
        """Tool calls are generated under vLLM's structured outputs."""
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        """Text-only model (SmolLM2): no images, audio, video or PDF."""
        return False


@pytest.mark.engine
@pytest.mark.asyncio
class TestSpanRetrieverIntegration(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _corpus(self, corpus: list[str]) -> None:
        type(self).texts = corpus

    @property
    def retriever_constructor(self) -> type[SpanRetriever]:
        return SpanRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"texts": type(self).texts, "k": 4}

    @property
    def retriever_query_example(self) -> str:
        return "Who built the lighthouse?"
