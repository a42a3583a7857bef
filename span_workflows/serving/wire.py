"""The wire protocol of ``/v1/query/execute``: the one place both the server and the client
read and write it.

**Request** (``POST`` :data:`EXECUTE_PATH`, at most :data:`MAX_BODY_BYTES` by default): a span
query in spnl's JSON IR, bare, or wrapped as ``{"query": Q, "stream": false, "optimize": true,
"span_options": {...}, "cache_salt": "...", "weights": "<the base's or an adapter's name>"}``
(only :data:`WRAPPER_KEYS`; every key but ``query`` optional; without ``weights`` the server
routes the query, :mod:`span_workflows.runtime.routing`). Written by :func:`request_body`, read by
:func:`parse_body`.

**Answer** (200): ``{"text", "texts", "usage": {"prompt_tokens", "cached_tokens",
"completion_tokens", "total_tokens"}, "metrics": {<Metrics.to_dict()>}, "finish_reason":
"stop" | "length" | "tool_calls", "tool_calls": [{"id", "name", "arguments"}, ...]}``
(``tool_calls`` only when the answer calls tools). Written by
:func:`result_body`, read by :func:`parse_result`.

**Errors**: an invalid query is a 400 ``{"error": {"message": "<path>: <what>", "type":
"invalid_query", "path": "<path>"}}`` (:func:`error_body`); a body over the cap a 413 of type
``request_too_large`` (:func:`too_large_body`). A client maps every 4xx to
:class:`~span_workflows.errors.SpanQueryError`, anything else but 200 to
:class:`~span_workflows.errors.ServerError` (:func:`read_response`).

**Stream** (``"stream": true``): server-sent events, ``data: {"delta": "..."}`` while the answer
is generated, then ``data: {"done": true, <the answer's keys>}``, or ``data: {"error":
{"message", "type"}}`` if it fails after the first delta (:func:`delta_event`,
:func:`done_event`, :func:`error_event`, :func:`sse`; read by :func:`parse_event`). A query that
fails before its first delta gets a plain error answer instead.

**Bulk** (``POST`` :data:`BULK_PATH`, at most :data:`MAX_BULK_BODY_BYTES`): JSON lines, one
query per non-blank line (bare or wrapped as above; ``stream`` is ignored), and the bulk's own
options in the URL: ``?schedule=cluster|given|random&max_in_flight=N``. The answer (200,
:data:`NDJSON_MEDIA_TYPE`) is one JSON line per query, written as soon as that query is
answered (not in input order): ``{"index": i, <the answer's keys>}``, or ``{"index": i,
"error": {"message", "type", "path"}}`` for a query that failed (``type`` ``invalid_query``,
or ``internal_error``); ``i`` counts the body's non-blank lines from 0. A bad line fails alone.
Written by :func:`bulk_body` / :func:`bulk_answer_line`, read by :func:`parse_bulk_body` /
:func:`parse_bulk_answer`; the CLI's ``run --bulk --out`` file holds the same lines.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from span_workflows.errors import ServerError, SpanQueryError
from span_workflows.query.ir import Node
from span_workflows.query.json_ir import to_obj
from span_workflows.query.sampling import ToolCall
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.query_body import WRAPPER_KEYS, QueryBody, parse_body, request_body
from span_workflows.runtime.result import BulkAnswer, Metrics, Result

EXECUTE_PATH = "/v1/query/execute"
HEALTH_PATH = "/health"
#: Largest request body the server reads (bytes), unless configured otherwise.
MAX_BODY_BYTES = 4 * 1024 * 1024
#: ``Content-Type`` of a stream.
SSE_MEDIA_TYPE = "text/event-stream"
#: Many queries at once (JSON lines in, JSON lines out).
BULK_PATH = "/v1/query/bulk"
#: Largest bulk request body the server reads (bytes), unless configured otherwise.
MAX_BULK_BODY_BYTES = 256 * 1024 * 1024
#: ``Content-Type`` of JSON lines (a bulk's body and its answer).
NDJSON_MEDIA_TYPE = "application/x-ndjson"


# -- requests --------------------------------------------------------------------------------


# -- answers ---------------------------------------------------------------------------------


def result_body(result: Result) -> dict[str, Any]:
    """The JSON answer of an executed query."""
    body = {"text": result.text, "texts": list(result.texts), "usage": result.metrics.usage(),
            "metrics": result.metrics.to_dict(), "finish_reason": result.finish_reason}
    if result.tool_calls:
        body["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                              for c in result.tool_calls]
    return body


def parse_result(data: dict[str, Any]) -> Result:
    """The :class:`Result` of a JSON answer (or of a stream's ``done`` event)."""
    text = str(data.get("text", ""))
    texts = [str(t) for t in data.get("texts") or [text]]
    calls = [ToolCall(str(c["name"]), dict(c["arguments"]), str(c["id"]))
             for c in data.get("tool_calls") or []]
    return Result(text, Metrics.from_dict(data.get("metrics") or {}), texts,
                  finish_reason=str(data.get("finish_reason") or "stop"), tool_calls=calls)


def error_body(exc: SpanQueryError) -> dict[str, Any]:
    """The JSON answer (400) for an invalid query."""
    return {"error": {"message": str(exc), "type": "invalid_query", "path": exc.path}}


def too_large_body(max_body: int) -> dict[str, Any]:
    """The JSON answer (413) for a body over the cap."""
    return {"error": {"message": f"request body is larger than {max_body} bytes",
                      "type": "request_too_large", "path": ""}}


def read_response(status: int, text: str, url: str) -> dict[str, Any]:
    """The JSON object of a 200 answer; otherwise raise the error the answer stands for."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if 400 <= status < 500:
        raise _query_error(status, data, text)
    if status != 200:
        raise ServerError(url, status, _message(data) or text[:500])
    if not isinstance(data, dict):
        raise ServerError(url, status, "the answer is not a JSON object")
    return data


def _message(data: Any) -> str | None:
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return None


def _query_error(status: int, data: Any, text: str) -> SpanQueryError:
    message = _message(data) or text.strip()[:500] or f"HTTP {status}"
    path = ""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        path = str(data["error"].get("path") or "")
    if path and message.startswith(f"{path}: "):
        message = message[len(path) + 2:]
    if status == 401:
        message = f"unauthorized: {message} (wrong or missing API key)"
    elif status == 413:
        message = f"request too large: {message}"
    return SpanQueryError(path, message)


# -- bulk ------------------------------------------------------------------------------------


def bulk_line(query: Node | dict | list | str, *, optimize_query: bool = True,
              span_options: SpanOptions | str | dict | None = None,
              cache_salt: str | None = None) -> str:
    """One line of a bulk request: the query wrapped with the call's options where it sets
    none. A JSON text that does not parse is sent as it is (on one line), for the server to
    report in that query's answer."""
    if isinstance(query, str):
        try:
            query = json.loads(query)
        except ValueError:
            return " ".join(query.splitlines())
    if isinstance(query, dict) and "query" in query and set(query) <= WRAPPER_KEYS:
        body = {k: v for k, v in query.items() if k != "stream"}
    else:
        body = {"query": to_obj(query) if not isinstance(query, (dict, list)) else query}
    if not optimize_query:
        body.setdefault("optimize", False)
    if span_options is not None and "span_options" not in body:
        body["span_options"] = SpanOptions.coerce(span_options).as_dict()
    if cache_salt is not None:
        body.setdefault("cache_salt", cache_salt)
    return json.dumps(body, ensure_ascii=False)


def bulk_body(queries: Sequence[Node | dict | list | str], *, optimize_query: bool = True,
              span_options: SpanOptions | str | dict | None = None,
              cache_salt: str | None = None) -> bytes:
    """The JSON lines of a bulk request (:func:`bulk_line` each)."""
    lines = [bulk_line(q, optimize_query=optimize_query, span_options=span_options,
                       cache_salt=cache_salt) for q in queries]
    return ("\n".join(lines) + "\n").encode()


def parse_bulk_body(body: bytes | str) -> list[QueryBody | SpanQueryError]:
    """The queries of a bulk body, one per non-blank line; a line that is not a valid query
    gives its :class:`SpanQueryError` in its place (the rest still run)."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    out: list[QueryBody | SpanQueryError] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            out.append(parse_body(line.encode()))
        except SpanQueryError as exc:
            out.append(exc)
        except (RecursionError, MemoryError) as exc:
            out.append(SpanQueryError("", f"query too large to process ({type(exc).__name__})"))
    return out


def bulk_answer(answer: BulkAnswer) -> dict[str, Any]:
    """One answer of a bulk as JSON: the index and the answer's keys, or the error."""
    if answer.result is not None:
        return {"index": answer.index, **result_body(answer.result)}
    exc = answer.error
    if isinstance(exc, SpanQueryError):
        return {"index": answer.index, **error_body(exc)}
    return {"index": answer.index, "error": {"message": str(exc) or type(exc).__name__,
                                             "type": "internal_error", "path": ""}}


def bulk_answer_line(answer: BulkAnswer) -> bytes:
    """:func:`bulk_answer` as one JSON line."""
    return (json.dumps(bulk_answer(answer), ensure_ascii=False) + "\n").encode()


def parse_bulk_answer(data: dict[str, Any], url: str = "") -> BulkAnswer:
    """The :class:`BulkAnswer` of one answer line's JSON object (an ``invalid_query`` error
    as :class:`SpanQueryError`, any other as :class:`ServerError`)."""
    index = data.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ServerError(url, 200, f"a bulk answer without a valid index: {str(data)[:200]}")
    err = data.get("error")
    if err is None:
        return BulkAnswer(index, result=parse_result(data))
    err = err if isinstance(err, dict) else {"message": str(err)}
    message, path = str(err.get("message") or "unknown error"), str(err.get("path") or "")
    if err.get("type") == "invalid_query":
        if path and message.startswith(f"{path}: "):
            message = message[len(path) + 2:]
        return BulkAnswer(index, error=SpanQueryError(path, message))
    return BulkAnswer(index, error=ServerError(url, 500, message))


# -- streams ---------------------------------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def delta_event(delta: str) -> dict[str, Any]:
    """The event of a piece of generated text."""
    return {"delta": delta}


def done_event(result: Result) -> dict[str, Any]:
    """The last event of a stream that succeeded: ``done`` and the answer's keys."""
    return {"done": True, **result_body(result)}


def error_event(exc: BaseException) -> dict[str, Any]:
    """The last event of a stream that failed after its first delta."""
    kind = "invalid_query" if isinstance(exc, SpanQueryError) else "internal_error"
    return {"error": {"message": str(exc) or type(exc).__name__, "type": kind}}


def parse_event(data: str, url: str) -> str | Result | None:
    """What one event of a stream carries, given its data (an SSE reader's ``data``, the
    ``data:`` field without its name): a delta (``str``), the final :class:`Result`
    (``done``), or ``None`` (no data). Raises the error an ``error`` event reports."""
    if not data.strip():
        return None
    event = json.loads(data)
    if "delta" in event:
        return str(event["delta"])
    if event.get("done"):
        return parse_result(event)
    if "error" in event:
        err = event["error"]
        message = _message(event) or "unknown error"
        if isinstance(err, dict) and err.get("type") == "invalid_query":
            raise SpanQueryError("", message)
        raise ServerError(url, 200, message)
    return None


__all__ = [
    "BULK_PATH", "MAX_BULK_BODY_BYTES", "NDJSON_MEDIA_TYPE", "bulk_answer", "bulk_answer_line",
    "bulk_body", "bulk_line", "parse_bulk_answer", "parse_bulk_body",
    "EXECUTE_PATH", "HEALTH_PATH", "MAX_BODY_BYTES", "QueryBody", "SSE_MEDIA_TYPE",
    "WRAPPER_KEYS", "delta_event", "done_event", "error_body", "error_event", "read_response",
    "parse_body", "parse_event", "parse_result", "request_body", "result_body", "sse",
    "too_large_body",
]
