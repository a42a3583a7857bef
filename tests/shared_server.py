"""Span servers in vLLM's dev mode for tests, and the one the HTTP test modules share
(``shared_server`` fixture in conftest.py): one process for the session instead of one per
module, since each start loads vLLM and the model again. Its modules must not need a fresh
server: they may reset its prefix cache (``/reset_prefix_cache``, dev mode) but not change its
settings."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from span_workflows.serving.launch import start_server_process, stop_server_process

#: The bearer token the shared server requires.
API_KEY = "span-tests-key"


@dataclass(frozen=True)
class SharedServer:
    """A running server: its process and its URL."""

    proc: subprocess.Popen
    url: str


def start_dev_mode_server(log_path: Path, **options: Any) -> tuple[subprocess.Popen, str]:
    """Start ``span-workflows serve`` (``options`` as for ``start_server_process``) with
    ``/reset_prefix_cache`` on; return ``(process, url)`` once it is healthy."""
    # vLLM registers /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (read at start).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        return start_server_process(log_path=log_path, **options)


@contextmanager
def dev_mode_server(log_path: Path, **options: Any) -> Iterator[tuple[subprocess.Popen, str]]:
    """:func:`start_dev_mode_server`; yield ``(process, url)``; stop it and check it has
    exited."""
    proc, url = start_dev_mode_server(log_path, **options)
    try:
        yield proc, url
    finally:
        stop_server_process(proc)
        assert proc.poll() is not None


@contextmanager
def shared_server_process(log_path: Path) -> Iterator[SharedServer]:
    """The shared server: dev mode, 1 GiB of KV cache, 4096-token context, loopback,
    ``API_KEY``."""
    with dev_mode_server(log_path, api_key=API_KEY, kv_cache_gib=1, timeout=900,
                         max_model_len=4096) as (proc, url):
        yield SharedServer(proc, url)
