"""Span queries over OpenAI's chat-completions wire: ``POST /v1/chat/completions`` with ``spans``.

**Request**: a standard chat-completions body plus ``"spans": ["text", ...]`` (the OpenAI SDK
sends it with ``extra_body={"spans": [...]}``). Each listed text is looked for inside the
``system`` / ``developer`` / ``user`` messages (as whole words: no letter or digit right
before or after it); where found it becomes a commutative span (a ``plus`` of fragments), and
the rest of the prompt stays ordered (:func:`span_workflows.query.lift.lift_messages`). Spans
next to each other with only whitespace or punctuation between them form one plus (that glue
is dropped). **Tools and structured output**: ``tools`` (OpenAI function tools) with
``tool_choice`` (``"auto"``, ``"required"``, ``"none"`` or ``{"type": "function",
"function": {"name": ...}}``), and ``response_format`` (``json_object`` or ``json_schema``),
constrain the answer as on the engine (:mod:`span_workflows.query.sampling`); in the history an
assistant message's ``tool_calls`` and a ``tool`` message (by ``tool_call_id``) are rendered
as the model generates and reads them; the results of one turn's calls commute.
Sampling: ``max_tokens`` / ``max_completion_tokens`` (default: up to the context
limit), ``temperature`` (default: the model's generation config, else 1.0), ``n``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, and vLLM's ``cache_salt``. ``stream`` and
``stream_options.include_usage`` as in OpenAI's API.

**Answer**: a ``chat.completion`` (:func:`completion_body`) or a stream of
``chat.completion.chunk`` events ending in ``data: [DONE]`` (:func:`chunk_body`,
:func:`usage_chunk_body`), with ``usage.prompt_tokens_details.cached_tokens`` = prompt tokens
that were cached before the request came (:func:`usage_body`).

**Errors** (vLLM's error shape, :func:`error_body`): ``spans`` not a list of non-empty
strings, a listed text found in no system or user message (the message names them), message
content that is not text, a role other than system/developer/user/assistant/tool, a
``tool_call_id`` that names no earlier call, ``n`` > 1 with tools, an option that
cannot go with spans (:data:`UNSUPPORTED_WITH_SPANS`) are a 400 ``BadRequestError`` whose
``param`` names the field; an unknown model a 404 ``NotFoundError``.

A body without ``spans`` is not read here: vLLM serves it unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Generate
from span_workflows.query.lift import find_fragments, lift_messages, span_id
from span_workflows.query.sampling import Sampling, render_calls, render_content, render_tool_result
from span_workflows.runtime.result import Result

CHAT_PATH = "/v1/chat/completions"
SPANS_KEY = "spans"
#: Chat roles a span request may use, and the message role each becomes.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
#: Sampling fields passed to vLLM as they are (when set, or set by the model's defaults).
SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                   "frequency_penalty", "repetition_penalty")
#: Options that change the prompt or the answer's form, which a span request refuses when set
#: (to anything but ``null``, ``false`` or empty).
UNSUPPORTED_WITH_SPANS = ("functions", "function_call", "logprobs", "top_logprobs", "echo",
                          "continue_final_message",
                          "chat_template", "chat_template_kwargs", "documents",
                          "structured_outputs", "prompt_logprobs", "logit_bias",
                          "logprob_token_ids", "guided_json", "guided_regex",
                          "guided_choice", "guided_grammar")


@dataclass(frozen=True, slots=True)
class SpanChat:
    """A parsed chat request with spans: the span query and how to answer it."""

    node: Generate
    model: str | None
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    #: more vLLM ``SamplingParams`` fields for the answer (:data:`SAMPLING_FIELDS`)
    sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def uses_tools(self) -> bool:
        """The answer is in the tool answer format (tools given, choice not ``"none"``)."""
        return self.node.sampling.uses_tools


def has_spans(body: bytes) -> bool:
    """Whether a chat-completions body asks for spans (a JSON object with a ``spans`` key).
    A body that is not a JSON object is left to vLLM, which reports it."""
    if f'"{SPANS_KEY}"'.encode() not in body:
        return False
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and SPANS_KEY in obj


def parse_span_chat(obj: Mapping[str, Any],
                    defaults: Mapping[str, Any] | None = None) -> SpanChat:
    """The span query of a chat request ``obj`` (a JSON object with ``spans``, whose other
    fields vLLM's own request model has already accepted). ``defaults``: the model's default
    sampling values (vLLM's ``default_sampling_params``). Raises :class:`SpanQueryError`
    whose ``path`` names the bad field."""
    defaults = defaults or {}
    spans = _spans(obj.get(SPANS_KEY))
    for key in UNSUPPORTED_WITH_SPANS:
        if obj.get(key) not in (None, False, [], {}, ""):
            raise SpanQueryError(key, "is not supported together with spans")
    if obj.get("add_generation_prompt") is False:
        raise SpanQueryError("add_generation_prompt", "must be true with spans")
    constraint = _constraint(obj)
    if constraint.uses_tools and obj.get("n") not in (None, 1):
        raise SpanQueryError("n", "must be 1 with tools")
    messages = _messages(obj.get("messages"), constraint.uses_tools)
    _check_found(spans, messages)
    max_tokens = obj.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = obj.get("max_tokens")
    temperature = obj.get("temperature")
    if temperature is None:
        temperature = defaults.get("temperature", 1.0)
    node = lift_messages(messages, max_tokens=int(max_tokens or 0),
                         temperature=float(temperature), fragments=spans, sampling=constraint)
    n = obj.get("n")
    if n is not None and int(n) != 1:
        node = dataclasses.replace(node, n=int(n))
    sampling: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = obj.get(name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            sampling[name] = [value] if name == "stop" and isinstance(value, str) else value
    options = obj.get("stream_options") or {}
    salt = obj.get("cache_salt")
    return SpanChat(node, obj.get("model"), bool(obj.get("stream", False)),
                    bool(isinstance(options, dict) and options.get("include_usage")),
                    salt if salt else None, sampling)


def _constraint(obj: Mapping[str, Any]) -> Sampling:
    """The answer's constraint: tools and tool choice, or a JSON schema."""
    options: dict[str, Any] = {}
    if obj.get("tools"):
        options["tools"] = obj["tools"]
        choice = obj.get("tool_choice") or "auto"
        if isinstance(choice, Mapping):
            choice = (choice.get("function") or {}).get("name")
        options["tool_choice"] = choice
    fmt = obj.get("response_format") or {}
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "json_object":
        options["json_schema"] = {"type": "object"}
    elif kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, Mapping):
            raise SpanQueryError("response_format.json_schema.schema",
                                 "must be a JSON schema object")
        options["json_schema"] = schema
    elif kind not in (None, "text"):
        raise SpanQueryError("response_format.type",
                             f"must be text, json_object or json_schema, got {kind!r}")
    try:
        return Sampling.from_options(options)
    except ValueError as exc:
        raise SpanQueryError("tools" if "tools" in options else "response_format",
                             str(exc)) from None


def _spans(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise SpanQueryError(SPANS_KEY, "must be a non-empty list of strings")
    for i, text in enumerate(value):
        if not isinstance(text, str) or not text.strip():
            raise SpanQueryError(f"{SPANS_KEY}[{i}]", "must be a non-empty string")
    return list(value)


def _messages(value: Any, tools_bound: bool = False) -> list[tuple[str, str]]:
    """``(role, text)`` of each message; tool calls and tool results rendered as the model
    generates and reads them (with tools bound, a plain assistant answer in the answer
    format too)."""
    if not isinstance(value, list) or not value:
        raise SpanQueryError("messages", "must be a non-empty list")
    pairs = []
    names: dict[str, str] = {}  # tool call id -> tool name
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise SpanQueryError(where, "must be an object")
        role = msg.get("role")
        if role not in ROLES:
            raise SpanQueryError(f"{where}.role", f"{role!r} is not supported with spans; "
                                 "expected system, developer, user, assistant or tool")
        text = _text(msg.get("content"), f"{where}.content")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if call_id not in names:
                raise SpanQueryError(f"{where}.tool_call_id",
                                     f"{call_id!r} names no tool call of an earlier message")
            text = render_tool_result(names[call_id], text)
        elif role == "assistant" and msg.get("tool_calls"):
            calls = _calls(msg["tool_calls"], f"{where}.tool_calls")
            names.update((cid, name) for cid, name, _ in calls)
            text = render_calls([(name, args) for _, name, args in calls])
        elif role == "assistant" and tools_bound:
            text = render_content(text)
        pairs.append((ROLES[role], text))
    return pairs


def _calls(value: Any, where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``(id, name, arguments)`` of an assistant message's ``tool_calls``."""
    if not isinstance(value, list):
        raise SpanQueryError(where, "must be a list")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise SpanQueryError(f"{where}[{j}]", "must be a function call with a name")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise SpanQueryError(f"{where}[{j}].function.arguments",
                                 "must be a JSON object (as text)")
        calls.append((str(call.get("id", "")), fn["name"], args))
    return calls


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise SpanQueryError(f"{where}[{j}]", "only text parts can go with spans")
            texts.append(part["text"])
        return "".join(texts)
    raise SpanQueryError(where, "must be a string or a list of text parts")


def _check_found(spans: Sequence[str], messages: Sequence[tuple[str, str]]) -> None:
    found: set[str] = set()
    for role, text in messages:
        if role in ("system", "user"):
            found.update(sid for _, _, sid in find_fragments(text, spans))
    missing = [s for s in spans if span_id(s) not in found]
    if missing:
        shown = ", ".join(json.dumps(_short(s), ensure_ascii=False) for s in missing)
        raise SpanQueryError(SPANS_KEY, f"{len(missing)} listed text(s) not found in any "
                             f"system or user message (as whole words): {shown}")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# -- answers ---------------------------------------------------------------------------------


def usage_body(result: Result) -> dict[str, Any]:
    """OpenAI's ``usage`` of an answer. ``prompt_tokens_details.cached_tokens`` counts the
    prompt tokens that were in the cache before the request came
    (:attr:`~span_workflows.runtime.result.Metrics.reused_tokens`): spans the request had to prepare
    itself are not counted, so the first request over new documents reports few, a later one
    over the same documents in any order nearly all of them."""
    m = result.metrics
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.generated_tokens,
            "total_tokens": m.prompt_tokens + m.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": m.reused_tokens}}


def completion_body(result: Result, *, request_id: str, created: int, model: str,
                    finish_reasons: Mapping[int, str],
                    uses_tools: bool = False) -> dict[str, Any]:
    """The ``chat.completion`` of an executed span chat request (one choice per output;
    ``uses_tools``: one, in the tool answer format, read back as content or tool calls)."""
    if uses_tools:
        choices = [{"index": 0, "message": tool_message(result), "logprobs": None,
                    "finish_reason": result.finish_reason}]
    else:
        choices = [{"index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": finish_reasons.get(i, "stop")}
                   for i, text in enumerate(result.texts)]
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_body(result)}


def tool_message(result: Result) -> dict[str, Any]:
    """The assistant message of an answer in the tool answer format: its ``tool_calls``
    (``content`` null), or its content."""
    if not result.tool_calls:
        return {"role": "assistant", "content": result.text}
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
        for c in result.tool_calls]}


def chunk_body(*, request_id: str, created: int, model: str,
               choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``chat.completion.chunk``; each choice ``{"index", "delta", "finish_reason"}``."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": choices}


def delta_choice(index: int, content: str, *, first: bool = False,
                 finish_reason: str | None = None) -> dict[str, Any]:
    """One choice of a chunk: a piece of output ``index`` (the first also names the role)."""
    delta: dict[str, Any] = {"role": "assistant", "content": content} if first else (
        {"content": content} if content else {})
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def usage_chunk_body(result: Result, *, request_id: str, created: int,
                     model: str) -> dict[str, Any]:
    """The last chunk of a stream asked with ``stream_options.include_usage``."""
    return {**chunk_body(request_id=request_id, created=created, model=model, choices=[]),
            "usage": usage_body(result)}


def error_body(message: str, *, status: int = 400, kind: str = "BadRequestError",
               param: str | None = None) -> dict[str, Any]:
    """vLLM's (and OpenAI's) error answer: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def query_error_body(exc: SpanQueryError) -> dict[str, Any]:
    """The 400 answer of a bad span chat request; ``param`` is the bad field's path."""
    return error_body(str(exc), param=exc.path or None)


__all__ = [
    "CHAT_PATH", "ROLES", "SAMPLING_FIELDS", "SPANS_KEY", "SpanChat", "UNSUPPORTED_WITH_SPANS",
    "chunk_body", "completion_body", "delta_choice", "error_body", "has_spans",
    "parse_span_chat", "query_error_body", "tool_message", "usage_body", "usage_chunk_body",
]
