"""Concurrency and load: 64 concurrent requests whose spans overlap at different positions, on
the embedded engine and over HTTP; every output equals the same request run alone on a fresh
cache (``engine.reset_cache()``; the server's ``/reset_prefix_cache``, on in vLLM's dev mode).
No request is lost, bad and unauthenticated requests mixed into the load get 4xx, and the
server stays healthy. Each load wave is bounded: it must finish within LOAD_LIMIT_S."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import psutil
import pytest
from dev_server import reset_server_cache
from shared_server import API_KEY

from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User
from span_workflows.query.json_ir import to_obj

pytestmark = pytest.mark.engine

CONCURRENT = 64
DISTINCT = 8  # distinct requests among the 64 (each run alone once for reference)
#: Bound of one load wave (seconds). A machine shared with other heavy jobs may need more:
#: SPAN_LOAD_LIMIT_S=300 (the figures in tests/README.md say what was measured where).
LOAD_LIMIT_S = float(os.environ.get("SPAN_LOAD_LIMIT_S", "60"))
DOCS = [
    "The Gull Rock lighthouse was built in 1871 and is painted red and white. ",
    "Keeper Ada Lind kept the light burning for forty-two winters without a miss. " * 2,
    "The foghorn sounds twice every thirty seconds in thick weather. ",
    "Supplies reach the rock by boat on Tuesdays when the sea allows it. " * 2,
    "A storm in 1903 broke every pane of the lantern room in one night. ",
    "Visitors may climb the 118 steps on summer weekends only, weather permitting. " * 2,
]
SYSTEMS = ["Answer briefly.", "You answer questions about the lighthouse using only the "
           "documents you are given. Be brief, exact and polite, and never invent facts."]
QUESTIONS = ["Who kept the light?", "When was it built?", "What broke in 1903?",
             "How do supplies arrive?"]
FIGURES: dict[str, float] = {}


def distinct_queries(count: int = DISTINCT) -> list[Generate]:
    """Queries whose documents sit at different positions: prefixes of one or two blocks,
    different subsets and orders (kept: run with optimize off)."""
    rng = random.Random(7)
    out = []
    for i in range(count):
        docs = rng.sample(DOCS, rng.choice([2, 3, 4]))
        out.append(Generate(Cross((System(SYSTEMS[i % 2]), Plus(tuple(map(Fragment, docs))),
                                   User(QUESTIONS[i % len(QUESTIONS)]))),
                            max_tokens=4, temperature=0.0))
    return out


def workload() -> list[int]:
    """Indices of the 64 concurrent requests: every distinct query 8 times, shuffled."""
    order = [i % DISTINCT for i in range(CONCURRENT)]
    random.Random(11).shuffle(order)
    return order


def body(query: Generate) -> dict:
    return {"query": to_obj(query), "optimize": False}


@pytest.fixture(scope="module")
def server(shared_server):
    """The shared dev-mode server (its cache is reset before every reference run)."""
    return shared_server.proc, shared_server.url


@pytest.fixture(scope="module")
def http(server):
    _, url = server
    with httpx.Client(base_url=url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def alone_embedded(engine) -> list[tuple[str, list[int]]]:
    out = []
    for query in distinct_queries():
        engine.reset_cache()
        result = engine.execute(query, optimize_query=False)
        out.append((result.text, result.token_ids))
    return out


def test_embedded_64_concurrent_requests_equal_their_alone_runs(engine, alone_embedded) -> None:
    queries = distinct_queries()
    order = workload()
    engine.reset_cache()
    before = engine.span_stats()
    started = time.perf_counter()
    results = engine.execute_many([queries[i] for i in order], optimize_query=False)
    wall = time.perf_counter() - started
    after = engine.span_stats()
    assert len(results) == CONCURRENT
    mismatched = [(i, r.text, alone_embedded[i][0]) for i, r in zip(order, results, strict=True)
                  if (r.text, r.token_ids) != alone_embedded[i]]
    assert not mismatched, mismatched[:4]
    assert after["hit_blocks"] > before["hit_blocks"]
    assert after["repositioned_tokens"] > before["repositioned_tokens"]
    assert wall < LOAD_LIMIT_S
    FIGURES["embedded_rps"] = CONCURRENT / wall
    print(f"\nembedded: {CONCURRENT} concurrent requests in {wall:.1f} s = "
          f"{CONCURRENT / wall:.2f} requests/s; span stats delta "
          f"{ {k: after[k] - before[k] for k in after} }")


def test_server_alone_equals_embedded_alone(http: httpx.Client, alone_embedded) -> None:
    """Same model and code: the server's alone outputs are the embedded engine's (checked on a
    few requests), so either can serve as the fresh reference."""
    for i in (0, 5):
        reset_server_cache(http)
        answer = http.post("/v1/query/execute", json=body(distinct_queries()[i]))
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"] == alone_embedded[i][0]


async def _fire(url: str, bodies: list[tuple[str, object, dict]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=LOAD_LIMIT_S, limits=limits) as client:
        async def one(kind: str, payload: object, headers: dict) -> httpx.Response:
            if isinstance(payload, bytes):
                return await client.post("/v1/query/execute", content=payload, headers=headers)
            return await client.post("/v1/query/execute", json=payload, headers=headers)

        return await asyncio.wait_for(
            asyncio.gather(*(one(*b) for b in bodies)), LOAD_LIMIT_S + 10)


def test_http_64_concurrent_requests_equal_their_alone_runs(server, http: httpx.Client) -> None:
    proc, url = server
    queries = distinct_queries()
    alone = []
    for query in queries:
        reset_server_cache(http)
        answer = http.post("/v1/query/execute", json=body(query))
        assert answer.status_code == 200, answer.text
        alone.append(answer.json()["text"])
    reset_server_cache(http)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    good = [("good", body(queries[i]), auth) for i in workload()]
    bad = [
        ("bad", b'{"g": ', auth),
        ("bad", {"g": {"input": {"plux": []}}}, auth),
        ("bad", b'{"g": {"input": ' * 3000 + b"{}" + b"}}" * 3000, auth),
        ("bad", {"g": {"input": {"user": "x"}, "max_tokens": -1}}, auth),
        ("bad", {"g": {"input": {"user": "word " * 5000}, "max_tokens": 4}}, auth),  # > context
        ("bad", b"\xc3\x28", auth),
        ("unauthorized", body(queries[0]), {}),
        ("unauthorized", body(queries[1]), {"Authorization": "Bearer wrong"}),
    ]
    mixed = good + bad
    random.Random(3).shuffle(mixed)
    started = time.perf_counter()
    answers = asyncio.run(_fire(url, mixed))
    wall = time.perf_counter() - started
    texts: dict[int, list[str]] = {}
    for (kind, payload, _), answer in zip(mixed, answers, strict=True):
        if kind == "good":
            assert answer.status_code == 200, answer.text[:300]
            index = next(i for i, q in enumerate(queries) if body(q) == payload)
            texts.setdefault(index, []).append(answer.json()["text"])
        elif kind == "bad":
            assert answer.status_code == 400, answer.text[:300]
            assert answer.json()["error"]["type"] == "invalid_query"
        else:
            assert answer.status_code == 401
    assert sum(len(v) for v in texts.values()) == CONCURRENT  # no request lost
    mismatched = [(i, t, alone[i]) for i, ts in texts.items() for t in ts if t != alone[i]]
    assert not mismatched, mismatched[:4]
    assert wall < LOAD_LIMIT_S
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert proc.poll() is None
    FIGURES["http_rps"] = CONCURRENT / wall
    print(f"\nHTTP: {CONCURRENT} concurrent requests (+{len(bad)} bad/unauthorized) in "
          f"{wall:.1f} s = {CONCURRENT / wall:.2f} requests/s")


def test_server_listens_on_loopback_only(server) -> None:
    proc, url = server
    ports = set()
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        ports |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    port = int(url.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in ports
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in ports), ports
