"""A real ``span-workflows`` server for a test module, and an HTTP client that signs in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from span_workflows.serving.launch import (
    ServerOptions,
    start_server_process,
    stop_server_process,
)


@contextmanager
def running_server(log_dir: Path, api_key: str, timeout: float) -> Iterator[str]:
    """A span server on loopback (1 GiB of KV cache, 4096-token context); yields its URL and
    stops it after (the process must be gone)."""
    options = ServerOptions(api_key=api_key, kv_cache_gib=1, max_model_len=4096)
    proc, url = start_server_process(options, timeout=timeout,
                                     log_path=log_dir / "server.log")
    try:
        yield url
    finally:
        stop_server_process(proc)
        assert proc.poll() is not None


@contextmanager
def signed_in(url: str, api_key: str) -> Iterator[httpx.Client]:
    """An HTTP client of ``url`` sending ``api_key`` as its bearer token."""
    with httpx.Client(base_url=url, timeout=300,
                      headers={"Authorization": f"Bearer {api_key}"}) as client:
        yield client
