"""What a span query returns: the text and what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from span_workflows.compile import TokenizedQuery


@dataclass(frozen=True, slots=True)
class Metrics:
    """What one query cost. ``ttft_s`` runs from submitting the query (prepares included) to
    the first token of its final generation."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    prepare_requests: int = 0
    latency_s: float = 0.0
    #: TTFT of the final generation request alone (after nested G's and prepares)
    final_ttft_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The four documented metrics plus extras, as a JSON-ready dict."""
        return {
            "ttft_s": self.ttft_s, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens,
            "prepare_requests": self.prepare_requests, "latency_s": self.latency_s,
        }


@dataclass
class Result:
    """The answer of a query: ``text`` (first sample), all ``texts``, metrics, token form."""

    text: str
    metrics: Metrics
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    query: TokenizedQuery | None = None
    parts: list[Result] = field(default_factory=list)
    #: top log-probabilities of the first generated token (when asked with ``logprobs=k``)
    first_logprobs: dict[int, float] = field(default_factory=dict)
    #: results of the G's nested directly in this G's input (the drafts a judge read), keyed
    #: by their path in the optimized query (``input.cross[1].plus[0]``)
    nested: dict[str, Result] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """``{"text", "metrics"}`` as the CLI prints it."""
        return {"text": self.text, "metrics": self.metrics.as_dict()}
