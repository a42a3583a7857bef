"""The session's span server for the HTTP tests: one port, one dev-mode server process at a
time, in the settings the running test module needs.

Each start loads vLLM and the model again, so the session starts it twice: first with a small
pool (``reliability/dev_server.SMALL_POOL``) for the modules that fill it, then, when the fault
test has killed that server, its restart on the same port comes up in the shared settings
(:data:`SHARED`) that every other HTTP module, notebook 05 included, uses. ``conftest.py``
orders the session so: the small-pool modules first, the fault test after them. The modules
of one setting must not need a fresh server: they may reset its prefix cache
(``/reset_prefix_cache``, dev mode) but not change its settings. Run alone, a module gets a
server in its settings (a start of its own)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from process_leaks import shm_names

from span_workflows.serving.launch import (
    ServerOptions,
    free_port,
    start_server_process,
    stop_server_process,
)

#: The bearer token the shared settings require.
API_KEY = "span-tests-key"


@dataclass(frozen=True)
class Setting:
    """A named set of options for ``span-workflows serve`` and how long its start may take
    (the port is the slot's)."""

    name: str
    server: ServerOptions
    timeout: float


#: The shared settings: 1 GiB of KV cache, a 4096-token context, loopback, ``API_KEY``.
SHARED = Setting("shared", ServerOptions(api_key=API_KEY, kv_cache_gib=1, max_model_len=4096),
                 timeout=900)


@dataclass(frozen=True)
class SharedServer:
    """A running server: its process and its URL."""

    proc: subprocess.Popen
    url: str


def start_dev_mode_server(log_path: Path, setting: Setting,
                          port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``span-workflows serve`` in ``setting`` with ``/reset_prefix_cache`` on; return
    ``(process, url)`` once it is healthy."""
    # vLLM registers /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (read at start).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        return start_server_process(setting.server, port=port, timeout=setting.timeout,
                                    log_path=log_path)


class ServerSlot:
    """One port and the dev-mode server on it: :meth:`use` starts it in a setting unless it
    already runs in that one; :meth:`start` starts it (again) in a setting, after a kill for
    instance. ``client`` is a client of the current process (a new one after each start)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.setting: Setting | None = None
        self.starts = 0
        #: the files in /dev/shm just before the current process started
        self.shm_before_start: set[str] = set()
        self._client: httpx.Client | None = None

    def use(self, setting: Setting) -> ServerSlot:
        """The slot with its server running in ``setting`` (stopped and started in it if it
        ran in another one, or was killed)."""
        if self.setting != setting or self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start(setting)
        return self

    def start(self, setting: Setting) -> None:
        """Start the server on the slot's port in ``setting``; returns once it answers
        ``/health``. The process before it must be gone (stopped or killed)."""
        self.starts += 1
        self.shm_before_start = shm_names()
        log = self.log_dir / f"server-{self.starts}-{setting.name}.log"
        self.proc, url = start_dev_mode_server(log, setting, port=self.port)
        assert url == self.url
        self.setting = setting
        if self._client is not None:
            self._client.close()
        key = setting.server.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self._client = httpx.Client(base_url=self.url, timeout=300, headers=headers)

    @property
    def client(self) -> httpx.Client:
        assert self._client is not None, "the server was never started"
        return self._client

    @property
    def shared(self) -> SharedServer:
        """The running process and URL (for the modules of the shared settings)."""
        assert self.proc is not None
        return SharedServer(self.proc, self.url)

    def stop(self) -> None:
        """Stop the current process (killed ones included) and close the client."""
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is not None:
            stop_server_process(self.proc)
            assert self.proc.poll() is not None
            self.proc = None
