"""Check that a span-query tree is well formed before anything compiles or runs it.

:func:`validate` walks the tree with an explicit stack (no recursion) and raises
:class:`~span_workflows.errors.SpanQueryError` for the first bad node in depth-first, left to
right order. The error's ``path`` names that node with the convention of
:mod:`span_workflows.query.ir` (the JSON parser uses it too; a map input is ``map.inputs[i]``), e.g.
``input.cross[2]`` for the third child of the cross that is the root G's input.

Limits: at most :data:`MAX_DEPTH` levels (nodes on a root-to-leaf path, where a chat or a
retrieve counts as the two levels and a map as the three it stands for), and at most
:data:`MAX_EXPANDED_NODES` nodes once repeats and maps are expanded (a shared subtree counts
once per use), so that no later pass or compiler can be driven into unbounded work.
"""

from __future__ import annotations

import math

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    NODE_TYPES,
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Plus,
    Prepare,
    Repeat,
    Retrieve,
    Seq,
    System,
    User,
    child_path,
    children_of,
    join_path,
)
from span_workflows.query.sampling import Sampling
from span_workflows.query.span_options import check_align

#: The deepest tree accepted, counted in nodes from the root to a leaf (the root is level 1;
#: chat and retrieve count 2, map 3: the depth of what they desugar to).
MAX_DEPTH = 256
#: The largest ``max_tokens`` accepted (0 means "up to the model's limit").
MAX_TOKENS_LIMIT = 1_000_000
#: The largest temperature accepted.
MAX_TEMPERATURE = 2.0
#: The most samples one G (``n``) or one repeat may ask for.
MAX_SAMPLES = 128
#: The most nodes a query may have once every repeat and map is expanded.
MAX_EXPANDED_NODES = 1_000_000

_TEXT_TYPES = (System, User, Assistant)


def validate(node: object) -> None:
    """Raise :class:`SpanQueryError` unless ``node`` is a well-formed span-query tree.

    Checks, per node: it is an IR node; texts, sources, queries and map inputs are ``str``
    (encodable as UTF-8); child collections are non-empty tuples; a G has an ``input``; a
    prepare wraps a plus; a repeat wraps a G; a retrieve holds fragments; ``max_tokens`` is an
    int in ``0..MAX_TOKENS_LIMIT``; ``temperature`` a finite number in ``0..MAX_TEMPERATURE``;
    ``n`` (of a G or a repeat) an int in ``1..MAX_SAMPLES``; ``model`` ``None`` or a non-empty
    str; flags are bools. Whole tree: at most :data:`MAX_DEPTH` levels and at most
    :data:`MAX_EXPANDED_NODES` expanded nodes. Returns ``None`` when all is well.
    """
    # Iterative post-order. Shared subtrees (the same object under several parents) are
    # checked once: ``done`` remembers each finished node's (height, expanded size) by id.
    # ``depth`` is the level a node's top sits on; a node spans ``_levels(node)`` levels.
    done: dict[int, tuple[int, int]] = {}
    # Entries: (node, parent, path, depth, entered). ``entered`` is False on the way down.
    stack: list[tuple[object, object, str, int, bool]] = [(node, None, "", 1, False)]
    while stack:
        current, parent, path, depth, entered = stack.pop()
        key = id(current)
        if not entered:
            _check_child_kind(parent, current, path)
            if key in done:
                height, _ = done[key]
                if depth + height - 1 > MAX_DEPTH:
                    raise SpanQueryError("", f"tree is deeper than {MAX_DEPTH} levels")
                continue
            if depth > MAX_DEPTH:
                raise SpanQueryError("", f"tree is deeper than {MAX_DEPTH} levels")
            _check_node(current, path)
            levels = _levels(current)
            if depth + levels - 1 > MAX_DEPTH:
                raise SpanQueryError("", f"tree is deeper than {MAX_DEPTH} levels")
            kids = children_of(current)  # type: ignore[arg-type]
            stack.append((current, parent, path, depth, True))
            for i in range(len(kids) - 1, -1, -1):
                where = child_path(path, current, i)  # type: ignore[arg-type]
                stack.append((kids[i], current, where, depth + levels, False))
            continue
        kids = children_of(current)  # type: ignore[arg-type]
        height = _levels(current) + max((done[id(k)][0] for k in kids), default=0)
        size = 1 + sum(done[id(k)][1] for k in kids)
        if isinstance(current, Repeat):
            size = 1 + current.n * done[id(current.g)][1]
        elif isinstance(current, Map):
            size = 1 + 2 * len(current.inputs)  # one G over one user message per input
        if size > MAX_EXPANDED_NODES:
            raise SpanQueryError(
                path, f"query expands to more than {MAX_EXPANDED_NODES} nodes"
            )
        done[key] = (height, size)


def _levels(node: object) -> int:
    """How many levels ``node`` itself spans once desugared (its children excluded).

    A chat is a G over a cross, a retrieve a prepare of a plus: two levels each; a map is a
    plus of Gs over user messages: three. Counting them so means
    :func:`~span_workflows.compiler.optimize.optimize`, which only desugars and flattens, never
    returns a tree deeper than the limit its input met.
    """
    if isinstance(node, (Chat, Retrieve)):
        return 2
    if isinstance(node, Map):
        return 3
    return 1


def _check_child_kind(parent: object, child: object, path: str) -> None:
    """Checks on a child that depend on its parent (done before the child is visited)."""
    if isinstance(parent, Prepare) and not isinstance(child, Plus):
        raise SpanQueryError(path, f"a prepare must wrap a plus, got {_kind(child)}")
    if isinstance(parent, Repeat) and not isinstance(child, Generate):
        raise SpanQueryError(path, f"a repeat must wrap a g, got {_kind(child)}")
    if isinstance(parent, Retrieve) and not isinstance(child, Fragment):
        raise SpanQueryError(path, f"a retrieve holds fragments, got {_kind(child)}")


def _check_node(node: object, path: str) -> None:
    """Raise for a bad field of ``node`` itself (not of its children)."""
    if not isinstance(node, NODE_TYPES):
        raise SpanQueryError(path, f"expected a span-query node, got {_kind(node)}")
    if isinstance(node, _TEXT_TYPES):
        _check_text(node.text, "text", path)
    elif isinstance(node, Fragment):
        _check_text(node.text, "text", path)
        _check_text(node.source, "source", path)
    elif isinstance(node, (Plus, Cross, Seq)):
        name = {Plus: "plus", Cross: "cross", Seq: "seq"}[type(node)]
        _check_tuple(node.children, name, "children", path)
        if isinstance(node, Seq) and not isinstance(node.as_list, bool):
            raise SpanQueryError(path, f"as_list must be a bool, got {_kind(node.as_list)}")
    elif isinstance(node, Generate):
        if node.input is None:
            raise SpanQueryError(path, "g has no input")
        _check_generation(node.max_tokens, node.temperature, node.model, path)
        _check_sampling(node, path)
        _check_samples(node.n, "n", path)
        if not isinstance(node.inline_prompt, bool):
            raise SpanQueryError(
                path, f"inline_prompt must be a bool, got {_kind(node.inline_prompt)}"
            )
        if node.align is not None:
            check_align(node.align, join_path(path, "align"))
    elif isinstance(node, Chat):
        _check_tuple(node.messages, "chat", "messages", path)
        _check_generation(node.max_tokens, node.temperature, node.model, path)
    elif isinstance(node, Retrieve):
        _check_text(node.query, "query", path)
        _check_tuple(node.fragments, "retrieve", "fragments", path)
    elif isinstance(node, Repeat):
        _check_samples(node.n, "n", path)
    elif isinstance(node, Map):
        _check_tuple(node.inputs, "map", "inputs", path)
        for i, text in enumerate(node.inputs):
            _check_text(text, "input", join_path(path, f"map.inputs[{i}]"))
        _check_generation(node.max_tokens, node.temperature, node.model, path)


def _check_text(value: object, field: str, path: str) -> None:
    if not isinstance(value, str):
        raise SpanQueryError(path, f"{field} must be a str, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SpanQueryError(
            path, f"{field} is not valid Unicode (lone surrogate at index {err.start})"
        ) from None


def _check_tuple(value: object, node_name: str, field: str, path: str) -> None:
    if not isinstance(value, tuple):
        raise SpanQueryError(path, f"{node_name} {field} must be a tuple, got {_kind(value)}")
    if not value:
        raise SpanQueryError(path, f"{node_name} has no {field}")


def _check_generation(max_tokens: object, temperature: object, model: object, path: str) -> None:
    if not _is_int(max_tokens) or not 0 <= max_tokens <= MAX_TOKENS_LIMIT:  # type: ignore
        raise SpanQueryError(
            path,
            f"max_tokens must be an integer between 0 and {MAX_TOKENS_LIMIT}, "
            f"got {max_tokens!r}",
        )
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise SpanQueryError(
            path,
            f"temperature must be a finite number between 0 and {MAX_TEMPERATURE:g}, "
            f"got {temperature!r}",
        )
    if model is not None and (not isinstance(model, str) or not model):
        raise SpanQueryError(path, f"model must be a non-empty str or None, got {model!r}")


def _check_sampling(node: Generate, path: str) -> None:
    if not isinstance(node.sampling, Sampling):
        raise SpanQueryError(path, f"g sampling must be a Sampling, got {_kind(node.sampling)}")
    problem = node.sampling.problem()
    if problem:
        raise SpanQueryError(path, problem)
    if node.sampling.uses_tools and node.n != 1:
        raise SpanQueryError(path, f"a g with tools samples one answer, got n={node.n}")


def _check_samples(n: object, field: str, path: str) -> None:
    if not _is_int(n) or not 1 <= n <= MAX_SAMPLES:  # type: ignore[operator]
        raise SpanQueryError(
            path, f"{field} must be an integer between 1 and {MAX_SAMPLES}, got {n!r}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """A short description of ``value``'s type for error messages."""
    names = {
        System: "system", User: "user", Assistant: "assistant", Fragment: "fragment",
        Plus: "plus", Cross: "cross", Seq: "seq", Generate: "g", Chat: "chat",
        Retrieve: "retrieve", Prepare: "prepare", Repeat: "repeat", Map: "map",
    }
    return names.get(type(value), type(value).__name__)


__all__ = [
    "MAX_DEPTH", "MAX_EXPANDED_NODES", "MAX_SAMPLES", "MAX_TEMPERATURE", "MAX_TOKENS_LIMIT",
    "validate",
]
