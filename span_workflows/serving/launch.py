"""Start the span query server (``span-workflows serve``).

:func:`serve` runs the server in the foreground (it replaces the current process);
:func:`start_server_process` starts it in the background and waits until ``/health`` answers,
for tests and notebooks. Both run ``python -m span_workflows.serving.app`` — vLLM's
OpenAI-compatible server with ``/v1/query/execute`` added — in an environment that turns the
``span_vllm`` plugin on in every engine process it starts (:meth:`ServerOptions.env`); one
:class:`ServerOptions` says what the server runs with, wherever it is started from.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from span_vllm import contract
from span_workflows.compiler.model import (
    BUNDLED_MODELS,
    DEFAULT_MODEL_NAME,
    bundled_adapters,
    is_base,
    resolve_model,
)
from span_workflows.errors import ModelNotAvailableError
from span_workflows.runtime.routing import Adapter, lora_server_args
from span_workflows.serving.wire import HEALTH_PATH

LAUNCHER_MODULE = "span_workflows.serving.app"

#: vLLM flags ``serve`` adds on CPU only (exact fp32 reference numerics, no graph capture);
#: on a GPU vLLM's own defaults apply (model dtype, CUDA graphs, its block size).
CPU_ARGS = ("--enforce-eager", "--dtype", "float32")
#: CPU attention needs blocks that are a multiple of 32 (its default, 128, wastes cache).
CPU_BLOCK_SIZE = 32


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time."""


def detect_device() -> str:
    """``"cuda"`` if a CUDA device is visible to torch here, else ``"cpu"``."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return "cpu"


def model_reference(model: str | Path | None) -> tuple[str, bool]:
    """What to pass to vLLM as ``--model``, and whether it is on this machine.

    ``None`` / a bundled model's name → its directory (converted, or merged with its adapter,
    once); an existing directory →
    that directory; anything else is taken as a Hugging Face hub id (``org/name``), which vLLM
    downloads (or reads from the HF cache). Raises
    :class:`~span_workflows.errors.ModelNotAvailableError` for a path-like name that does not
    exist or a hub id in offline mode (``HF_HUB_OFFLINE=1``)."""
    if model is None or str(model).lower() in BUNDLED_MODELS:
        return str(resolve_model(None if model is None else str(model).lower(),
                                 progress=True)), True
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(resolve_model(text, progress=True)), True
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id or os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "True"):
        raise ModelNotAvailableError(text)
    return text, False


@dataclass(frozen=True)
class ServerOptions:
    """What a span server runs with: the one set of options ``span-workflows serve``, its
    replicas (:class:`~span_workflows.scaleout.deployment.ClusterOptions`), :func:`serve` and
    :func:`start_server_process` share; :meth:`command` and :meth:`env` turn it into the
    server's command line and environment.

    ``model``: ``None``/``"smollm2-135m-instruct"``, a local Hugging Face model directory, or
    a hub id (``meta-llama/Llama-3.1-8B-Instruct``). ``block_size=None``: 32 on CPU, vLLM's
    default on a GPU. ``kv_cache_gib``: the KV cache on CPU. ``extra_args`` go to vLLM's
    server last, so any vLLM option there wins (e.g. ``("--tensor-parallel-size", "2")``).
    ``adapters`` (``{name: directory}``; ``None``: the span-ready adapter on the bundled base,
    none on other models) are served as LoRA beside the model (:func:`adapter_args`);
    ``routing=False`` keeps span queries on the base unless they name an adapter.
    ``span_store`` (a directory; ``span_store_gib`` caps it) keeps span blocks on disk beyond
    the KV cache and across restarts (vLLM's ``--kv-transfer-config`` with the plugin's store
    connector, :func:`span_vllm.contract.store_transfer_config`). ``api_key`` guards every
    ``/v1`` path; it travels in the environment, never on the command line (which other
    users' ``ps`` shows). Raises :class:`ValueError` naming the option that is wrong."""

    model: str | Path | None = None
    block_size: int | None = None
    kv_cache_gib: int = 2
    extra_args: tuple[str, ...] = ()
    adapters: Mapping[str, str | Path] | None = None
    routing: bool = True
    span_store: str | Path | None = None
    span_store_gib: float | None = None
    max_model_len: int | None = None
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {self.block_size}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, not {self.kv_cache_gib}")
        if self.span_store_gib is not None and self.span_store_gib <= 0:
            raise ValueError(f"span_store_gib must be > 0, not {self.span_store_gib}")
        if self.span_store_gib is not None and self.span_store is None:
            raise ValueError("span_store_gib needs span_store")

    @classmethod
    def coerce(cls, value: ServerOptions | Mapping[str, Any] | None) -> ServerOptions:
        """``value`` as options: as is, from its fields (a Serve config file's ``server``
        mapping, or options that crossed a process as a dict), or the defaults for ``None``."""
        if value is None:
            return cls()
        return value if isinstance(value, cls) else cls(**dict(value))

    def command(self, host: str = "127.0.0.1", port: int = 8000,
                device: str | None = None) -> list[str]:
        """The server's command line. ``device`` (default: :func:`detect_device`) only
        decides the CPU defaults: on ``"cpu"`` ``--enforce-eager --dtype float32`` and a block
        size of 32 are added; on a GPU nothing but what is asked."""
        reference, _ = model_reference(self.model)
        on_cpu = (device or detect_device()) == "cpu"
        block_size = CPU_BLOCK_SIZE if self.block_size is None and on_cpu else self.block_size
        cmd = [
            sys.executable, "-m", LAUNCHER_MODULE,
            "--model", reference,
            "--host", host,
            "--port", str(int(port)),
            "--enable-prefix-caching",
            # the plugin's block alignment of nested outputs (align="pad"/"bias")
            "--logits-processors", *contract.LOGITS_PROCESSORS,
        ]
        if block_size is not None:
            cmd += ["--block-size", str(int(block_size))]
        if on_cpu:
            cmd += list(CPU_ARGS)
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(int(self.max_model_len))]
        cmd += adapter_args(self.model, self.adapters)
        if not self.routing:
            cmd += ["--no-span-routing"]
        if self.span_store is not None:
            import json

            cmd += ["--kv-transfer-config", json.dumps(
                contract.store_transfer_config(self.span_store, max_gib=self.span_store_gib))]
        model = self.model
        if model is None or str(model).lower() in BUNDLED_MODELS:
            # A bundled model answers to its short name as well as to its path.
            cmd += ["--served-model-name", reference,
                    DEFAULT_MODEL_NAME if model is None else str(model).lower()]
        return cmd + list(self.extra_args)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment (``base``, default this process's): span mode on, its
        layout key, vLLM's settings, and the API key as ``VLLM_API_KEY``.

        A local model runs with ``HF_HUB_OFFLINE=1`` (nothing to download); a hub id with the
        caller's setting (``HF_HUB_OFFLINE=0`` unless set), so vLLM can fetch it."""
        env = dict(os.environ if base is None else base)
        _, local = model_reference(self.model)
        env.setdefault("HF_HUB_OFFLINE", "1" if local else "0")
        contract.enable(env, kv_cache_gib=self.kv_cache_gib)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env


def adapter_args(model: str | Path | None,
                 adapters: Mapping[str, str | Path] | None = None) -> list[str]:
    """vLLM's LoRA flags for ``adapters`` (default: :func:`~span_workflows.compiler.model.
    bundled_adapters` on the bundled base, none elsewhere); each adapter is checked here, so
    a wrong path fails before the server starts."""
    if adapters is None:
        adapters = bundled_adapters() if is_base(model) else {}
    return lora_server_args(Adapter.load(name, path) for name, path in adapters.items())


def serve(options: ServerOptions | None = None, host: str = "127.0.0.1",
          port: int = 8000) -> None:
    """Run the span server with ``options`` in the foreground until interrupted (replaces
    this process). Raises :class:`~span_workflows.errors.ModelNotAvailableError` for an
    unknown model."""
    options = ServerOptions.coerce(options)
    cmd, env = options.command(host, port), options.env()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)


def start_server_process(
    options: ServerOptions | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    timeout: float = 300.0,
    log_path: str | Path | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start the server with ``options`` in the background; return ``(process, url)`` once
    ``/health`` is 200.

    ``port=None`` picks a free port. The process leads its own process group: stop it with
    :func:`stop_server_process` (which also ends the engine processes it started). Output goes
    to ``log_path`` (default: discarded). Raises :class:`ServerStartError` if the process exits
    or is not healthy within ``timeout`` seconds (it is stopped then)."""
    options = ServerOptions.coerce(options)
    port = free_port(host) if port is None else int(port)
    cmd, env = options.command(host, port), options.env()
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        if log_path is not None:
            log.close()  # type: ignore[union-attr]
    url = f"http://{_url_host(host)}:{port}"
    wait_until_healthy(proc, url, timeout, log_path)
    return proc, url


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float,
                       log_path: str | Path | None = None) -> None:
    """Wait until the span server ``proc`` answers ``/health`` at ``url`` with 200. Raises
    :class:`ServerStartError` if it exits first, or is not healthy within ``timeout`` seconds
    (it is stopped then); ``log_path``, where its output went, is named in the error."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise ServerStartError(
                f"span server exited with code {code} before becoming healthy"
                + (f" (log: {log_path})" if log_path else "")
            )
        try:
            if httpx.get(url + HEALTH_PATH, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server_process(proc)
            raise ServerStartError(f"span server at {url} not healthy after {timeout:.0f} s")
        time.sleep(0.2)


def stop_server_process(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """Stop a server from :func:`start_server_process` and every process it started."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    # The engine core and workers share the server's process group: end any left behind.
    _signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


__all__ = [
    "ServerOptions", "ServerStartError", "adapter_args", "detect_device", "free_port",
    "model_reference", "serve",
    "start_server_process", "stop_server_process",
]
