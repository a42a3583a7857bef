"""``span-workflows serve --replicas 1 --ray-address ...`` on this machine: a real SmolLM2-135M
span engine on Ray Serve, on this package's Ray cluster, behind the ingress, answering the single
server's API. (Routing among several replicas, their faults and their merged metrics are
``test_ray.py``'s, on stand-in servers: the same ingress, keyer and router.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from span_workflows.compiler.model import DEFAULT_MODEL_NAME
from span_workflows.query.builders import rag
from span_workflows.serving import wire
from span_workflows.serving.client import SpanServer
from span_workflows.serving.launch import free_port

pytest.importorskip("ray")
DOCS = [f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(70)) for i in range(4)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, local_ray):
    """The CLI's application with one replica on the package's Ray (``local_ray``, which
    also keeps Ray's memory monitor off); yields its URL (stopped with Ctrl-C at the end)."""
    import ray

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "span_workflows.apps.cli.main", "serve", "--replicas", "1",
             "--kv-cache-gib", "1", "--num-cpus", "0.5", "--port", str(port),
             "--ray-address", ray.get_runtime_context().gcs_address],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 480
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + wire.HEALTH_PATH, timeout=15).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def post(url: str, docs: list[str], question: str) -> httpx.Response:
    body = wire.request_body(rag("Answer briefly.", docs, question, max_tokens=4), stream=False)
    return httpx.post(url + wire.EXECUTE_PATH, json=body, timeout=300)


@pytest.mark.engine
def test_a_replica_answers_and_a_shuffled_query_reads_its_spans_from_cache(replicas) -> None:
    first = post(replicas, DOCS[:3], "Which document comes first?")
    assert first.status_code == 200, first.text
    assert first.json()["metrics"]["prepare_requests"] > 0  # the documents were computed
    again = post(replicas, [DOCS[2], DOCS[0], DOCS[1]], "Which is the last one?")
    assert again.status_code == 200, again.text
    assert again.headers["x-span-replica"] == first.headers["x-span-replica"]
    assert again.json()["metrics"]["prepare_requests"] == 0  # all spans read from cache
    # the project's client works against the ingress as against one server
    result = SpanServer(replicas).execute(rag("Answer briefly.", DOCS[1:3], "Why?",
                                              max_tokens=4))
    assert result.text and result.metrics.generated_tokens > 0
    text = httpx.get(replicas + "/metrics", timeout=60).text
    labelled = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("span_hit_blocks_total{")}
    assert labelled == {first.headers["x-span-replica"]}


@pytest.mark.engine
def test_an_openai_client_gets_span_reuse_through_the_ingress(replicas) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=replicas + "/v1", api_key="unused")
    docs = [f"Record {i}: " + " ".join(f"r{i}z{j}" for j in range(60)) for i in range(3)]

    def ask(order: list[str], question: str):
        return client.chat.completions.with_raw_response.create(
            model=DEFAULT_MODEL_NAME, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "\n\n".join(order) + "\n\n" + question}],
            extra_body={"spans": order})

    first = ask(docs, "Which record is first?")
    second = ask([docs[2], docs[0], docs[1]], "Which record is last?")
    assert first.headers["x-span-replica"] == second.headers["x-span-replica"]
    usage = second.parse().usage
    # the three records (about 60 tokens each) come from the cache in their new order
    assert usage.prompt_tokens_details.cached_tokens >= 150, usage
