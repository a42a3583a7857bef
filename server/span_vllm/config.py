"""When the plugin is active and which marker tokens it honours (read from the environment).

``SPAN_VLLM=1`` turns span mode on; ``SPAN_VLLM_PLUS_TOKEN`` / ``SPAN_VLLM_CROSS_TOKEN`` name the
marker token ids (the client library sets all three from the model's tokenizer before it starts
an engine; the server launcher does the same).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENABLE_ENV = "SPAN_VLLM"
PLUS_ENV = "SPAN_VLLM_PLUS_TOKEN"
CROSS_ENV = "SPAN_VLLM_CROSS_TOKEN"


@dataclass(frozen=True, slots=True)
class SpanConfig:
    """Marker token ids the patched vLLM hashes and repositions by."""

    plus_token: int
    cross_token: int


def enabled() -> bool:
    """Whether span mode was asked for in this process's environment."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def load() -> SpanConfig:
    """The active configuration; raises a clear error if the markers are not set."""
    try:
        return SpanConfig(int(os.environ[PLUS_ENV]), int(os.environ[CROSS_ENV]))
    except (KeyError, ValueError) as exc:
        raise RuntimeError(
            f"span mode is on ({ENABLE_ENV}=1) but {PLUS_ENV}/{CROSS_ENV} are not set to token "
            "ids; start engines through span_workflows.Engine or `span-workflows serve`"
        ) from exc
