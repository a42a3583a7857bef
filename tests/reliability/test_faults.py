"""Faults: the server is killed (SIGKILL, whole process group) in the middle of a streaming and
a plain request; the client raises ServerUnavailableError naming the URL (and retries while a
server cannot be reached, when asked to); no process of the dead server is left; a restarted
server on the same port answers a request that was sent while it was still down, correctly and
from an empty cache. The server killed is the session's (``shared_server.ServerSlot``), running
with the small pool the modules before this one filled; its restart here comes up in the shared
settings, for every HTTP module after it (a restart costs a start either way). (That an
engine shut down at the end of a user's command leaves no child process and no shared memory
behind is checked on the CLI's ``run``, tests/apps/cli/test_cli.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from dev_server import SMALL_POOL
from process_leaks import mapped_by_others, shm_names
from shared_server import API_KEY, SHARED, ServerSlot

from span_workflows.query.builders import g, rag, user
from span_workflows.serving.client import ServerError, ServerUnavailableError, SpanServer
from span_workflows.serving.launch import free_port, stop_server_process

pytestmark = pytest.mark.engine

DOCS = ["The Gull Rock lighthouse was built in 1871 and painted red and white.",
        "Keeper Ada Lind kept the Gull Rock light burning for forty-two winters."]
QUERY = rag("Answer briefly.", DOCS, "Who kept the light?", max_tokens=6, temperature=0.0)
LONG = g(user("Write a very long story about a lighthouse keeper, with many chapters."),
         max_tokens=400, temperature=0.0)
FAULTS: dict[str, int] = {}


def _group(pgid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return alive


def test_kill_mid_request_then_restart_with_retries(server_slot: ServerSlot) -> None:
    server_slot.use(SMALL_POOL)
    shm_before = server_slot.shm_before_start
    proc, url = server_slot.proc, server_slot.url
    assert proc is not None and proc.poll() is None
    try:
        with SpanServer(url, timeout=120) as client:
            reference = client.execute(QUERY)
            fresh_prepares = reference.metrics.prepare_requests
            assert fresh_prepares > 0 and reference.text

            errors: dict[str, BaseException] = {}
            streaming = threading.Event()

            finished: dict[str, float] = {}

            def stream() -> None:
                try:
                    for _ in client.stream(LONG):
                        streaming.set()
                    finished["stream"] = time.monotonic()
                except BaseException as exc:  # noqa: BLE001 - inspected below
                    errors["stream"] = exc

            def plain() -> None:
                try:
                    client.execute(LONG)
                    finished["execute"] = time.monotonic()
                except BaseException as exc:  # noqa: BLE001 - inspected below
                    errors["execute"] = exc

            threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
            for t in threads:
                t.start()
            assert streaming.wait(120), "the long request never started streaming"
            members = _group(proc.pid)
            assert len(members) >= 2  # API server and engine core
            killed_at = time.monotonic()
            os.killpg(proc.pid, signal.SIGKILL)  # the crash
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
    finally:
        stop_server_process(proc)  # whatever the kill left of its process group
    # A request whose answer ended (EOS) before the kill completes; every other one fails.
    assert errors, "no request was in flight when the server was killed"
    assert set(errors) | set(finished) == {"stream", "execute"}
    assert all(t <= killed_at for t in finished.values()), (finished, killed_at)
    for exc in errors.values():
        assert isinstance(exc, ServerUnavailableError), repr(exc)
        assert url in str(exc)
    FAULTS["killed_in_flight"] = len(errors)
    deadline = time.monotonic() + 30
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group(proc.pid), "processes of the killed server are still running"
    # Finding (tests/README.md): SIGKILL leaves vLLM's shared-memory buffers (psm_*, 160-240
    # MiB each) in /dev/shm: nobody is left to unlink them. Count them, then remove the ones
    # that appeared since this server started and no live process maps.
    left = {n for n in shm_names() - shm_before if n.startswith("psm_")}
    left -= mapped_by_others(left)
    FAULTS["shm_segments_left_by_sigkill"] = len(left)
    for name in left:
        Path("/dev/shm", name).unlink(missing_ok=True)

    # Down: a clear error, after the retries asked for.
    with SpanServer(url, retries=2) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="unavailable") as info:
            client.execute(QUERY)
        assert time.monotonic() - started >= 0.9  # two retries, 0.5 s apart
        assert info.value.url == url and not client.health()
    FAULTS["refused_with_retries"] = 1

    # Restart on the same port (in the shared settings, which require the API key); a client
    # with retries sent its request while it was down.
    starter = threading.Thread(target=server_slot.start, args=(SHARED,))
    starter.start()
    try:
        with SpanServer(url, api_key=API_KEY, retries=900, timeout=120) as client:
            answer = client.execute(QUERY)  # connection refused until the server is up
        starter.join(60)
        assert server_slot.proc is not proc and server_slot.proc.poll() is None
        assert answer.text == reference.text
        assert answer.metrics.prepare_requests == fresh_prepares  # the cache was empty
        with SpanServer(url, api_key=API_KEY) as client:
            assert client.health()
            assert client.execute(QUERY).metrics.prepare_requests == 0
    finally:
        starter.join(400)
    FAULTS["restarted"] = 1
    print(f"\nfaults survived: {FAULTS}")


def test_client_errors_on_a_port_nobody_listens_on() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with SpanServer(url, timeout=5) as client:
        with pytest.raises(ServerUnavailableError, match=url):
            client.execute(QUERY)
        with pytest.raises(ServerUnavailableError):
            list(client.stream(QUERY))
        assert not client.health()
    assert issubclass(ServerUnavailableError, ConnectionError)
    assert not issubclass(ServerError, ConnectionError)
