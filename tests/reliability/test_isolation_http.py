"""Isolation over HTTP on the small-pool server (48 blocks of 32 tokens): copies a hit
needs never find the pool empty, tenants with different cache salts share no span, and requests
through vLLM's own endpoints cannot borrow span semantics."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from dev_server import (
    SMALL_POOL_BLOCKS,
    rag_payload,
    reset_server_cache,
    run_query,
    span_counters,
)
from shared_server import ServerSlot

from span_workflows.compiler.model import BASE_MODEL_NAME
from span_workflows.query.ir import Cross, Fragment, Plus, System, User
from span_workflows.query.json_ir import to_obj

pytestmark = pytest.mark.engine

SYSTEM = "Answer in a few words using the documents."
SPAN = ("The lighthouse of Varnholm was built by Elira Quast in 1842 and still guides the "
        "fishing boats home. ") * 3
OTHER = "The bakery on Mill Street sells rye bread every morning except Sunday. " * 2
SALTED_DOCS = [f"Document {i}: the {w} of Tessmere is painted {c} and opens at {i + 6}." * 2
               for i, (w, c) in enumerate([("gate", "blue"), ("tower", "green"),
                                           ("market", "red")])]


def _query(docs: list[str], question: str, max_tokens: int = 6,
           weights: str | None = None) -> dict:
    payload = rag_payload(SYSTEM, docs, question, max_tokens)
    return payload if weights is None else {**payload, "weights": weights}


@pytest.fixture(scope="module")
def http(small_pool: ServerSlot) -> httpx.Client:
    return small_pool.client


_run = run_query
_counters = span_counters


def _into(out: dict[str, str], http: httpx.Client, payload: dict) -> None:
    out["b"] = _run(http, payload)["text"]


def test_a_copy_never_finds_the_pool_empty(http: httpx.Client) -> None:
    """A decodes while holding SPAN at one position; B reads SPAN at another and its tail asks
    for about every free block, so B's copies of SPAN must be reserved when B is admitted (or B
    waits): both finish, and both answer as they do alone, for every tail size."""
    # on the base, whose answer runs long: A must still decode while B is admitted
    a = _query([SPAN], "Who built the lighthouse? Then tell me all you know about it.",
               max_tokens=160, weights=BASE_MODEL_NAME)
    waited = _counters(http)["deferred_hits"]
    reset_server_cache(http)
    alone_a = _run(http, a)["text"]  # A's request is the same at every tail size
    # B's tail from about the blocks A leaves free (A holds ~9) to more than that
    for tail_blocks in range(SMALL_POOL_BLOCKS - 14, SMALL_POOL_BLOCKS - 7, 2):
        question = "Who built the lighthouse? " + "Think step by step. " * (6 * tail_blocks)
        b = _query([OTHER, SPAN], question, max_tokens=4, weights=BASE_MODEL_NAME)
        reset_server_cache(http)
        alone_b = _run(http, b)["text"]
        reset_server_cache(http)
        _run(http, _query([SPAN], "Who?", max_tokens=1,  # SPAN cached, at its first position
                          weights=BASE_MODEL_NAME))
        together: dict[str, str] = {}
        events: list[dict] = []
        with httpx.Client(base_url=str(http.base_url), timeout=300) as other:
            with other.stream("POST", "/v1/query/execute", json={**a, "stream": True}) as live:
                worker = None
                for line in live.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    events.append(json.loads(line[5:]))
                    if worker is None:  # A is decoding and holds SPAN: now send B
                        worker = threading.Thread(target=_into, args=(together, http, b))
                        worker.start()
            assert worker is not None
            worker.join()
        together["a"] = "".join(e.get("delta", "") for e in events)
        assert together["b"] == alone_b, tail_blocks
        assert together["a"] == alone_a, tail_blocks
        assert http.get("/health").status_code == 200
    assert _counters(http)["deferred_hits"] > waited  # some B had to wait for room to copy


def test_cache_salt_keeps_tenants_apart_over_http(http: httpx.Client) -> None:
    reset_server_cache(http)
    q = _query(SALTED_DOCS, "What colour is the tower?")
    first = _run(http, {**q, "cache_salt": "tenant-a"})
    again = _run(http, {**q, "cache_salt": "tenant-a"})
    other = _run(http, {**q, "cache_salt": "tenant-b"})
    # one prepare per span (each computes the prefix too)
    assert first["metrics"]["prepare_requests"] == len(SALTED_DOCS)
    assert again["metrics"]["prepare_requests"] == 0
    assert again["usage"]["cached_tokens"] > 0
    # Tenant b finds none of tenant a's spans: it prepares every one of them itself.
    assert other["metrics"]["prepare_requests"] == len(SALTED_DOCS)
    assert first["text"] == again["text"] == other["text"]
    bad = http.post("/v1/query/execute", json={**q, "cache_salt": 7})
    assert bad.status_code == 400 and bad.json()["error"]["path"] == "cache_salt"


def test_vllm_endpoints_cannot_borrow_span_semantics(http: httpx.Client) -> None:
    """The same tokens as a span query, with a forged span layout, through /v1/completions:
    no span block is hit or repositioned for it."""

    from span_workflows.compiler.compile import Compiler
    from span_workflows.compiler.model import load_tokenizer
    from span_workflows.query.ir import Generate as G

    model = http.get("/v1/models").json()["data"][0]["id"]
    tokenizer = load_tokenizer()
    node = G(Cross((System(SYSTEM), Plus((Fragment(OTHER), Fragment(SPAN))),
                    User("Who built the lighthouse?"))), max_tokens=4, temperature=0.0)
    tq = Compiler.for_tokenizer(tokenizer, 32).compile_generate(node)
    reset_server_cache(http)
    _run(http, {"query": to_obj(node), "optimize": False})
    before = _counters(http)
    for xargs in ({"span_layout": {"key": "guessed", "segments": [list(s) for s in
                                                                  tq.segments]}},
                  {"span_layout": "anything"}):
        answer = http.post("/v1/completions", json={
            "model": model, "prompt": tq.token_ids, "max_tokens": 4, "temperature": 0.0,
            "vllm_xargs": xargs})
        assert answer.status_code in (200, 400), answer.text[:300]
    after = _counters(http)
    assert after["hit_blocks"] == before["hit_blocks"]
    assert after["repositioned_tokens"] == before["repositioned_tokens"]
