"""What a span query returns: the text and what it cost."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from span_workflows.compiler.compile import TokenizedQuery
from span_workflows.query.sampling import ToolCall


@dataclass(frozen=True, slots=True)
class Metrics:
    """What one query cost. ``ttft_s`` runs from submitting the query (prepares included) to
    the first token of its final generation."""

    ttft_s: float
    prompt_tokens: int  # the final generations' prompts
    cached_tokens: int
    generated_tokens: int
    #: spans computed because they were not cached (0 on a full hit)
    prepare_requests: int = 0
    latency_s: float = 0.0
    #: TTFT of the final generation request alone (after nested G's and prepares)
    final_ttft_s: float = 0.0
    #: link requests run (``SpanOptions.link_blocks``): each recomputes the first blocks of
    #: one span after everything before it; a new order of cached spans needs new links
    link_requests: int = 0
    #: prompt tokens computed by this query's own prepare requests (part of
    #: ``cached_tokens`` when the final request reads them back)
    prepared_tokens: int = 0
    #: engine steps from the query's submission to its first token, over all its requests:
    #: per stage (nested G's to their end, prepares, links, the final request to its first
    #: token) the most steps one of its requests waited, summed. On a GPU a step costs
    #: milliseconds whatever it computes, so this, not FLOPs, sets a hit's TTFT there
    engine_steps: int = 0
    #: the part of ``engine_steps`` after the nested G's ended (prepares, links, final)
    final_steps: int = 0
    #: tokens this G generated after its text to fill its last KV block (``align="pad"`` or
    #: ``"bias"`` in the G that reads it): pads and the stop token, not part of its text
    fill_tokens: int = 0
    #: the tokens of the G's nested under a plus in this G's input (each one's prompt and
    #: output, padding not counted): what this G should read
    nested_tokens: int = 0
    #: of ``nested_tokens``, those left out of this G's prompt (``align="crop"``)
    nested_lost_tokens: int = 0
    #: of ``nested_tokens``, those this G's own requests computed again instead of reading the
    #: KV computed while the nested G's ran (the last block of each, ``align="recompute"``)
    nested_computed_tokens: int = 0
    #: the weights that answered: the base model's name or a LoRA adapter's
    #: (:mod:`span_workflows.runtime.routing`); empty where unknown
    weights: str = ""

    @property
    def nested_cached_share(self) -> float:
        """The share of ``nested_tokens`` read from the nested G's own KV (1.0 without any):
        neither lost nor computed again."""
        if not self.nested_tokens:
            return 1.0
        read = self.nested_tokens - self.nested_lost_tokens - self.nested_computed_tokens
        return read / self.nested_tokens

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens this query's requests computed rather than read from the cache: its
        prepare and link requests' (``prepared_tokens``) and its final prompts' uncached ones
        (nested G's prompts aside). What a miss costs in compute on any device: block padding
        included, unlike ``prompt_tokens`` of a stock prompt."""
        return self.prepared_tokens + max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens of the final generations that were in the cache before the query
        started: ``cached_tokens`` less what the query's prepare requests computed."""
        return max(0, self.cached_tokens - self.prepared_tokens)

    def to_dict(self) -> dict[str, float | int | str]:
        """Every metric under its field name, JSON-ready (the CLI's and the wire's form)."""
        return asdict(self)

    def usage(self) -> dict[str, int]:
        """OpenAI-style usage (final generations only; prepare requests are not billed)."""
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.generated_tokens,
                "total_tokens": self.prompt_tokens + self.generated_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Metrics:
        """The inverse of :meth:`to_dict`; a missing metric is 0 (``weights``: empty)."""
        return cls(**{f.name: _NUMBER[str(f.type)](
            data.get(f.name, 0 if f.default is MISSING else f.default)) for f in fields(cls)})


_NUMBER: dict[str, type] = {"float": float, "int": int, "str": str}


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
    #: why the answer ended: ``"stop"`` (end of turn or a stop sequence), ``"length"``
    #: (``max_tokens`` or the context limit) or ``"tool_calls"`` (the answer calls tools;
    #: ``text`` is then empty)
    finish_reason: str = "stop"
    #: the tool calls of the answer (a G with tools); a plain answer's ``text`` is its content
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: top log-probabilities of every generated token of the first sample (``logprobs=k``)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    #: engine steps from the query's submission to its last token (what a G that reads this
    #: one's output waits for)
    steps_to_end: int = 0

    def to_dict(self) -> dict[str, Any]:
        """``{"text", "metrics"}`` as the CLI prints it."""
        return {"text": self.text, "metrics": self.metrics.to_dict()}


@dataclass(frozen=True, slots=True)
class BulkAnswer:
    """One query's answer in a bulk: its ``index`` in the bulk's input, and its ``result``,
    or the ``error`` it failed with (the other queries of the bulk ran regardless)."""

    index: int
    result: Result | None = None
    error: Exception | None = None

    def __post_init__(self) -> None:
        if (self.result is None) == (self.error is None):
            raise ValueError("a bulk answer holds a result or an error, not both or neither")

    @property
    def ok(self) -> bool:
        """Whether the query was answered."""
        return self.error is None
