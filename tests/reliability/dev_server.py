"""A span server in vLLM's dev mode, whose prefix cache can be reset between requests, for the
tests that compare every output with the same request run alone on a fresh cache."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from span_workflows.serving.launch import start_server_process, stop_server_process


@contextmanager
def dev_mode_server(log_path: Path, **options: Any) -> Iterator[tuple[subprocess.Popen, str]]:
    """Start ``span-workflows serve`` (``options`` as for ``start_server_process``) with
    ``/reset_prefix_cache`` on; yield ``(process, url)``; stop it and check it has exited."""
    # vLLM registers /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (read at start).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        proc, url = start_server_process(log_path=log_path, **options)
    try:
        yield proc, url
    finally:
        stop_server_process(proc)
        assert proc.poll() is not None


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
