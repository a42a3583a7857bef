"""How a G samples: vLLM's sampling options, stop sequences, and constrained output (a JSON
schema, or tools the model may call).

A :class:`Sampling` rides on every :class:`~span_workflows.query.ir.Generate` (its ``sampling``
field; the default samples as before). Its options reach vLLM's ``SamplingParams`` unchanged
(:mod:`span_workflows.runtime.vllm_io`); an option vLLM would not honour is never accepted
(:meth:`Sampling.from_options` names the unknown key).

**Constrained output.** ``json_schema`` constrains the answer to JSON valid for that schema.
``tools`` (with ``tool_choice``) constrains it to the *answer format* of :func:`answer_schema`:

* ``{"tool_calls": [{"name": N, "arguments": {...}}, ...]}`` — one or more calls (at most
  as many as there are tools to choose from), each to a listed tool with arguments valid for
  its parameter schema;
* ``{"content": "..."}`` — a plain answer (only when ``tool_choice`` is ``"auto"``).

``tool_choice`` is ``"auto"`` (either form), ``"required"`` (calls only), ``"none"`` (the
tools are ignored: free text) or a tool's name (calls to that tool only). Tools named in
``used_tools`` are not offered (with ``"auto"`` and every tool used, only a plain answer is).
The generation is constrained by vLLM's structured outputs (xgrammar), so even a small model
produces a parseable answer; :func:`parse_answer` reads it back. :func:`tool_instructions` is
the text that describes the tools and the format to the model (a system message).

Schemas are stored as compact JSON text in their own key order (xgrammar has the model write
an object's properties in the schema's order), so a ``Sampling`` is frozen and hashable like
every IR node.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

#: ``tool_choice`` values other than a tool's name.
TOOL_CHOICES = ("auto", "required", "none")
#: The keys of an answer in the tool answer format.
CALLS_KEY, CONTENT_KEY = "tool_calls", "content"


def compact_json(value: Any) -> str:
    """``value`` as compact JSON text (no spaces), keys in their own order: a schema's
    property order is the order its fields are generated in, so it is kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool the model may call: its ``name``, a ``description`` and its ``parameters``
    (a JSON schema of the arguments object, as compact JSON text)."""

    name: str
    description: str = ""
    parameters: str = '{"properties":{},"type":"object"}'

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> ToolSpec:
        """A tool from OpenAI's form ``{"type": "function", "function": {"name", ...}}`` or
        its inner ``{"name", "description", "parameters"}``. Raises ``ValueError`` naming
        what is missing or wrong."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"a tool must be an object, got {type(spec).__name__}")
        if "function" in spec:
            spec = spec["function"]
            if not isinstance(spec, Mapping):
                raise ValueError("a tool's 'function' must be an object")
        unknown = set(spec) - {"name", "description", "parameters", "strict", "type"}
        if unknown:
            raise ValueError(f"unknown tool field(s): {', '.join(sorted(unknown))}")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool needs a non-empty 'name', got {name!r}")
        description = spec.get("description") or ""
        if not isinstance(description, str):
            raise ValueError(f"tool {name!r}: 'description' must be a string")
        parameters = spec.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tool {name!r}: 'parameters' must be a JSON schema object")
        return cls(name, description, compact_json(parameters))

    def to_dict(self) -> dict[str, Any]:
        """The inner OpenAI form: ``{"name", "description", "parameters"}``."""
        return {"name": self.name, "description": self.description,
                "parameters": json.loads(self.parameters)}


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling options of a G beyond ``max_tokens``/``temperature``/``n``.

    ``top_p`` in (0, 1]; ``top_k`` 0 (off) or >= 1; ``seed`` an int or ``None``;
    ``logprobs`` top-k log-probabilities per generated token (``None``: none);
    ``presence_penalty``/``frequency_penalty`` in [-2, 2]; ``stop``: stop sequences, applied
    by the sampler (generation ends there; the stop text is not returned); ``json_schema``:
    compact JSON text of the schema the answer must satisfy; ``tools``/``tool_choice``: see
    the module docstring; ``used_tools``: names of tools that stay described to the model (the
    prompt does not change) but may not be called in this answer, e.g. those an agent already
    called since the user's last message. ``json_schema`` and tools exclude each other.
    """

    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    json_schema: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str = "auto"
    used_tools: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Sampling:
        """A ``Sampling`` from plain options (the JSON IR's and the frameworks' spelling):
        the field names, with ``json_schema`` a schema object and ``tools`` a list of
        OpenAI-style tools. An unknown key, or a bad value, raises ``ValueError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(
                f"unsupported sampling option(s): {', '.join(sorted(unknown))} "
                f"(supported: {', '.join(sorted(known))})")
        values = dict(options)
        if values.get("stop") is not None:
            stop = values["stop"]
            values["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        else:
            values.pop("stop", None)
        schema = values.get("json_schema")
        if schema is not None:
            if not isinstance(schema, Mapping):
                raise ValueError(f"json_schema must be a JSON schema object, got "
                                 f"{type(schema).__name__}")
            values["json_schema"] = compact_json(schema)
        if values.get("used_tools") is not None:
            values["used_tools"] = tuple(values["used_tools"])
        if values.get("tools") is not None:
            values["tools"] = tuple(
                t if isinstance(t, ToolSpec) else ToolSpec.from_dict(t) for t in values["tools"]
            )
        else:
            values.pop("tools", None)
        for key in ("top_p", "top_k", "presence_penalty", "frequency_penalty", "tool_choice"):
            if values.get(key, 0) is None:
                values.pop(key)
        sampling = cls(**values)
        problem = sampling.problem()
        if problem:
            raise ValueError(problem)
        return sampling

    def to_options(self) -> dict[str, Any]:
        """The options that differ from the defaults, as :meth:`from_options` reads them."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name == "json_schema":
                value = json.loads(value)
            elif f.name == "tools":
                value = [{"type": "function", "function": t.to_dict()} for t in value]
            elif f.name in ("stop", "used_tools"):
                value = list(value)
            out[f.name] = value
        return out

    @property
    def uses_tools(self) -> bool:
        """Whether the answer is in the tool answer format (tools given, choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def problem(self) -> str | None:
        """What is wrong with these options (``None``: nothing)."""
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be a number in (0, 1], got {self.top_p!r}"
        if not _int(self.top_k) or self.top_k < 0:
            return f"top_k must be 0 (off) or a positive integer, got {self.top_k!r}"
        if self.seed is not None and not _int(self.seed):
            return f"seed must be an integer or None, got {self.seed!r}"
        if self.logprobs is not None and (not _int(self.logprobs) or not 0 <= self.logprobs
                                          <= 20):
            return f"logprobs must be an integer between 0 and 20 or None, got {self.logprobs!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                return f"{name} must be a number between -2 and 2, got {value!r}"
        if not isinstance(self.stop, tuple) or not all(
                isinstance(s, str) and s for s in self.stop):
            return f"stop must be a list of non-empty strings, got {self.stop!r}"
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (TypeError, ValueError):
                return "json_schema must be JSON text of a schema object"
            if not isinstance(schema, dict):
                return "json_schema must be a JSON schema object"
        if not isinstance(self.tools, tuple) or not all(
                isinstance(t, ToolSpec) for t in self.tools):
            return "tools must be a tuple of ToolSpec"
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            return f"tool names must be unique, got {names}"
        if not isinstance(self.tool_choice, str) or (
                self.tool_choice not in TOOL_CHOICES and self.tool_choice not in names):
            return (f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or the name of a "
                    f"given tool ({', '.join(names) or 'no tools given'}), "
                    f"got {self.tool_choice!r}")
        if not isinstance(self.used_tools, tuple) or not all(
                isinstance(n, str) and n in names for n in self.used_tools):
            return (f"used_tools must name given tools ({', '.join(names) or 'none given'}), "
                    f"got {self.used_tools!r}")
        if self.tools and self.json_schema is not None:
            return "json_schema and tools cannot be used together"
        return None


def answer_schema(sampling: Sampling) -> dict[str, Any] | None:
    """The JSON schema the answer is constrained to (``None``: free text)."""
    if sampling.json_schema is not None:
        return json.loads(sampling.json_schema)
    if not sampling.uses_tools:
        return None
    tools = [t for t in sampling.tools
             if sampling.tool_choice in ("auto", "required") or t.name == sampling.tool_choice]
    fresh = [t for t in tools if t.name not in sampling.used_tools]
    if fresh or sampling.tool_choice == "auto":
        tools = fresh  # a forced call may repeat a used tool when nothing else is left
    content = {"type": "object", "properties": {CONTENT_KEY: {"type": "string"}},
               "required": [CONTENT_KEY], "additionalProperties": False}
    if not tools:
        return content
    calls = [{
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    call_list = {
        "type": "object",
        "properties": {CALLS_KEY: {"type": "array", "minItems": 1, "maxItems": len(calls),
                                   "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}},
        "required": [CALLS_KEY],
        "additionalProperties": False,
    }
    if sampling.tool_choice != "auto":
        return call_list
    return {"anyOf": [call_list, content]}


def tool_instructions(sampling: Sampling) -> str:
    """The system text that lists the tools and the answer format to the model."""
    lines = ["You can call these tools:"]
    for t in sampling.tools:
        desc = f": {t.description}" if t.description else ""
        lines.append(f"- {t.name}{desc} Arguments (JSON schema): {t.parameters}")
    lines.append('To call tools, answer {"tool_calls": [{"name": <tool>, "arguments": {...}}]} '
                 "(several calls may go in one answer).")
    if sampling.tool_choice == "auto":
        lines.append('Once the tool results answer the question, reply {"content": <answer>}.')
    elif sampling.tool_choice != "required":
        lines.append(f"Call {sampling.tool_choice}.")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: the tool's ``name``, its ``arguments`` and a call ``id``."""

    name: str
    arguments: dict[str, Any]
    id: str


def parse_answer(text: str, call_ids: str = "call") -> tuple[str, list[ToolCall]] | None:
    """Read an answer in the tool answer format: ``(content, calls)``, ``content`` empty when
    it calls tools. Call ids are ``f"{call_ids}_{i}"``. ``None`` when ``text`` is not such an
    answer (e.g. cut short by ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get(CONTENT_KEY), str) and set(value) == {CONTENT_KEY}:
        return value[CONTENT_KEY], []
    calls = value.get(CALLS_KEY)
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for i, call in enumerate(calls):
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments"), dict)):
            return None
        out.append(ToolCall(call["name"], call["arguments"], f"{call_ids}_{i}"))
    return "", out


def render_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """An assistant turn that made these ``(name, arguments)`` calls, in the answer format
    and compact, as the engine generates it (how a call of an earlier turn is shown to the
    model in a history)."""
    return json.dumps({CALLS_KEY: [{"name": n, "arguments": dict(a)} for n, a in calls]},
                      ensure_ascii=False, separators=(",", ":"))


def render_content(text: str) -> str:
    """A plain answer of an earlier turn in the answer format."""
    return json.dumps({CONTENT_KEY: text}, ensure_ascii=False, separators=(",", ":"))


def render_tool_result(name: str, text: str, *, error: bool = False) -> str:
    """A tool's result as the turn the model reads after its call (a ``tool`` message)."""
    return f"Tool {name} returned{' an error' if error else ''}: {text}"


def _number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = [
    "CALLS_KEY", "CONTENT_KEY", "Sampling", "TOOL_CHOICES", "ToolCall", "ToolSpec",
    "answer_schema", "compact_json", "parse_answer", "render_calls", "render_content",
    "render_tool_result", "tool_instructions",
]
