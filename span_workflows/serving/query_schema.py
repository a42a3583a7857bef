"""The JSON schema of a ``/v1/query/execute`` request (``GET /v1/query/schema``).

Generated from the definitions the server validates with: the node kinds and the fields of
each node body (:data:`span_workflows.query.json_ir.NODE_KINDS`,
:data:`~span_workflows.query.json_ir.NODE_FIELDS`), the wrapper's keys
(:data:`span_workflows.serving.wire.WRAPPER_KEYS`), the span options' fields and choices
(:mod:`span_workflows.query.span_options`) and the limits of :mod:`span_workflows.query.validate`.
Each field's JSON type is described here, in :data:`FIELD_SCHEMAS`; a field the parser reads that
has no description here fails the generation (and the tests), so the two cannot drift apart.
What a schema cannot say (the depth and expanded-size limits, one spelling of a repeat's
body) is checked by the server only.
"""

from __future__ import annotations

from typing import Any

from span_workflows.query.ir import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, ROLE_MESSAGES
from span_workflows.query.json_ir import NODE_FIELDS, NODE_KINDS
from span_workflows.query.span_options import (
    ALIGN_CHOICES,
    ATTEND_CHOICES,
    PAD_CHOICES,
    SpanOptions,
)
from span_workflows.query.validate import MAX_SAMPLES, MAX_TEMPERATURE, MAX_TOKENS_LIMIT
from span_workflows.serving.wire import WRAPPER_KEYS

SCHEMA_PATH = "/v1/query/schema"
_NODE = {"$ref": "#/$defs/node"}
_MAX_TOKENS = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS_LIMIT,
               "default": DEFAULT_MAX_TOKENS, "description": "0: up to the model's limit"}
_TEMPERATURE = {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE,
                "default": DEFAULT_TEMPERATURE}
_MODEL = {"type": "string", "minLength": 1,
          "description": "ignored by this server: the served model answers"}
_G_BODY = {"$ref": "#/$defs/g_body"}

_PENALTY = {"type": "number", "minimum": -2, "maximum": 2, "default": 0}
_NAMES = {"type": "array", "items": {"type": "string", "minLength": 1}}
#: The JSON schema of each sampling option of a g
#: (:class:`~span_workflows.query.sampling.Sampling`).
SAMPLING_SCHEMAS: dict[str, dict[str, Any]] = {
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "top_k": {"type": "integer", "minimum": 0, "default": 0, "description": "0: off"},
    "seed": {"type": ["integer", "null"]},
    "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20,
                 "description": "top log-probabilities per generated token"},
    "presence_penalty": _PENALTY, "frequency_penalty": _PENALTY,
    "stop": {"oneOf": [{"type": "string", "minLength": 1}, _NAMES],
             "description": "stop sequences, applied by the sampler"},
    "json_schema": {"type": "object", "description": "the answer is JSON valid for it"},
    "tools": {"type": "array", "items": {"type": "object"},
              "description": "OpenAI-style tools the answer may call"},
    "tool_choice": {"type": "string", "default": "auto",
                    "description": "auto, required, none or a tool's name"},
    "used_tools": {**_NAMES, "description": "tools described but not callable now"},
}

#: The JSON schema of each field of each node body (keys as in ``NODE_FIELDS``).
FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "fragment": {"text": {"type": "string"}, "source": {"type": "string"}},
    "g": {"model": _MODEL, "input": _NODE, "max_tokens": _MAX_TOKENS,
          "temperature": _TEMPERATURE,
          "n": {"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES, "default": 1},
          "inline_prompt": {"type": "boolean", "default": False},
          "align": {"enum": list(ALIGN_CHOICES),
                    "description": "how this g reads the g's nested under a plus in its input "
                                   "(default: the query's span_options.align)"},
          **SAMPLING_SCHEMAS},
    "repeat": {"n": {"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES},
               "g": _G_BODY,
               "query": {"type": "object", "properties": {"g": _G_BODY}, "required": ["g"],
                         "description": "older spnl spelling"},
               "generate": _G_BODY},
    "map": {"metadata": {"$ref": "#/$defs/map_metadata"},
            "inputs": {"type": "array", "items": {"type": "string"}}},
    "map.metadata": {"model": _MODEL, "max_tokens": _MAX_TOKENS, "temperature": _TEMPERATURE},
    "chat": {"model": _MODEL, "messages": {"type": "array", "items": _NODE},
             "max_tokens": _MAX_TOKENS, "temperature": _TEMPERATURE},
    "retrieve": {"query": {"type": "string"},
                 "fragments": {"type": "array", "items": _NODE}},
}
#: Fields a node body must have.
REQUIRED: dict[str, tuple[str, ...]] = {"fragment": ("text",), "g": ("input",),
                                        "repeat": ("n",), "map": ("inputs",),
                                        "chat": ("messages",),
                                        "retrieve": ("query", "fragments")}
#: The JSON schema of each wrapper key.
WRAPPER_SCHEMAS: dict[str, dict[str, Any]] = {
    "query": _NODE,
    "stream": {"type": "boolean", "default": False},
    "optimize": {"type": "boolean", "default": True},
    "span_options": {"oneOf": [{"enum": list(ATTEND_CHOICES)},
                               {"$ref": "#/$defs/span_options"}]},
    "cache_salt": {"type": "string", "minLength": 1},
    "weights": {"type": "string", "minLength": 1,
                "description": "the base model's or an adapter's name (default: routed)"},
}
_SPAN_OPTION_SCHEMAS: dict[str, dict[str, Any]] = {
    "attend": {"enum": list(ATTEND_CHOICES)}, "pad": {"enum": list(PAD_CHOICES)},
    "pad_text": {"type": "string"}, "marker": {"type": "boolean"},
    "link_blocks": {"type": "integer", "minimum": 0},
    "align": {"enum": list(ALIGN_CHOICES)},
}


def _body(kind: str) -> dict[str, Any]:
    fields = NODE_FIELDS[kind]
    return {"type": "object", "additionalProperties": False,
            "properties": {f: FIELD_SCHEMAS[kind][f] for f in fields},
            "required": [f for f in REQUIRED.get(kind, ()) if f in fields]}


def _one(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": [kind],
            "properties": {kind: body}}


def _node_schema(kind: str) -> dict[str, Any]:
    if kind in ROLE_MESSAGES:
        return _one(kind, {"type": "string"})
    if kind == "fragment":
        return _one(kind, {"oneOf": [{"type": "string"}, _body("fragment")]})
    if kind in ("plus", "cross", "seq"):
        return _one(kind, {"type": "array", "items": _NODE})
    if kind == "g":
        return _one(kind, _G_BODY)
    if kind == "repeat":
        body = _body("repeat")
        body["oneOf"] = [{"required": [k]} for k in ("g", "query", "generate")]
        return _one(kind, body)
    if kind == "prepare":
        return _one(kind, _NODE)
    return _one(kind, _body(kind))


def query_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of a ``/v1/query/execute`` body: a bare query, or the
    wrapper object (``query`` and only :data:`~span_workflows.serving.wire.WRAPPER_KEYS`)."""
    option_fields = tuple(SpanOptions().as_dict())
    wrapper = {"type": "object", "additionalProperties": False, "required": ["query"],
               "properties": {k: WRAPPER_SCHEMAS[k] for k in sorted(WRAPPER_KEYS)}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_PATH,
        "title": "span query request",
        "description": "The body of POST /v1/query/execute: a span query in spnl's JSON IR, "
                       "bare, or wrapped with its options.",
        "oneOf": [{"$ref": "#/$defs/wrapper"}, _NODE],
        "$defs": {
            "wrapper": wrapper,
            "node": {"oneOf": [{"type": "array", "items": _NODE},
                               *(_node_schema(k) for k in NODE_KINDS)]},
            "g_body": _body("g"),
            "map_metadata": _body("map.metadata"),
            "span_options": {"type": "object", "additionalProperties": False,
                             "properties": {f: _SPAN_OPTION_SCHEMAS[f]
                                            for f in option_fields}},
        },
    }


__all__ = ["FIELD_SCHEMAS", "REQUIRED", "SCHEMA_PATH", "WRAPPER_SCHEMAS", "query_schema"]
