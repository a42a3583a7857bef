"""Shutting down one in-process vLLM engine while others in the process keep running.

vLLM's in-process engine core tears down the process's distributed state (the tensor and
pipeline parallel groups) when it shuts down, as if it were the last engine alive. Engines in
one process share that state, so closing one would break every other with "pipeline model
parallel group is not initialized". :func:`shut_down` keeps the teardown for the last open
engine only; the others release their executor, scheduler and KV cache as usual.

vLLM also keeps one KV connector per process (the span store's): an engine with a span store
and one without can share a process only while the one without runs no step.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_open = 0


def opened() -> None:
    """Count one more in-process engine (call once its construction succeeded)."""
    global _open
    with _lock:
        _open += 1


def open_engines() -> int:
    """How many in-process engines are open now."""
    return _open


def shut_down(core_client: Any) -> None:
    """Shut ``core_client`` (an ``LLMEngine.engine_core``) down; the last one also tears down
    the process's distributed state, the others leave it to the engines still open."""
    global _open
    from vllm.v1.engine import core as vllm_core

    with _lock:
        _open = max(0, _open - 1)
        last = _open == 0
        if last:
            core_client.shutdown()
            return
        original = vllm_core.cleanup_dist_env_and_memory
        vllm_core.cleanup_dist_env_and_memory = _release_memory_only
        try:
            core_client.shutdown()
        finally:
            vllm_core.cleanup_dist_env_and_memory = original


def _release_memory_only(*_: object, **__: object) -> None:
    import gc

    gc.collect()
