"""Span-query IR: immutable expression trees of inference calls.

Leaves are messages: :class:`System`, :class:`User`, :class:`Assistant` and corpus
:class:`Fragment`. Interior nodes:

* :class:`Generate` (G) — an inference call over its ``input``;
* :class:`Plus` (``+``) — a *commutative* join: the order of its children does not matter, so each
  child's KV cache may be computed alone and reused at any position;
* :class:`Cross` (``x``) — an *ordered* join: every child depends on all that precedes it.

Sugar, removed by :mod:`span_workflows.optimize`: :class:`Chat` (G over a cross of messages),
:class:`Retrieve` (retrieved fragments, prepared then joined with plus), :class:`Repeat`
(n samples of one G), :class:`Map` (one G per input), :class:`Seq` (spnl's sequence = cross),
and :class:`Prepare` (compute each child's KV alone before use).

All nodes are frozen dataclasses: hashable, comparable, safe to share between trees.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

T = TypeVar("T")

#: spnl's defaults: ``max_tokens == 0`` means "up to the model's limit".
DEFAULT_MAX_TOKENS = 0
DEFAULT_TEMPERATURE = 0.6


@dataclass(frozen=True, slots=True)
class System:
    """A system message."""

    text: str

    def __repr__(self) -> str:
        return f"S({_short(self.text)})"


@dataclass(frozen=True, slots=True)
class User:
    """A user message."""

    text: str

    def __repr__(self) -> str:
        return f"U({_short(self.text)})"


@dataclass(frozen=True, slots=True)
class Assistant:
    """An assistant message (e.g. an earlier answer in a chat history)."""

    text: str

    def __repr__(self) -> str:
        return f"A({_short(self.text)})"


@dataclass(frozen=True, slots=True)
class Fragment:
    """A corpus fragment (a retrieved document). Rendered as a user message.

    ``source`` is free metadata (a file name, a URL) and is not part of the prompt.
    """

    text: str
    source: str = ""

    def __repr__(self) -> str:
        return f"F({_short(self.text)})"


@dataclass(frozen=True, slots=True)
class Plus:
    """Commutative join: children may be reordered and their KV reused at any position."""

    children: tuple[Node, ...]

    def __repr__(self) -> str:
        return "+(" + ", ".join(map(repr, self.children)) + ")"


@dataclass(frozen=True, slots=True)
class Cross:
    """Ordered join: each child is conditioned on everything before it."""

    children: tuple[Node, ...]

    def __repr__(self) -> str:
        return "x(" + ", ".join(map(repr, self.children)) + ")"


@dataclass(frozen=True, slots=True)
class Seq:
    """spnl's ``seq`` (or a list given as ``input``): an ordered join, kept for round trips.

    ``as_list`` remembers whether the JSON spelled it as a bare list.
    """

    children: tuple[Node, ...]
    as_list: bool = False

    def __repr__(self) -> str:
        return "seq(" + ", ".join(map(repr, self.children)) + ")"


@dataclass(frozen=True, slots=True)
class Generate:
    """G: generate text conditioned on ``input``.

    ``max_tokens == 0`` means up to the model's context limit. ``model`` ``None`` means the
    engine's model. ``inline_prompt`` is set by the optimizer on a G nested under a plus: the
    enclosing prompt then reuses this G's own prompt tokens followed by its output, so the KV
    computed while generating is a cache hit for the outer call.
    """

    input: Node
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    n: int = 1
    model: str | None = None
    inline_prompt: bool = False

    def __repr__(self) -> str:
        args = [repr(self.input)]
        if self.max_tokens:
            args.append(f"max_tokens={self.max_tokens}")
        if self.temperature != DEFAULT_TEMPERATURE:
            args.append(f"temperature={self.temperature}")
        if self.n != 1:
            args.append(f"n={self.n}")
        return "G(" + ", ".join(args) + ")"


@dataclass(frozen=True, slots=True)
class Chat:
    """Chat sugar: ``Chat(msgs)`` is ``G(x(*msgs))``."""

    messages: tuple[Node, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    model: str | None = None

    def __repr__(self) -> str:
        return "C(" + ", ".join(map(repr, self.messages)) + ")"


@dataclass(frozen=True, slots=True)
class Retrieve:
    """The fragments a retriever returned for ``query``; their order carries no meaning."""

    query: str
    fragments: tuple[Fragment, ...]

    def __repr__(self) -> str:
        return f"R({_short(self.query)}, {len(self.fragments)} fragments)"


@dataclass(frozen=True, slots=True)
class Prepare:
    """Compute the KV of each child of ``child`` (a plus) alone, with a G of max_tokens=1,
    before the enclosing generation uses it. Compiles to the same tokens as ``child``."""

    child: Plus

    def __repr__(self) -> str:
        return f"prepare({self.child!r})"


@dataclass(frozen=True, slots=True)
class Repeat:
    """``n`` independent samples of ``g``, joined with plus."""

    n: int
    g: Generate

    def __repr__(self) -> str:
        return f"repeat({self.n}, {self.g!r})"


@dataclass(frozen=True, slots=True)
class Map:
    """spnl's ``map``: one G per input string (a user message), joined with plus."""

    inputs: tuple[str, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    model: str | None = None

    def __repr__(self) -> str:
        return f"map({len(self.inputs)} inputs)"


Message = System | User | Assistant | Fragment
Node = (
    System | User | Assistant | Fragment | Plus | Cross | Seq | Generate | Chat | Retrieve
    | Prepare | Repeat | Map
)
MESSAGE_TYPES = (System, User, Assistant, Fragment)
JOIN_TYPES = (Plus, Cross, Seq)


def children_of(node: Node) -> tuple[Node, ...]:
    """The direct sub-nodes of ``node`` (messages have none)."""
    if isinstance(node, (Plus, Cross, Seq)):
        return node.children
    if isinstance(node, Generate):
        return (node.input,)
    if isinstance(node, Chat):
        return node.messages
    if isinstance(node, Retrieve):
        return node.fragments
    if isinstance(node, Prepare):
        return (node.child,)
    if isinstance(node, Repeat):
        return (node.g,)
    return ()


def fold_bottom_up(node: Node, combine: Callable[[Node, list[T]], T]) -> T:
    """``combine(n, [value of each child of n])`` for every node, children first; the value of
    ``node``. Iterative (trees as deep as the validator allows are fine); a node object that
    occurs several times is combined once."""
    done: dict[int, T] = {}
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if id(current) in done:
            continue
        kids = children_of(current)
        if not expanded and kids:
            stack.append((current, True))
            stack.extend((k, False) for k in reversed(kids) if id(k) not in done)
            continue
        done[id(current)] = combine(current, [done[id(k)] for k in kids])
    return done[id(node)]


def content_hash(node: Node) -> str:
    """A stable hex digest of a node's full content (type and every field)."""
    return hashlib.sha256(_canonical(node).encode("utf-8")).hexdigest()


def _canonical(node: object) -> str:
    """The canonical text of ``node`` that :func:`content_hash` digests.

    ``[a,b]`` for a tuple, ``(Type;field=value;...)`` for a node, JSON for a scalar. Built with
    an explicit stack (not recursion) so trees as deep as the validator allows are fine.
    """
    out: list[str] = []
    stack: list[object] = [node]
    while stack:
        item = stack.pop()
        if type(item) is _Literal:
            out.append(item)
        elif isinstance(item, tuple):
            todo: list[object] = [_Literal("[")]
            for i, x in enumerate(item):
                if i:
                    todo.append(_Literal(","))
                todo.append(x)
            todo.append(_Literal("]"))
            stack.extend(reversed(todo))
        elif hasattr(item, "__dataclass_fields__"):
            todo = [_Literal("(" + type(item).__name__)]
            for f in fields(item):  # type: ignore[arg-type]
                todo.append(_Literal(f";{f.name}="))
                todo.append(getattr(item, f.name))
            todo.append(_Literal(")"))
            stack.extend(reversed(todo))
        else:
            out.append(json.dumps(item))
    return "".join(out)


class _Literal(str):
    """Already-canonical text on :func:`_canonical`'s stack (as opposed to a str value)."""

    __slots__ = ()


def iter_nodes(node: Node):
    """Yield every node of the tree, depth first (iterative: deep trees are fine)."""
    stack: list[Node] = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(children_of(current)))


def _short(text: str, width: int = 24) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[: width - 1] + "…")


__all__ = [
    "Assistant", "Chat", "Cross", "DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE", "Fragment",
    "Generate", "JOIN_TYPES", "MESSAGE_TYPES", "Map", "Message", "Node", "Plus", "Prepare",
    "Repeat", "Retrieve", "Seq", "System", "User", "children_of", "content_hash",
    "fold_bottom_up", "iter_nodes",
]
