"""One server, two weights: the shared server serves the span-ready adapter as LoRA beside the
base, lists both as models, routes span queries to the adapter, and says which weights ran."""

from __future__ import annotations

import json

import httpx
import pytest
from shared_server import API_KEY

from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME
from span_workflows.query.builders import chat, rag
from span_workflows.query.json_ir import to_obj
from span_workflows.serving.client import SpanServer

pytestmark = pytest.mark.engine

DOCS = ["The lighthouse at Varn was built by Ilse Marr in 1871.",
        "The Varn ferry leaves at seven and returns at noon.",
        "Varn's harbour is guarded by a red lighthouse and a stone pier."]
SYSTEM = "Answer in one sentence from the documents."


def test_models_lists_the_base_and_the_adapter(http: httpx.Client) -> None:
    models = http.get("/v1/models").json()["data"]
    ids = [m["id"] for m in models]
    assert BASE_MODEL_NAME in ids and SPAN_MODEL_NAME in ids
    adapter = next(m for m in models if m["id"] == SPAN_MODEL_NAME)
    assert adapter["root"].endswith(SPAN_MODEL_NAME)


def test_span_queries_run_on_the_adapter_and_chats_on_the_base(shared_server) -> None:
    server = SpanServer(shared_server.url, api_key=API_KEY)
    first = server.execute(rag(SYSTEM, DOCS, "Who built the lighthouse?", max_tokens=16))
    assert first.metrics.weights == SPAN_MODEL_NAME and first.metrics.link_requests == 0
    again = server.execute(rag(SYSTEM, DOCS[::-1], "When was it built?", max_tokens=16))
    assert again.metrics.weights == SPAN_MODEL_NAME
    assert again.metrics.prepare_requests == 0 and again.metrics.engine_steps == 1
    assert server.execute(chat("Say hello.", max_tokens=4)).metrics.weights == BASE_MODEL_NAME
    # the default model's name is no request for the base: the query is routed
    default = rag(SYSTEM, DOCS, "Who built the lighthouse?", max_tokens=16,
                  model=BASE_MODEL_NAME)
    assert server.execute(default).metrics.weights == SPAN_MODEL_NAME


def test_a_query_naming_weights_runs_on_them(http: httpx.Client) -> None:
    body = to_obj(chat("Say hello.", max_tokens=4, model=SPAN_MODEL_NAME))
    answer = http.post("/v1/query/execute", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["metrics"]["weights"] == SPAN_MODEL_NAME


def test_chat_completions_with_spans_route_and_answer_with_the_weights(http) -> None:
    context = "\n\n".join(DOCS)
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Documents:\n{context}\n\n"
                                                     "Question: Who built the lighthouse?"}],
            "max_tokens": 16, "temperature": 0, "spans": DOCS}
    routed = http.post("/v1/chat/completions", json={**body, "model": BASE_MODEL_NAME})
    assert routed.status_code == 200, routed.text
    assert routed.json()["model"] == SPAN_MODEL_NAME  # the default name: routed
    named = http.post("/v1/chat/completions", json={**body, "model": SPAN_MODEL_NAME})
    assert named.status_code == 200 and named.json()["model"] == SPAN_MODEL_NAME
    unknown = http.post("/v1/chat/completions", json={**body, "model": "nope"})
    assert unknown.status_code == 404
    plain = {k: v for k, v in body.items() if k != "spans"}
    stock = http.post("/v1/chat/completions", json={**plain, "model": SPAN_MODEL_NAME})
    assert stock.status_code == 200  # vLLM's own endpoint serves the adapter by name
    streamed = http.post("/v1/chat/completions",
                         json={**body, "model": BASE_MODEL_NAME, "stream": True,
                               "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert len(chunks) >= 2 and {c["model"] for c in chunks} == {SPAN_MODEL_NAME}
