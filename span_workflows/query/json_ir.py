"""Read and write span queries as JSON: spnl's JSON IR plus this project's extensions.

spnl's spellings (its serde format for ``Query``)::

    {"g": {"model": M, "input": Q, "max_tokens": 0, "temperature": 0.6}}
    {"plus": [Q, ...]}   {"cross": [Q, ...]}   {"seq": [Q, ...]}   [Q, ...]  (a bare list = seq)
    {"user": "..."}   {"system": "..."}   {"assistant": "..."}
    {"repeat": {"n": N, "g": {...the body of a g...}}}
    {"map": {"metadata": {"model": M, "max_tokens": 0, "temperature": 0.6}, "inputs": ["..."]}}

``model`` may be left out (the engine's model is used); ``max_tokens`` defaults to 0 (up to the
model's limit) and ``temperature`` to 0.6, as in spnl. A repeat is also read in older spnl
spellings, ``{"n": N, "query": {"g": {...}}}``, ``{"n": N, "g": {"g": {...}}}`` and
``{"n": N, "generate": {...}}``; it is always written as ``{"n": N, "g": {...}}``.

Extensions::

    {"fragment": "..."}  or  {"fragment": {"text": "...", "source": "..."}}
    {"chat": {"model": M, "messages": [Q, ...], "max_tokens": 0, "temperature": 0.6}}
    {"retrieve": {"query": "...", "fragments": [{"fragment": ...}, ...]}}
    {"prepare": {"plus": [Q, ...]}}
    in a g: "n": N (written only when not 1), "inline_prompt": true (written only when true)
    in a g, sampling (each written only when not its default; see span_workflows.query.sampling):
        "top_p": 1.0, "top_k": 0, "seed": S, "logprobs": K, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "stop": ["..."], "json_schema": {...schema...},
        "tools": [{"type": "function", "function": {"name", "description", "parameters"}}],
        "tool_choice": "auto" | "required" | "none" | a tool's name

Errors raise :class:`~span_workflows.errors.SpanQueryError` whose path follows
:mod:`span_workflows.query.validate`'s convention, e.g. ``input.cross[2]: unknown node 'plux'``.
Parsing and conversion use explicit stacks, never recursion: arbitrarily deep input fails with
a ``SpanQueryError``, not a ``RecursionError``.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ROLE_MESSAGES,
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Node,
    Plus,
    Prepare,
    Repeat,
    Retrieve,
    Seq,
    System,
    User,
    fold_bottom_up,
    join_path,
    role_of,
)
from span_workflows.query.sampling import Sampling
from span_workflows.query.span_options import check_align
from span_workflows.query.validate import MAX_DEPTH, validate

#: The sampling options a g may carry (the fields of :class:`Sampling`).
SAMPLING_FIELDS = tuple(f.name for f in dataclass_fields(Sampling))

#: The deepest JSON bracket nesting read. Generous: any tree of at most ``MAX_DEPTH`` levels
#: fits (no node spelling uses more than three brackets per level); the tree depth itself is
#: checked exactly while converting.
MAX_JSON_NESTING = 4 * MAX_DEPTH + 8

#: The node kinds the parser reads: the one key of a node object (a bare list is a seq).
NODE_KINDS = (*ROLE_MESSAGES, "fragment", "plus", "cross", "seq", "g", "repeat", "map", "chat",
              "retrieve", "prepare")
#: The fields each node body accepts, by kind (``map.metadata``: the map's metadata object).
#: The parser reads exactly these; ``GET /v1/query/schema`` is generated from them.
NODE_FIELDS: dict[str, tuple[str, ...]] = {
    "fragment": ("text", "source"),
    "g": ("model", "input", "max_tokens", "temperature", "n", "inline_prompt", "align",
          *SAMPLING_FIELDS),
    "repeat": ("n", "g", "query", "generate"),
    "map": ("metadata", "inputs"),
    "map.metadata": ("model", "max_tokens", "temperature"),
    "chat": ("model", "messages", "max_tokens", "temperature"),
    "retrieve": ("query", "fragments"),
}

#: spnl nodes this project does not implement (named in the error, to tell them from typos).
_SPNL_UNSUPPORTED = frozenset({"par", "monad", "zip", "augment", "print", "ask", "file", "bulk"})



# --------------------------------------------------------------------------------------------
# Public API


def from_json(text_or_obj: str | bytes | bytearray | memoryview | dict | list) -> Node:
    """Parse a span query from JSON text (``str`` or UTF-8 ``bytes``) or an already-loaded
    JSON value (``dict``/``list``), then :func:`~span_workflows.query.validate.validate` it.

    Raises :class:`SpanQueryError` for invalid UTF-8, malformed JSON (``"malformed JSON at
    line L column C: ..."``), JSON nested too deeply, and any ill-formed node (with its path).
    """
    if isinstance(text_or_obj, (bytes, bytearray, memoryview)):
        text_or_obj = _decode(bytes(text_or_obj))
    obj = parse_json(text_or_obj) if isinstance(text_or_obj, str) else text_or_obj
    node = _convert(obj)
    validate(node)
    return node


def to_obj(node: Node) -> object:
    """The JSON value (nested dicts, lists, strs and numbers) of a valid tree.

    Validates ``node`` first (so only trees :func:`from_json` accepts can be written). Key order
    is canonical: a g writes ``model`` (if any), ``input``, ``max_tokens``, ``temperature``,
    then ``n`` (if not 1), ``inline_prompt`` (if true) and ``align`` (if set).
    """
    validate(node)
    return fold_bottom_up(node, _to_obj_one)


def to_json(node: Node, *, indent: int | None = None) -> str:
    """Serialize a valid tree as JSON text (UTF-8 friendly: non-ASCII is written as is).

    ``indent=None`` writes compact JSON without spaces (like ``serde_json::to_string``); an int
    pretty-prints with that many spaces per level (like ``serde_json::to_string_pretty`` for 2).
    """
    return dump_json(to_obj(node), indent=indent)


# --------------------------------------------------------------------------------------------
# Text -> JSON value (iterative)

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def _decode(data: bytes) -> str:
    """UTF-8 bytes (an optional byte order mark is skipped) as text."""
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = skip + err.start
        raise SpanQueryError(
            "",
            f"query is not valid UTF-8: byte 0x{data[offset]:02x} at offset {offset} "
            f"({err.reason})",
        ) from None


def _malformed(text: str, message: str, pos: int) -> SpanQueryError:
    err = json.JSONDecodeError(message, text, pos)
    return SpanQueryError(
        "", f"malformed JSON at line {err.lineno} column {err.colno}: {message}"
    )


def parse_json(text: str, *, max_nesting: int = MAX_JSON_NESTING) -> object:
    """Parse strict JSON (RFC 8259: no NaN/Infinity) without recursion.

    Raises :class:`SpanQueryError` with path ``""``: ``malformed JSON at line L column C: ...``,
    or a nesting error when brackets nest deeper than ``max_nesting``. Duplicate keys: the last
    one wins, as with :func:`json.loads`.
    """
    containers: list[dict | list] = []
    keys: list[str | None] = []
    end = len(text)
    pos = _WS.match(text, 0).end()
    while True:
        # Read one value starting at pos.
        char = text[pos : pos + 1]
        value: object
        if char in ("{", "["):
            if len(containers) >= max_nesting:
                raise SpanQueryError(
                    "", f"JSON nests deeper than {max_nesting} levels (a span query may have at "
                    f"most {MAX_DEPTH} levels)"
                )
            pos = _WS.match(text, pos + 1).end()
            if char == "{":
                if text[pos : pos + 1] == "}":
                    value, pos = {}, pos + 1
                else:
                    key, pos = _read_key(text, pos)
                    containers.append({})
                    keys.append(key)
                    continue
            elif text[pos : pos + 1] == "]":
                value, pos = [], pos + 1
            else:
                containers.append([])
                keys.append(None)
                continue
        elif char == '"':
            try:
                value, pos = json.decoder.scanstring(text, pos + 1, True)
            except json.JSONDecodeError as err:
                raise _malformed(text, err.msg, err.pos) from None
        elif char == "t" and text.startswith("true", pos):
            value, pos = True, pos + 4
        elif char == "f" and text.startswith("false", pos):
            value, pos = False, pos + 5
        elif char == "n" and text.startswith("null", pos):
            value, pos = None, pos + 4
        else:
            match = _NUMBER.match(text, pos)
            if match is None:
                raise _malformed(text, "Expecting value", pos)
            integer, frac, exp = match.groups()
            try:
                value = float(match.group()) if frac or exp else int(integer)
            except ValueError as err:  # e.g. more digits than int() accepts
                raise _malformed(text, str(err), pos) from None
            pos = match.end()
        # Attach the value to its container; close every container that ends here.
        while True:
            if not containers:
                pos = _WS.match(text, pos).end()
                if pos != end:
                    raise _malformed(text, "Extra data", pos)
                return value
            top = containers[-1]
            if isinstance(top, dict):
                top[keys[-1]] = value  # type: ignore[index]
            else:
                top.append(value)
            pos = _WS.match(text, pos).end()
            char = text[pos : pos + 1]
            if char == ",":
                pos = _WS.match(text, pos + 1).end()
                if isinstance(top, dict):
                    keys[-1], pos = _read_key(text, pos)
                break
            if char == ("}" if isinstance(top, dict) else "]"):
                value = containers.pop()
                keys.pop()
                pos += 1
                continue
            raise _malformed(text, "Expecting ',' delimiter", pos)


def _read_key(text: str, pos: int) -> tuple[str, int]:
    """Read ``"key" :`` at ``pos``; return the key and the position of the value."""
    if text[pos : pos + 1] != '"':
        raise _malformed(text, "Expecting property name enclosed in double quotes", pos)
    try:
        key, pos = json.decoder.scanstring(text, pos + 1, True)
    except json.JSONDecodeError as err:
        raise _malformed(text, err.msg, err.pos) from None
    pos = _WS.match(text, pos).end()
    if text[pos : pos + 1] != ":":
        raise _malformed(text, "Expecting ':' delimiter", pos)
    return key, _WS.match(text, pos + 1).end()


# --------------------------------------------------------------------------------------------
# JSON value -> text (iterative)


class _Raw(str):
    """Finished JSON text on :func:`dump_json`'s stack (as opposed to a str value)."""

    __slots__ = ()


def dump_json(obj: object, *, indent: int | None = None) -> str:
    """Write a JSON value (dict, list/tuple, str, int, float, bool, None) without recursion.

    Compact (``,`` and ``:``) when ``indent`` is None, else one item per line. Dict keys keep
    their insertion order. Raises ``ValueError`` for NaN/infinity and ``TypeError`` for other
    types.
    """
    out: list[str] = []
    stack: list[tuple[object, int]] = [(obj, 0)]
    colon = ":" if indent is None else ": "
    while stack:
        item, level = stack.pop()
        if type(item) is _Raw:
            out.append(item)
        elif isinstance(item, dict):
            if not item:
                out.append("{}")
                continue
            todo: list[tuple[object, int]] = [(_Raw("{"), level)]
            for i, (key, val) in enumerate(item.items()):
                if not isinstance(key, str):
                    raise TypeError(f"JSON keys must be str, got {type(key).__name__}")
                sep = "," if i else ""
                todo.append((_Raw(sep + _newline(indent, level + 1) + _scalar(key) + colon),
                             level))
                todo.append((val, level + 1))
            todo.append((_Raw(_newline(indent, level) + "}"), level))
            stack.extend(reversed(todo))
        elif isinstance(item, (list, tuple)):
            if not item:
                out.append("[]")
                continue
            todo = [(_Raw("["), level)]
            for i, val in enumerate(item):
                todo.append((_Raw(("," if i else "") + _newline(indent, level + 1)), level))
                todo.append((val, level + 1))
            todo.append((_Raw(_newline(indent, level) + "]"), level))
            stack.extend(reversed(todo))
        else:
            out.append(_scalar(item))
    return "".join(out)


def _newline(indent: int | None, level: int) -> str:
    return "" if indent is None else "\n" + " " * (indent * level)


def _scalar(value: object) -> str:
    if value is None or isinstance(value, (str, bool, int, float)):
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


# --------------------------------------------------------------------------------------------
# Tree -> JSON value


def _g_body(node: Generate, input_obj: object) -> dict:
    body: dict[str, object] = {}
    if node.model is not None:
        body["model"] = node.model
    body["input"] = input_obj
    body["max_tokens"] = node.max_tokens
    body["temperature"] = node.temperature
    if node.n != 1:
        body["n"] = node.n
    if node.inline_prompt:
        body["inline_prompt"] = True
    if node.align is not None:
        body["align"] = node.align
    body.update(node.sampling.to_options())
    return body


def _metadata(node: Chat | Map) -> dict:
    meta: dict[str, object] = {}
    if node.model is not None:
        meta["model"] = node.model
    meta["max_tokens"] = node.max_tokens
    meta["temperature"] = node.temperature
    return meta


def _to_obj_one(node: Node, kids: list[object]) -> object:
    """The JSON value of ``node`` given those of its children."""
    if isinstance(node, (System, User, Assistant)):
        return {role_of(node): node.text}
    if isinstance(node, Fragment):
        if node.source:
            return {"fragment": {"text": node.text, "source": node.source}}
        return {"fragment": node.text}
    if isinstance(node, Plus):
        return {"plus": kids}
    if isinstance(node, Cross):
        return {"cross": kids}
    if isinstance(node, Seq):
        return kids if node.as_list else {"seq": kids}
    if isinstance(node, Generate):
        return {"g": _g_body(node, kids[0])}
    if isinstance(node, Repeat):
        return {"repeat": {"n": node.n, "g": kids[0]["g"]}}  # type: ignore[index]
    if isinstance(node, Map):
        return {"map": {"metadata": _metadata(node), "inputs": list(node.inputs)}}
    if isinstance(node, Chat):
        meta = _metadata(node)
        body: dict[str, object] = {"model": meta.pop("model")} if "model" in meta else {}
        body["messages"] = kids
        body.update(meta)
        return {"chat": body}
    if isinstance(node, Retrieve):
        return {"retrieve": {"query": node.query, "fragments": kids}}
    if isinstance(node, Prepare):
        return {"prepare": kids[0]}
    raise TypeError(f"not a span-query node: {type(node).__name__}")


# --------------------------------------------------------------------------------------------
# JSON value -> tree (iterative)


@dataclass
class _Frame:
    """A node being converted: its children's JSON values, then their converted nodes."""

    build: Callable[[list[Node]], Node]
    children: list[tuple[object, str]]
    depth: int
    done: list[Node] = field(default_factory=list)
    next: int = 0


def _convert(obj: object) -> Node:
    item = _open(obj, "", 1)
    if not isinstance(item, _Frame):
        return item
    stack = [item]
    while True:
        frame = stack[-1]
        if frame.next < len(frame.children):
            child_obj, child_path = frame.children[frame.next]
            frame.next += 1
            child = _open(child_obj, child_path, frame.depth + 1)
            if isinstance(child, _Frame):
                stack.append(child)
            else:
                frame.done.append(child)
            continue
        node = frame.build(frame.done)
        stack.pop()
        if not stack:
            return node
        stack[-1].done.append(node)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _open(obj: object, path: str, depth: int) -> Node | _Frame:
    """Check the JSON value of one node; return the node (a leaf) or a frame for its children."""
    if depth > MAX_DEPTH:
        raise SpanQueryError("", f"tree is deeper than {MAX_DEPTH} levels")
    if isinstance(obj, (list, tuple)):
        return _seq_frame(obj, path, depth, as_list=True)
    if not isinstance(obj, dict):
        raise SpanQueryError(path, f"expected a node object, got {_type_name(obj)}")
    if len(obj) != 1:
        listed = ", ".join(repr(k) for k in obj) or "none"
        raise SpanQueryError(
            path, f"a node object must have exactly one key, got {len(obj)}: {listed}"
        )
    ((kind, body),) = obj.items()
    if kind in ROLE_MESSAGES:
        return ROLE_MESSAGES[kind](_string(body, kind, path))
    if kind == "fragment":
        return _fragment(body, path)
    if kind in ("plus", "cross"):
        cls = Plus if kind == "plus" else Cross
        items = _list(body, kind, path)
        return _Frame(
            lambda kids, cls=cls: cls(tuple(kids)),
            [(x, join_path(path, f"{kind}[{i}]")) for i, x in enumerate(items)],
            depth,
        )
    if kind == "seq":
        return _seq_frame(_list(body, kind, path), path, depth, as_list=False)
    if kind == "g":
        return _g_frame(body, path, depth, "g")
    if kind == "repeat":
        return _repeat_frame(body, path, depth)
    if kind == "map":
        return _map(body, path)
    if kind == "chat":
        return _chat_frame(body, path, depth)
    if kind == "retrieve":
        return _retrieve_frame(body, path, depth)
    if kind == "prepare":
        return _Frame(lambda kids: Prepare(kids[0]), [(body, join_path(path, "prepare"))], depth)
    if kind in _SPNL_UNSUPPORTED:
        raise SpanQueryError(path, f"spnl node {kind!r} is not supported here")
    raise SpanQueryError(path, f"unknown node {kind!r}")


def _seq_frame(items: list | tuple, path: str, depth: int, *, as_list: bool) -> _Frame:
    segment = "[{}]" if as_list else "seq[{}]"
    return _Frame(
        lambda kids: Seq(tuple(kids), as_list),
        [(x, join_path(path, segment.format(i))) for i, x in enumerate(items)],
        depth,
    )


def _fields(body: object, what: str, path: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise SpanQueryError(path, f"{what} must be an object, got {_type_name(body)}")
    unknown = [k for k in body if k not in allowed]
    if unknown:
        raise SpanQueryError(
            path,
            f"unknown field {unknown[0]!r} in {what} (expected {', '.join(allowed)})",
        )
    return body


def _string(value: object, what: str, path: str) -> str:
    if not isinstance(value, str):
        raise SpanQueryError(path, f"{what} must be a string, got {_type_name(value)}")
    return value


def _list(value: object, what: str, path: str) -> list | tuple:
    if not isinstance(value, (list, tuple)):
        raise SpanQueryError(path, f"{what} must be a list, got {_type_name(value)}")
    return value


def _int(body: dict, key: str, default: int, what: str, path: str) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpanQueryError(path, f"{what} {key} must be an integer, got {_type_name(value)}")
    return value


def _temperature(body: dict, what: str, path: str) -> float:
    value = body.get("temperature", DEFAULT_TEMPERATURE)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SpanQueryError(path, f"{what} temperature must be a number, got {_type_name(value)}")
    return float(value)


def _model(body: dict, what: str, path: str) -> str | None:
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise SpanQueryError(path, f"{what} model must be a string, got {_type_name(value)}")
    return value


def _fragment(body: object, path: str) -> Fragment:
    if isinstance(body, str):
        return Fragment(body)
    body = _fields(body, "fragment", path, NODE_FIELDS["fragment"])
    if "text" not in body:
        raise SpanQueryError(path, "fragment is missing 'text'")
    return Fragment(
        _string(body["text"], "fragment text", path),
        _string(body.get("source", ""), "fragment source", path),
    )


_G_FIELDS = NODE_FIELDS["g"]


def _g_frame(body: object, path: str, depth: int, what: str) -> _Frame:
    body = _fields(body, what, path, _G_FIELDS)
    if "input" not in body:
        raise SpanQueryError(path, f"{what} is missing 'input'")
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, what, path)
    temperature = _temperature(body, what, path)
    n = _int(body, "n", 1, what, path)
    model = _model(body, what, path)
    inline = body.get("inline_prompt", False)
    if not isinstance(inline, bool):
        raise SpanQueryError(
            path, f"{what} inline_prompt must be a boolean, got {_type_name(inline)}"
        )
    align = body.get("align")
    if align is not None:
        check_align(align, join_path(path, "align"))
    try:
        sampling = Sampling.from_options({k: body[k] for k in SAMPLING_FIELDS if k in body})
    except (TypeError, ValueError) as exc:
        raise SpanQueryError(path, f"{what}: {exc}") from None
    return _Frame(
        lambda kids: Generate(kids[0], max_tokens, temperature, n, model, inline, sampling,
                              align),
        [(body["input"], join_path(path, "input"))],
        depth,
    )


def _repeat_frame(body: object, path: str, depth: int) -> _Frame:
    body = _fields(body, "repeat", path, NODE_FIELDS["repeat"])
    spellings = [k for k in ("g", "query", "generate") if k in body]
    if len(spellings) != 1:
        raise SpanQueryError(path, "repeat needs exactly one of 'g', 'query' or 'generate'")
    if "n" not in body:
        raise SpanQueryError(path, "repeat is missing 'n'")
    n = _int(body, "n", 1, "repeat", path)
    g_path = join_path(path, "repeat.g")
    g_body = body[spellings[0]]
    # spnl's current spelling holds the g's body; older ones hold a whole {"g": ...} node.
    wrapped = (
        spellings[0] == "query"
        or (spellings[0] == "g" and isinstance(g_body, dict) and list(g_body) == ["g"])
    )
    if wrapped:
        if not (isinstance(g_body, dict) and list(g_body) == ["g"]):
            raise SpanQueryError(g_path, "a repeat's query must be a g node")
        g_body = g_body["g"]
    # The repeat and its g are two levels; the g's frame converts the g's input.
    if depth + 1 > MAX_DEPTH:
        raise SpanQueryError("", f"tree is deeper than {MAX_DEPTH} levels")
    g_frame = _g_frame(g_body, g_path, depth + 1, "g")
    build_g = g_frame.build
    g_frame.build = lambda kids: Repeat(n, build_g(kids))  # type: ignore[arg-type]
    return g_frame


def _map(body: object, path: str) -> Map:
    body = _fields(body, "map", path, NODE_FIELDS["map"])
    meta = _fields(body.get("metadata", {}), "map metadata", path, NODE_FIELDS["map.metadata"])
    if "inputs" not in body:
        raise SpanQueryError(path, "map is missing 'inputs'")
    inputs = _list(body["inputs"], "map inputs", path)
    texts = tuple(
        _string(x, "map input", join_path(path, f"map.inputs[{i}]")) for i, x in enumerate(inputs)
    )
    return Map(
        texts,
        _int(meta, "max_tokens", DEFAULT_MAX_TOKENS, "map", path),
        _temperature(meta, "map", path),
        _model(meta, "map", path),
    )


def _chat_frame(body: object, path: str, depth: int) -> _Frame:
    body = _fields(body, "chat", path, NODE_FIELDS["chat"])
    if "messages" not in body:
        raise SpanQueryError(path, "chat is missing 'messages'")
    messages = _list(body["messages"], "chat messages", path)
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, "chat", path)
    temperature = _temperature(body, "chat", path)
    model = _model(body, "chat", path)
    return _Frame(
        lambda kids: Chat(tuple(kids), max_tokens, temperature, model),
        [(x, join_path(path, f"chat.messages[{i}]")) for i, x in enumerate(messages)],
        depth,
    )


def _retrieve_frame(body: object, path: str, depth: int) -> _Frame:
    body = _fields(body, "retrieve", path, NODE_FIELDS["retrieve"])
    query = _string(body.get("query"), "retrieve query", path)
    if "fragments" not in body:
        raise SpanQueryError(path, "retrieve is missing 'fragments'")
    items = _list(body["fragments"], "retrieve fragments", path)
    return _Frame(
        lambda kids: Retrieve(query, tuple(kids)),  # type: ignore[arg-type]
        [(x, join_path(path, f"retrieve.fragments[{i}]")) for i, x in enumerate(items)],
        depth,
    )


__all__ = ["MAX_JSON_NESTING", "NODE_FIELDS", "NODE_KINDS", "dump_json", "from_json",
           "parse_json", "to_json", "to_obj"]
