"""``span-workflows bench route --mode real``: the routers over real span-engine replicas.

A local Ray runs the application of :mod:`span_workflows.scaleout.deployment` once per router
(``span-affinity``, Ray Serve LLM's ``PrefixCacheAffinityRouter``, Ray Serve's default
power-of-two, and one replica as the single-node reference) and the same small trace is sent
to each, ``concurrency`` queries at a time (default one: concurrent queries that miss the same
document on one replica each prepare it, which a hit rate counted from prepares would charge
twice). The replicas stay up from one router to the next (Ray
reconfigures them; the ingress is replaced); each run uses its own ``cache_salt``, so no run
reads what an earlier one cached, and starts with one warm-up query per replica.

Measured per run: hit rate = spans read from the cache / spans (a query's documents not
prepared again; the documents are of equal size, so this is also the share of span tokens),
p50/p95 TTFT as the server reports it (prepares included), requests per replica (from the
``x-span-replica`` answer header).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from span_workflows.scaleout.simulate import TraceOptions, make_trace

SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
REAL_ROUTERS = ("span-affinity", "prefix-affinity", "power-of-two", "single")


def real_rows(replicas: int = 2, requests: int = 24, documents: int = 12, k: int = 3,
              zipf_s: float = 0.9, imbalance_threshold: int = 2, seed: int = 0,
              doc_tokens: int = 96, kv_cache_gib: int = 1, num_cpus: float = 0.5,
              concurrency: int = 1, progress: bool = True) -> list[dict[str, Any]]:
    """Run the trace against every router of :data:`REAL_ROUTERS`; one row per router."""
    import ray
    from ray import serve

    from span_workflows.compiler.model import load_tokenizer
    from span_workflows.scaleout.deployment import APP_NAME, ClusterOptions, build_app
    from span_workflows.serving.launch import ServerOptions, free_port

    trace = make_trace(TraceOptions(requests=requests, documents=documents, k=k, zipf_s=zipf_s,
                                    doc_tokens=(doc_tokens, doc_tokens), seed=seed))
    tokenizer = load_tokenizer(progress=progress)
    texts = _documents(tokenizer, documents, doc_tokens, seed)
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        for router in REAL_ROUTERS:
            options = ClusterOptions(
                replicas=1 if router == "single" else replicas, num_cpus=num_cpus,
                server=ServerOptions(kv_cache_gib=kv_cache_gib),
                imbalance_threshold=imbalance_threshold,
                router="power-of-two" if router == "single" else router)
            started = time.monotonic()
            serve.run(build_app(options), name=APP_NAME, route_prefix="/")
            _wait_ready(url)
            if progress:
                print(f"route real: {router} up in {time.monotonic() - started:.0f} s",
                      flush=True)
            # one query per replica first (warm-up, its own salt: nothing of it is reused)
            warm = [type(trace[0])(tuple(range(k)), trace[0].doc_tokens)] * options.replicas
            asyncio.run(_send(url, warm, texts, f"warmup-{router}-{seed}", options.replicas))
            answers = asyncio.run(_send(url, trace, texts, f"route-{router}-{seed}",
                                        concurrency))
            rows.append(_row(router, options.replicas, answers, k))
    finally:
        serve.shutdown()
        ray.shutdown()
    single = next(r["hit_rate"] for r in rows if r["router"] == "single")
    for row in rows:
        row["single_node_hit_rate"] = single
        row["cluster_replicas"] = replicas
    return rows


def _documents(tokenizer: Any, count: int, doc_tokens: int, seed: int) -> list[str]:
    """``count`` distinct documents of ``doc_tokens`` tokens each (random words, reproducible
    from ``seed``)."""
    import random

    rng = random.Random(seed)
    words = ["cache", "span", "replica", "router", "token", "block", "query", "engine", "ray",
             "document", "position", "rotation", "prefix", "hash", "load", "queue", "model"]
    texts = []
    for i in range(count):
        text = f"Document {i}. " + " ".join(rng.choice(words) for _ in range(2 * doc_tokens))
        ids = tokenizer.encode(text, add_special_tokens=False)[:doc_tokens]
        texts.append(tokenizer.decode(ids))
    return texts


def _wait_ready(url: str, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=20).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


async def _send(url: str, trace: list[Any], texts: list[str], salt: str,
                concurrency: int) -> list[tuple[dict[str, Any], str]]:
    import httpx

    from span_workflows.query.builders import rag
    from span_workflows.serving import wire

    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int, query: Any) -> tuple[dict[str, Any], str]:
        node = rag(SYSTEM, [texts[d] for d in query.docs], f"Question {i}: which topic first?",
                   max_tokens=4)
        async with gate:
            resp = await client.post(url + wire.EXECUTE_PATH, timeout=600,
                                     json=wire.request_body(node, stream=False, cache_salt=salt))
        resp.raise_for_status()
        return resp.json(), resp.headers.get("x-span-replica", "")

    async with httpx.AsyncClient() as client:
        tasks = []
        for i, query in enumerate(trace):
            tasks.append(asyncio.create_task(one(client, i, query)))
            await asyncio.sleep(0.05)  # arrivals in trace order
        return await asyncio.gather(*tasks)


def _row(router: str, replicas: int, answers: list[tuple[dict[str, Any], str]],
         k: int) -> dict[str, Any]:
    prepares = sum(int(a["metrics"].get("prepare_requests", 0)) for a, _ in answers)
    spans = k * len(answers)
    ttfts = sorted(float(a["metrics"]["ttft_s"]) for a, _ in answers)
    counts: dict[str, int] = {}
    for _, replica in answers:
        counts[replica] = counts.get(replica, 0) + 1
    mean = len(answers) / replicas
    return {
        "mode": "real", "router": router, "replicas": replicas, "requests": len(answers),
        "hit_rate": round(1 - prepares / spans, 4), "single_node_hit_rate": 0.0,
        "p50_ttft_s": round(statistics.median(ttfts), 4),
        "p95_ttft_s": round(ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))], 4),
        "max_load_ratio": round(max(counts.values()) / mean, 3),
    }


__all__ = ["REAL_ROUTERS", "real_rows"]
