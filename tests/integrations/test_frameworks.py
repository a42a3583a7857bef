"""Which backend a framework model runs on, and the chunks it streams (fake backends)."""

from __future__ import annotations

from typing import Any

from span_workflows.frameworks import Chunk, QueryRunner
from span_workflows.query.builders import g, user
from span_workflows.runtime.result import Metrics, Result
from span_workflows.runtime.streaming import TextStream
from span_workflows.serving.client import SpanServer

QUERY = g(user("hi"), max_tokens=2)
RESULT = Result("abc", Metrics(0.1, 3, 1, 2), ["abc"])


class FakeBackend:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def execute(self, query: Any, **options: Any) -> Result:
        self.calls.append(options)
        return RESULT

    def stream(self, query: Any, **options: Any) -> TextStream:
        self.calls.append(options)
        return TextStream(iter(["a", "b", "c", RESULT]))


class Model(QueryRunner):
    def __init__(self, **fields: Any) -> None:
        defaults = {"backend": None, "server_url": None, "engine": None, "api_key": None,
                    "timeout": None, "max_retries": 0, "span_options": None, "cache_salt": None,
                    "weights": None}
        self.__dict__.update({**defaults, **fields})
        self._server = None
        self._last_result = None


def test_the_backend_is_chosen_backend_then_server_then_engine() -> None:
    backend, engine = FakeBackend(), FakeBackend()
    assert Model(backend=backend, engine=engine, server_url="http://x").query_backend() is backend
    model = Model(engine=engine, server_url="http://x", timeout=5, max_retries=2)
    server = model.query_backend()
    assert isinstance(server, SpanServer) and model.query_backend() is server
    assert (server.url, server.timeout, server.retries) == ("http://x", 5, 2)
    assert Model(engine=engine).query_backend() is engine


def test_options_go_with_every_query_when_set() -> None:
    backend = FakeBackend()
    model = Model(backend=backend, cache_salt="tenant")
    assert model.execute(QUERY) is RESULT and model.last_result is RESULT
    assert backend.calls == [{"cache_salt": "tenant"}]
    Model(backend=backend, weights="adapter").execute(QUERY)
    assert backend.calls[-1] == {"weights": "adapter"}


def test_both_framework_models_declare_the_weights_they_run_on() -> None:
    from langchain_span_workflows import SpanChatModel
    from llama_index.llms.span_workflows import SpanLLM

    backend = FakeBackend()
    for model in (SpanChatModel(backend=backend, weights="adapter"),
                  SpanLLM(backend=backend, weights="adapter")):
        model.execute(QUERY)
        assert backend.calls[-1]["weights"] == "adapter"


def test_a_stream_holds_back_one_delta_to_send_with_the_result() -> None:
    model = Model(backend=FakeBackend())
    chunks = list(model.stream_query(QUERY))
    assert chunks == [Chunk("a"), Chunk("b"), Chunk("c", RESULT)]
    assert model.last_result is RESULT
