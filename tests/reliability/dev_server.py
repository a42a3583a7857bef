"""A span server in vLLM's dev mode, whose prefix cache can be reset between requests, for the
tests that compare every output with the same request run alone on a fresh cache."""

from __future__ import annotations

import re
import time

import httpx
from shared_server import Setting

from span_workflows.serving.launch import ServerOptions


def reset_server_cache(client: httpx.Client) -> None:
    """Empty the server's prefix cache, waiting (up to 30 s) until no request holds blocks."""
    deadline = time.monotonic() + 30
    while True:
        answer = client.post("/reset_prefix_cache")
        assert answer.status_code == 200, answer.text
        if answer.json().get("success"):
            return
        assert time.monotonic() < deadline, "the server's prefix cache never became resettable"
        time.sleep(0.2)


#: The small pool's size: 48 blocks of 32 tokens, about three 4-document queries.
SMALL_POOL_BLOCKS = 48

#: The small pool's settings: 48 blocks, at most 8 sequences, a context that fits the pool
#: (vLLM starts only if its longest request fits in the pool, less its reserved block).
SMALL_POOL = Setting("small-pool", ServerOptions(
    kv_cache_gib=1, max_model_len=32 * (SMALL_POOL_BLOCKS - 2),
    extra_args=("--num-gpu-blocks-override", str(SMALL_POOL_BLOCKS), "--max-num-seqs", "8")),
    timeout=400)


def run_query(client: httpx.Client, payload: dict) -> dict:
    """POST a query to ``/v1/query/execute``; its JSON answer (asserting a 200)."""
    answer = client.post("/v1/query/execute", json=payload)
    assert answer.status_code == 200, answer.text[:500]
    return answer.json()


def span_counters(client: httpx.Client) -> dict[str, float]:
    """The server's ``span_*_total`` counters from ``/metrics``, by name."""
    text = client.get("/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^span_(\w+)_total (\S+)$", text, re.M)}


def rag_payload(system: str, docs: list[str], question: str, max_tokens: int) -> dict:
    """A ``/v1/query/execute`` body: a greedy RAG query with the documents in the order given
    (not reordered by the optimizer)."""
    from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User
    from span_workflows.query.json_ir import to_obj

    node = Generate(Cross((System(system), Plus(tuple(Fragment(d) for d in docs)),
                           User(question))), max_tokens=max_tokens, temperature=0.0)
    return {"query": to_obj(node), "optimize": False}
