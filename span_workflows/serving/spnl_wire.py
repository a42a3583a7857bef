"""spnl's form of ``/v1/query/execute``: what spnl's own client sends and parses.

**Request**: the span query as the body, ``Content-Type: text/plain`` (JSON text all the same;
bare or wrapped as in :mod:`span_workflows.serving.wire`), and ``?stream=true|false`` in the
URL (it wins over a wrapper's ``"stream"``).

**Which answer**: ``?format=openai`` or a ``text/plain`` body ask for the OpenAI shapes below;
``?format=span`` (or a JSON body without ``format``) for this project's own answer
(:mod:`span_workflows.serving.wire`). Any other ``format`` or ``stream`` value is a 400.

**Answer (OpenAI shapes, one choice per output)**: a query whose top is a ``map`` answers a
``text_completion`` (``choices[i].text``, choice ``i`` = the map's input ``i``); any other
query (a ``repeat``, a ``g``, a join of g's) a ``chat.completion`` (``choices[i].message``).
Both carry ``usage`` (with ``prompt_tokens_details.cached_tokens``, as for
``/v1/chat/completions``). **Streamed**: server-sent events, each one
``data: <chunk>`` with one choice: ``text_completion`` chunks ``{"text", "index",
"finish_reason"}`` for a map, ``chat.completion.chunk`` chunks ``{"delta": {"content"},
"index", "finish_reason"}`` otherwise; a last chunk per choice with its ``finish_reason``,
then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Map, Node, User
from span_workflows.runtime.result import Result
from span_workflows.serving.chat_wire import usage_body

#: ``format`` values of the URL.
FORMATS = ("span", "openai")
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


def url_stream(params: Mapping[str, str]) -> bool | None:
    """The URL's ``stream`` (``true``/``false``/``1``/``0``), or ``None`` when absent."""
    value = params.get("stream")
    if value is None:
        return None
    if value.lower() not in _BOOLEANS:
        raise SpanQueryError("stream", f"must be true or false, got {value!r}")
    return _BOOLEANS[value.lower()]


def openai_form(params: Mapping[str, str], content_type: str | None) -> bool:
    """Whether to answer in the OpenAI shapes: ``?format=openai``, or a ``text/plain`` body
    without ``format``."""
    fmt = params.get("format")
    if fmt is not None:
        if fmt not in FORMATS:
            raise SpanQueryError("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")
        return fmt == "openai"
    return (content_type or "").split(";")[0].strip().lower() == "text/plain"


def choice_order(query: Node, normalized: Node) -> list[int]:
    """For a ``map`` query: the input index of each part of its normalized form (the optimizer
    sorts the map's generations); the identity for anything else."""
    parts = getattr(normalized, "children", (normalized,))
    if not isinstance(query, Map) or len(parts) != len(query.inputs):
        return list(range(len(parts)))
    free: dict[str, list[int]] = {}
    for i, text in enumerate(query.inputs):
        free.setdefault(text, []).append(i)
    order = []
    for part in parts:
        prompt = getattr(part, "input", None)
        slots = free.get(prompt.text) if isinstance(prompt, User) else None
        if not slots:
            return list(range(len(parts)))
        order.append(slots.pop(0))
    return order


def completion_body(result: Result, *, is_map: bool, order: Sequence[int],
                    request_id: str, created: int, model: str,
                    finish_reasons: Mapping[int, str]) -> dict[str, Any]:
    """The OpenAI-shaped answer: ``text_completion`` for a map, else ``chat.completion``;
    output ``k`` of the result is choice ``order[k]``."""
    choices = []
    for k, text in enumerate(result.texts):
        index = order[k] if k < len(order) else k
        reason = finish_reasons.get(k, "stop")
        if is_map:
            choices.append({"index": index, "text": text, "logprobs": None,
                            "finish_reason": reason})
        else:
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": reason})
    choices.sort(key=lambda c: c["index"])
    return {"id": request_id, "object": "text_completion" if is_map else "chat.completion",
            "created": created, "model": model, "choices": choices,
            "usage": usage_body(result)}


def chunk_body(index: int, delta: str, *, is_map: bool, request_id: str, created: int,
               model: str, finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed piece of choice ``index``: a ``text_completion`` chunk for a map, else a
    ``chat.completion.chunk``."""
    if is_map:
        choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        kind = "text_completion"
    else:
        choice = {"index": index, "delta": {"role": "assistant", "content": delta},
                  "logprobs": None, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "choices": [choice]}


__all__ = ["FORMATS", "choice_order", "chunk_body", "completion_body", "openai_form",
           "url_stream"]
