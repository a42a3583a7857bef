"""A span server in vLLM's dev mode, whose prefix cache can be reset between requests, for the
tests that compare every output with the same request run alone on a fresh cache."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
from process_leaks import shm_names
from shared_server import start_dev_mode_server

from span_workflows.serving.launch import free_port, stop_server_process


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


class SmallPoolServer:
    """A dev-mode server whose KV cache holds only :data:`SMALL_POOL_BLOCKS` blocks, shared by
    the reliability modules that need a pool they can fill (cache pressure, isolation) and the
    one that kills a server (faults): each start loads vLLM and the model again, so the fault
    test kills this server and :meth:`start` brings it back on the same port for the modules
    after it. ``client`` is a client of the current process (a new one after each start)."""

    def __init__(self, log_dir: Path, max_model_len: int = 32 * (SMALL_POOL_BLOCKS - 2),
                 max_num_seqs: int = 8) -> None:
        self.log_dir = log_dir
        # vLLM starts only if its longest request fits in the pool (less its reserved block)
        self.options = {"kv_cache_gib": 1, "timeout": 400, "max_model_len": max_model_len,
                        "extra_args": ["--num-gpu-blocks-override", str(SMALL_POOL_BLOCKS),
                                       "--max-num-seqs", str(max_num_seqs)]}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        #: the files in /dev/shm just before the current process started
        self.shm_before_start: set[str] = set()
        self._client: httpx.Client | None = None

    def start(self) -> None:
        """Start the server (again) on its port; returns once it answers ``/health``."""
        self.starts += 1
        self.shm_before_start = shm_names()
        log = self.log_dir / f"server-{self.starts}.log"
        self.proc, url = start_dev_mode_server(log, port=self.port, **self.options)
        assert url == self.url
        if self._client is not None:
            self._client.close()
        self._client = httpx.Client(base_url=self.url, timeout=300)

    @property
    def client(self) -> httpx.Client:
        assert self._client is not None, "the small-pool server was never started"
        return self._client

    def stop(self) -> None:
        """Stop the current process (killed ones included) and close the client."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is not None:
            stop_server_process(self.proc)
            assert self.proc.poll() is not None


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
    from span_workflows.ir import Cross, Fragment, Generate, Plus, System, User
    from span_workflows.json_ir import to_obj

    node = Generate(Cross((System(system), Plus(tuple(Fragment(d) for d in docs)),
                           User(question))), max_tokens=max_tokens, temperature=0.0)
    return {"query": to_obj(node), "optimize": False}
