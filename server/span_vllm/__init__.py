"""span_vllm — a vLLM general plugin that makes the KV cache span-aware.

Registered under the ``vllm.general_plugins`` entry point; vLLM calls :func:`register` in every
process it starts (API server, engine core, workers). It patches vLLM only when span mode is on
(``SPAN_VLLM=1``), so installing the package changes nothing for plain vLLM users.
"""

from __future__ import annotations

from span_vllm.config import enabled


def register() -> None:
    """Entry point for vLLM: apply the span patches if span mode is enabled (idempotent)."""
    if not enabled():
        return
    from span_vllm.patches import apply

    apply()


__all__ = ["register"]
