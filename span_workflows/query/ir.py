"""Span-query IR: immutable expression trees of inference calls.

Leaves are messages: :class:`System`, :class:`User`, :class:`Assistant` and corpus
:class:`Fragment`. Interior nodes:

* :class:`Generate` (G) — an inference call over its ``input``;
* :class:`Plus` (``+``) — a *commutative* join: the order of its children does not matter, so each
  child's KV cache may be computed alone and reused at any position;
* :class:`Cross` (``x``) — an *ordered* join: every child depends on all that precedes it.

Sugar, removed by :mod:`span_workflows.compiler.optimize`: :class:`Chat` (G over a cross of
messages),
:class:`Retrieve` (retrieved fragments, prepared then joined with plus), :class:`Repeat`
(n samples of one G), :class:`Map` (one G per input), :class:`Seq` (spnl's sequence = cross),
and :class:`Prepare` (compute each child's KV alone before use).

All nodes are frozen dataclasses: hashable, comparable, safe to share between trees.

This module is also the one home of a tree's *shape*: which node types exist
(:data:`NODE_TYPES`) and which chat role each message has (:data:`ROLE_MESSAGES`,
:func:`role_of`), a node's children (:func:`children_of`, :func:`with_children`), the
paths that name nodes in errors and results (:func:`join_path`, :func:`child_segment`,
:func:`child_path`, :func:`walk`) and the iterative bottom-up traversals every pass is built
from (:func:`fold_bottom_up`, :func:`rewrite_bottom_up`).

**Paths.** Segments are joined with ``.``; an index segment ``[i]`` attaches without one. A G
contributes ``input``; a child of a plus ``plus[i]``, of a cross ``cross[i]``, of a seq
``seq[i]`` (``[i]`` when the seq was spelled as a bare JSON list); a chat message
``chat.messages[i]``; the G of a repeat ``repeat.g``; a retrieved fragment
``retrieve.fragments[i]``; the plus of a prepare ``prepare``. The third child of the cross that
is the root G's input is ``input.cross[2]``; the root itself is ``""``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TypeVar

from span_workflows.query.sampling import Sampling

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
    computed while generating is a cache hit for the outer call. ``sampling`` holds the
    other sampling options, stop sequences and constrained output (a JSON schema or tools):
    see :mod:`span_workflows.query.sampling`. ``align`` says how this G reads the G's nested under
    a plus in its input (``"recompute"``, ``"pad"``, ``"bias"`` or ``"crop"``, see
    :mod:`span_workflows.query.span_options`); ``None``: the query's ``SpanOptions.align``.
    """

    input: Node
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    n: int = 1
    model: str | None = None
    inline_prompt: bool = False
    sampling: Sampling = Sampling()
    align: str | None = None

    def __repr__(self) -> str:
        args = [repr(self.input)]
        if self.max_tokens:
            args.append(f"max_tokens={self.max_tokens}")
        if self.temperature != DEFAULT_TEMPERATURE:
            args.append(f"temperature={self.temperature}")
        if self.n != 1:
            args.append(f"n={self.n}")
        if self.sampling != Sampling():
            args.append(f"sampling={self.sampling.to_options()!r}")
        if self.align is not None:
            args.append(f"align={self.align!r}")
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
#: Every node type of the IR.
NODE_TYPES: tuple[type, ...] = (
    System, User, Assistant, Fragment, Plus, Cross, Seq, Generate, Chat, Retrieve, Prepare,
    Repeat, Map,
)

#: The chat roles, each with its message node (also the JSON IR's message keys).
ROLE_MESSAGES: dict[str, type[System] | type[User] | type[Assistant]] = {
    "system": System, "user": User, "assistant": Assistant,
}
#: What frameworks call these roles (LangChain's message types, LlamaIndex's ``MessageRole``).
ROLE_ALIASES: dict[str, str] = {
    "human": "user", "tool": "user", "function": "user",
    "ai": "assistant", "chatbot": "assistant", "model": "assistant",
    "developer": "system",
}


def role_of(message: Message) -> str:
    """The chat role a message leaf is rendered with (fragments are user messages)."""
    if isinstance(message, System):
        return "system"
    if isinstance(message, Assistant):
        return "assistant"
    if isinstance(message, (User, Fragment)):
        return "user"
    raise TypeError(f"not a message: {message!r}")


def role_name(name: str) -> str:
    """The chat role a framework's role name stands for (:data:`ROLE_ALIASES`); a name it
    does not know is a user turn."""
    name = name.lower()
    return name if name in ROLE_MESSAGES else ROLE_ALIASES.get(name, "user")


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


def with_children(node: Node, kids: tuple[Node, ...]) -> Node:
    """``node`` with its children (as :func:`children_of` lists them) replaced by ``kids``."""
    if isinstance(node, (Plus, Cross, Seq)):
        return dataclasses.replace(node, children=kids)
    if isinstance(node, Generate):
        return dataclasses.replace(node, input=kids[0])
    if isinstance(node, Chat):
        return dataclasses.replace(node, messages=kids)
    if isinstance(node, Retrieve):
        return dataclasses.replace(node, fragments=kids)
    if isinstance(node, Prepare):
        return Prepare(kids[0])  # type: ignore[arg-type]
    if isinstance(node, Repeat):
        return Repeat(node.n, kids[0])  # type: ignore[arg-type]
    raise TypeError(f"{type(node).__name__} has no children")


def join_path(path: str, segment: str) -> str:
    """``path`` extended by ``segment``.

    ``join_path("a", "b")`` is ``"a.b"``; an index attaches directly: ``join_path("a", "[0]")``
    is ``"a[0]"``; ``join_path("", "b")`` is ``"b"``.
    """
    if not path:
        return segment
    if segment.startswith("["):
        return path + segment
    return f"{path}.{segment}"


def child_segment(parent: Node, index: int) -> str:
    """The path segment of the ``index``-th entry of ``children_of(parent)``."""
    if isinstance(parent, Plus):
        return f"plus[{index}]"
    if isinstance(parent, Cross):
        return f"cross[{index}]"
    if isinstance(parent, Seq):
        return f"[{index}]" if parent.as_list is True else f"seq[{index}]"
    if isinstance(parent, Generate):
        return "input"
    if isinstance(parent, Chat):
        return f"chat.messages[{index}]"
    if isinstance(parent, Retrieve):
        return f"retrieve.fragments[{index}]"
    if isinstance(parent, Prepare):
        return "prepare"
    if isinstance(parent, Repeat):
        return "repeat.g"
    raise TypeError(f"{type(parent).__name__} has no children")


def child_path(path: str, parent: Node, index: int = 0) -> str:
    """The path of the ``index``-th child of ``parent``, which sits at ``path``."""
    return join_path(path, child_segment(parent, index))


def walk(node: Node) -> Iterator[tuple[str, Node]]:
    """Yield ``(path, node)`` for every node of a *valid* tree, depth first, left to right.

    Iterative, so deep trees are fine. A subtree shared by several parents is yielded once per
    use. Use it to report later errors (e.g. in a compiler) with the validator's paths.
    """
    stack: list[tuple[str, Node]] = [("", node)]
    while stack:
        path, current = stack.pop()
        yield path, current
        kids = children_of(current)
        for i in range(len(kids) - 1, -1, -1):
            stack.append((child_path(path, current, i), kids[i]))


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


def rewrite_bottom_up(node: Node, rule: Callable[[Node], Node]) -> Node:
    """Apply ``rule`` to every node, children first, rebuilding parents whose children changed.

    ``rule`` receives a node whose children were already rewritten and returns its
    replacement (the node itself when nothing changes). Iterative; each distinct object is
    rewritten once. Returns ``node`` itself when no rule changed anything.
    """

    def combine(current: Node, new_kids: list[Node]) -> Node:
        kids = children_of(current)
        if any(a is not b for a, b in zip(new_kids, kids, strict=True)):
            current = with_children(current, tuple(new_kids))
        return rule(current)

    return fold_bottom_up(node, combine)


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


def iter_nodes(node: Node) -> Iterator[Node]:
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
    "Generate", "JOIN_TYPES", "MESSAGE_TYPES", "Map", "Message", "NODE_TYPES", "Node", "Plus",
    "Prepare", "ROLE_ALIASES", "ROLE_MESSAGES", "Repeat", "Retrieve", "Seq", "System", "User",
    "child_path", "child_segment", "children_of", "content_hash", "fold_bottom_up",
    "iter_nodes", "join_path", "rewrite_bottom_up", "role_name", "role_of", "walk",
    "with_children",
]
