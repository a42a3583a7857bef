"""Start the span query server (``span-workflows serve``).

:func:`serve` runs the server in the foreground (it replaces the current process);
:func:`start_server_process` starts it in the background and waits until ``/health`` answers,
for tests and notebooks. Both run ``python -m span_workflows.serving.app`` — vLLM's
OpenAI-compatible server with ``/v1/query/execute`` added — in an environment that turns the
``span_vllm`` plugin on in every engine process it starts (:func:`server_env`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

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


def server_command(
    model: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    block_size: int | None = None,
    extra_args: Sequence[str] = (),
    *,
    max_model_len: int | None = None,
    device: str | None = None,
    adapters: Mapping[str, str | Path] | None = None,
    routing: bool = True,
    span_store: str | Path | None = None,
    span_store_gib: float | None = None,
) -> list[str]:
    """The command line of the server (see :func:`serve`).

    ``device`` (default: :func:`detect_device`) only decides the CPU defaults: on ``"cpu"``
    ``--enforce-eager --dtype float32`` and a block size of 32 are added; on a GPU nothing
    but what is asked. ``adapters`` (``{name: directory}``; default: the span-ready adapter
    on the bundled base, none on other models) are served as LoRA beside the model
    (:func:`adapter_args`); ``routing=False`` keeps span queries on the base unless they
    name an adapter. ``span_store`` (a directory; ``span_store_gib`` caps it) keeps span
    blocks on disk beyond the KV cache and across restarts (vLLM's ``--kv-transfer-config``
    with the plugin's store connector, :func:`span_vllm.contract.store_transfer_config`).
    ``extra_args`` go last, so any vLLM option there wins."""
    reference, _ = model_reference(model)
    on_cpu = (device or detect_device()) == "cpu"
    if block_size is None and on_cpu:
        block_size = CPU_BLOCK_SIZE
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
    if max_model_len is not None:
        cmd += ["--max-model-len", str(int(max_model_len))]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += adapter_args(model, adapters)
    if not routing:
        cmd += ["--no-span-routing"]
    if span_store is not None:
        import json

        cmd += ["--kv-transfer-config", json.dumps(
            contract.store_transfer_config(span_store, max_gib=span_store_gib))]
    if model is None or str(model).lower() in BUNDLED_MODELS:
        # A bundled model answers to its short name as well as to its path.
        cmd += ["--served-model-name", reference,
                DEFAULT_MODEL_NAME if model is None else str(model).lower()]
    cmd += [str(a) for a in extra_args]
    return cmd


def adapter_args(model: str | Path | None,
                 adapters: Mapping[str, str | Path] | None = None) -> list[str]:
    """vLLM's LoRA flags for ``adapters`` (default: :func:`~span_workflows.compiler.model.
    bundled_adapters` on the bundled base, none elsewhere); each adapter is checked here, so
    a wrong path fails before the server starts."""
    if adapters is None:
        adapters = bundled_adapters() if is_base(model) else {}
    return lora_server_args(Adapter.load(name, path) for name, path in adapters.items())


def server_env(
    model: str | Path | None = None,
    kv_cache_gib: int = 2,
    base: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> dict[str, str]:
    """The environment of the server: span mode on, its layout key, vLLM's settings, and the
    API key as ``VLLM_API_KEY`` when one is given (the environment, unlike the command line,
    is not visible to other users' ``ps``).

    A local model runs with ``HF_HUB_OFFLINE=1`` (nothing to download); a hub id with the
    caller's setting (``HF_HUB_OFFLINE=0`` unless set), so vLLM can fetch it."""
    env = dict(os.environ if base is None else base)
    _, local = model_reference(model)
    env.setdefault("HF_HUB_OFFLINE", "1" if local else "0")
    contract.enable(env, kv_cache_gib=kv_cache_gib)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def serve(
    model: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    block_size: int | None = None,
    kv_cache_gib: int = 2,
    extra_args: Sequence[str] = (),
    adapters: Mapping[str, str | Path] | None = None,
    routing: bool = True,
    span_store: str | Path | None = None,
    span_store_gib: float | None = None,
) -> None:
    """Run the span server in the foreground until interrupted (replaces this process).

    ``model``: ``None``/``"smollm2-135m-instruct"``, a local Hugging Face model directory, or
    a hub id (``meta-llama/Llama-3.1-8B-Instruct``). ``extra_args`` are passed to vLLM's
    server as is, after the defaults (e.g. ``["--tensor-parallel-size", "2", "--dtype",
    "bfloat16"]``); ``block_size=None`` means 32 on CPU, vLLM's default on a GPU.
    ``adapters``, ``routing``, ``span_store`` and ``span_store_gib``: see
    :func:`server_command`.
    Raises :class:`~span_workflows.errors.ModelNotAvailableError` for an unknown model.
    """
    cmd = server_command(model, host, port, None, block_size, extra_args, adapters=adapters,
                         routing=routing, span_store=span_store, span_store_gib=span_store_gib)
    env = server_env(model, kv_cache_gib, api_key=api_key)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)


def start_server_process(
    model: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    block_size: int | None = None,
    kv_cache_gib: int = 2,
    extra_args: Sequence[str] = (),
    *,
    timeout: float = 300.0,
    log_path: str | Path | None = None,
    max_model_len: int | None = None,
    adapters: Mapping[str, str | Path] | None = None,
    routing: bool = True,
    span_store: str | Path | None = None,
    span_store_gib: float | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start the server in the background; return ``(process, url)`` once ``/health`` is 200.

    ``port=None`` picks a free port. The process leads its own process group: stop it with
    :func:`stop_server_process` (which also ends the engine processes it started). Output goes
    to ``log_path`` (default: discarded). Raises :class:`ServerStartError` if the process exits
    or is not healthy within ``timeout`` seconds (it is stopped then). ``adapters``,
    ``routing``, ``span_store`` and ``span_store_gib``: see :func:`server_command`.
    """

    port = free_port(host) if port is None else int(port)
    cmd = server_command(model, host, port, None, block_size, extra_args,
                         max_model_len=max_model_len, adapters=adapters, routing=routing,
                         span_store=span_store, span_store_gib=span_store_gib)
    env = server_env(model, kv_cache_gib, api_key=api_key)
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
    "ServerStartError", "detect_device", "free_port", "model_reference", "serve",
    "server_command", "server_env",
    "start_server_process", "stop_server_process",
]
