"""A parsed request of one span query: the query and its options (:class:`QueryBody`), and the
wrapped JSON form it travels in (:func:`request_body`, :func:`parse_body`).

The form is the server's (:mod:`span_workflows.serving.wire` documents the whole wire
protocol); it lives here, below the engine and the server, because the engine's bulk runs and
the server both read it: ``{"query": Q, "stream": false, "optimize": true, "span_options":
{...}, "cache_salt": "...", "weights": "<the base's or an adapter's name>"}`` (only
:data:`WRAPPER_KEYS`; every key but ``query`` optional), or a bare query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Node
from span_workflows.query.json_ir import from_json, parse_json, to_obj
from span_workflows.query.span_options import SpanOptions

#: The keys of a wrapped request; any other key means the body is a bare query.
WRAPPER_KEYS = frozenset({"query", "stream", "optimize", "span_options", "cache_salt",
                          "weights"})


@dataclass(frozen=True, slots=True)
class QueryBody:
    """A parsed request: the query and its options."""

    node: Node
    stream: bool = False
    optimize: bool = True
    span_options: SpanOptions | None = None
    cache_salt: str | None = None
    #: the weights asked for by name (``None``: routed)
    weights: str | None = None


def request_body(query: Node | dict | list | str, *, stream: bool, optimize_query: bool = True,
                 span_options: SpanOptions | str | dict | None = None,
                 cache_salt: str | None = None, weights: str | None = None) -> dict[str, Any]:
    """The JSON request for ``query`` (a tree, its JSON value, or JSON text, checked here)."""
    if isinstance(query, str):
        query = from_json(query)
    body: dict[str, Any] = {"query": to_obj(query) if not isinstance(query, (dict, list))
                            else query, "stream": stream}
    if not optimize_query:
        body["optimize"] = False
    if span_options is not None:
        body["span_options"] = SpanOptions.coerce(span_options).as_dict()
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if weights is not None:
        body["weights"] = weights
    return body


def parse_body(body: bytes) -> QueryBody:
    """The query and options of a request body; :class:`SpanQueryError` if it is bad."""
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpanQueryError("", f"request body is not valid UTF-8 ({exc.reason} at byte "
                                 f"{exc.start})") from None
    if not text.strip():
        raise SpanQueryError("", "empty request body: expected a span query in JSON")
    obj = parse_json(text)
    if not (isinstance(obj, dict) and "query" in obj and set(obj) <= WRAPPER_KEYS):
        return QueryBody(from_json(obj))
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise SpanQueryError("stream", "must be true or false")
    optimize_query = obj.get("optimize", True)
    if not isinstance(optimize_query, bool):
        raise SpanQueryError("optimize", "must be true or false")
    salt = obj.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise SpanQueryError("cache_salt", "must be a non-empty string")
    weights = obj.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights):
        raise SpanQueryError("weights", "must be the name of the base model or of an adapter")
    options = obj.get("span_options")
    return QueryBody(from_json(obj["query"]), stream, optimize_query,
                     None if options is None else SpanOptions.coerce(options), salt, weights)


__all__ = ["WRAPPER_KEYS", "QueryBody", "parse_body", "request_body"]
