"""Cache pressure: the small-pool server, whose KV cache (48 blocks of 32 tokens,
``--num-gpu-blocks-override``) holds about three queries while the working set is ~20
documents of 3 blocks. Evictions happen every few requests; every output must equal the same
request run alone on a fresh cache (``/reset_prefix_cache``), including spans that were
repositioned or duplicated, then evicted and re-created."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

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

pytestmark = pytest.mark.engine

BLOCKS = SMALL_POOL_BLOCKS
TOPICS = ["otters", "glaciers", "violins", "comets", "bakeries", "tides", "falcons", "deserts",
          "lanterns", "orchards", "volcanoes", "libraries", "harbors", "meteors", "beehives",
          "canyons", "ferries", "mosses", "windmills", "coral reefs"]
#: 20 documents of 72-100 tokens: each span padded to 3 blocks, 60 blocks in all (> the cache).
DOCS = [f"Document {i} is about {t}. " + f"People who study {t} write long notes about "
        f"{t}, compare {t} across seasons and argue about {t} at length. " * 3
        for i, t in enumerate(TOPICS)]
SYSTEM = "Answer in a few words using the documents."
STATS: dict[str, int] = {}


def query(docs: list[int], question: str = "Which topics appear?", system: str = SYSTEM,
          max_tokens: int = 5) -> dict:
    return rag_payload(system, [DOCS[d] for d in docs], question, max_tokens)


@pytest.fixture(scope="module")
def http(small_pool: ServerSlot) -> httpx.Client:
    return small_pool.client


run = run_query


class Alone:
    """Outputs of requests run alone on a fresh cache (memoized by request)."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.texts: dict[str, str] = {}

    def __call__(self, payload: dict) -> str:
        key = repr(payload)
        if key not in self.texts:
            reset_server_cache(self.http)
            self.texts[key] = run(self.http, payload)["text"]
        return self.texts[key]


@pytest.fixture(scope="module")
def alone(http: httpx.Client) -> Alone:
    return Alone(http)


def _workload(seed: int, count: int) -> list[list[int]]:
    """``count`` queries of 4 documents; every 5 consecutive ones cover all 20 documents
    (60 blocks > the cache), each document in a shuffled order."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        docs = [(4 * i + k + i // 5) % len(DOCS) for k in range(4)]
        rng.shuffle(docs)
        out.append(docs)
    return out


def test_sequential_requests_under_eviction_equal_alone(http, alone) -> None:
    distinct = _workload(1, 10)
    expected = [alone(query(d)) for d in distinct]
    reset_server_cache(http)
    evicted = 0
    for round_ in range(3):
        for i in random.Random(round_).sample(range(len(distinct)), len(distinct)):
            answer = run(http, query(distinct[i]))
            if round_ and answer["metrics"]["prepare_requests"] > 0:
                evicted += 1  # its spans were cached before, so they were evicted since
            assert answer["text"] == expected[i], (distinct[i], round_)
    STATS["sequential_requests"] = 3 * len(distinct)
    STATS["sequential_re_prepared"] = evicted
    assert evicted >= len(distinct)  # eviction every few requests, not a warm cache


def test_repositioned_block_evicted_and_recreated(http, alone) -> None:
    a, b, c, d = 0, 1, 2, 3
    orders = [[a, b, c, d], [d, c, b, a], [b, d, a, c]]
    expected = [alone(query(o)) for o in orders]
    flood = [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
    reset_server_cache(http)
    before = span_counters(http)
    assert run(http, query(orders[0]))["text"] == expected[0]
    moved = run(http, query(orders[1]))
    assert moved["metrics"]["prepare_requests"] == 0  # every span a cache hit ...
    assert moved["text"] == expected[1]
    middle = span_counters(http)
    assert middle["repositioned_tokens"] > before["repositioned_tokens"]  # ... re-rotated
    for docs in flood:
        run(http, query(docs))
    again = run(http, query(orders[2]))
    assert again["metrics"]["prepare_requests"] > 0  # evicted, re-created
    assert again["text"] == expected[2]
    assert run(http, query(orders[0]))["text"] == expected[0]


def _concurrent(http: httpx.Client, payloads: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(lambda p: run(http, p), payloads))


def test_duplicated_blocks_under_pressure_equal_alone(http, alone) -> None:
    """Concurrent requests read the same documents at different positions (the scheduler
    duplicates blocks), while the tiny cache evicts between rounds."""
    rounds = [
        [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]],
        [[4, 5, 6, 7], [7, 4, 5, 6], [8, 9, 10, 11]],
        [[0, 1, 2, 3], [2, 0, 3, 1], [12, 13, 14, 15]],
        [[16, 17, 18, 19], [19, 18, 17, 16], [0, 4, 8, 12]],
    ]
    expected = {repr(o): alone(query(o)) for r in rounds for o in r}
    reset_server_cache(http)
    before = span_counters(http)
    mismatched = []
    for r in rounds:
        for order, answer in zip(r, _concurrent(http, [query(o) for o in r]), strict=True):
            if answer["text"] != expected[repr(order)]:
                mismatched.append((order, answer["text"], expected[repr(order)],
                                   answer["metrics"]))
    after = span_counters(http)
    STATS["concurrent_requests"] = sum(len(r) for r in rounds)
    STATS["duplicated_blocks"] = int(after["duplicated_blocks"] - before["duplicated_blocks"])
    STATS["repositioned_tokens"] = int(after["repositioned_tokens"]
                                       - before["repositioned_tokens"])
    assert not mismatched, mismatched
    assert http.get("/health").status_code == 200


def _on(weights: str, payload: dict) -> dict:
    """``payload`` on ``weights`` (the base's or an adapter's name), asked by name."""
    return {**payload, "weights": weights}


def test_base_and_adapter_share_no_block_and_stay_right_under_pressure(http, alone) -> None:
    """The same documents under the base and the span-ready adapter: the second weights'
    first run computes every span again (no block of the other weights is read), and
    concurrent mixed requests under eviction equal each one run alone."""
    from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME

    docs = [0, 1, 2, 3]
    base, adapter = _on(BASE_MODEL_NAME, query(docs)), _on(SPAN_MODEL_NAME, query(docs))
    expected = {w: alone(p) for w, p in ((BASE_MODEL_NAME, base), (SPAN_MODEL_NAME, adapter))}
    reset_server_cache(http)
    first = run(http, base)
    assert first["metrics"]["weights"] == BASE_MODEL_NAME
    second = run(http, adapter)
    assert second["metrics"]["weights"] == SPAN_MODEL_NAME
    assert [first["text"], second["text"]] == [expected[BASE_MODEL_NAME],
                                               expected[SPAN_MODEL_NAME]]
    for answer in (first, second):
        assert answer["metrics"]["prepare_requests"] == len(docs)
        # everything read from the cache was computed by this query's own prepares
        assert answer["metrics"]["cached_tokens"] <= answer["metrics"]["prepared_tokens"]
    assert run(http, query(docs))["metrics"]["weights"] == SPAN_MODEL_NAME  # routed
    pairs = [[_on(w, query(o)) for w in (BASE_MODEL_NAME, SPAN_MODEL_NAME)]
             for o in _workload(7, 6)]  # 6 x 4 documents: 72 blocks of each weights
    truth = [[alone(p) for p in pair] for pair in pairs]
    reset_server_cache(http)
    for pair, expected_pair in zip(pairs, truth, strict=True):
        assert [a["text"] for a in _concurrent(http, pair)] == expected_pair
    STATS["mixed_weights_requests"] = 2 * len(pairs)


def test_report_pressure_figures() -> None:
    print(f"\ncache pressure ({BLOCKS} blocks of 32 tokens): {STATS}")
