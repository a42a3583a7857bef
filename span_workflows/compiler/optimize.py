"""Tree-to-tree rewrites that put a span query in the normal form the compiler expects.

Each pass is a pure function ``Node -> Node`` (listed in :data:`PASSES`, applied in that order);
:func:`optimize` validates the query, then repeats the passes until nothing changes.

* :func:`desugar` — ``chat`` → G over a cross; ``retrieve`` → prepare(plus(fragments));
  ``map`` → plus of one G per input; ``seq`` → cross; ``repeat(n, g)`` → plus of n copies of g.
* :func:`flatten` — a plus in a plus and a cross in a cross merge into the parent; a cross of
  one child becomes that child; a prepare child of a plus absorbs its parent:
  ``+(a, prepare(+(x, y)), b)`` → ``prepare(+(a, b, x, y))``. A plus of one child stays (it
  still marks a reusable span).
* :func:`distribute` — every G directly under a plus gets ``inline_prompt=True``: the outer
  prompt then reuses the inner G's prompt and output tokens (distributing plus over G).
* :func:`canonical_order` — each plus's children are sorted by
  :func:`~span_workflows.query.ir.content_hash`, so the same spans in any order give an identical
  tree.

:func:`ordered_for_stock` applies every pass but the canonical order (the stock baseline keeps
the order given); :mod:`span_workflows.compiler.locality` holds the optional attention-locality
pass.

:func:`normalize` gives the tree a query runs as: it refuses a top-level join holding a message,
adds the tool instructions to every G that may call tools
(:func:`~span_workflows.query.tool_prompt.with_tool_prompts`), then optimizes (span mode) or
puts every plus in its given order (stock). One function, so that
:class:`~span_workflows.runtime.plan.Planner` and
:class:`~span_workflows.compiler.keys.QueryKeyer` never disagree on which tree a query is.

Normal form guaranteed by :func:`optimize`: only System, User, Assistant, Fragment, Plus,
Cross, Generate and Prepare nodes remain; no plus has a plus or prepare child; no cross has a
cross child or a single child; a prepare wraps a plus; every G that is a child of a plus has
``inline_prompt`` set; plus children are in content-hash order. ``optimize`` is idempotent, and
the multiset of message leaves is preserved (a repeat's leaves counted n times, a map input as a
user message).

All passes are iterative (explicit stacks) and process a subtree shared by several parents
once, so deep trees and the copies a repeat makes are cheap. A pass returns the very same
object when it changes nothing; the fixed point is detected by identity, never by ``==`` (which
recurses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    MESSAGE_TYPES,
    Chat,
    Cross,
    Generate,
    Map,
    Node,
    Plus,
    Prepare,
    Repeat,
    Retrieve,
    Seq,
    User,
    child_path,
    content_hash,
    rewrite_bottom_up,
)
from span_workflows.query.tool_prompt import with_tool_prompts
from span_workflows.query.validate import validate

Pass = Callable[[Node], Node]


# --------------------------------------------------------------------------------------------
# desugar


def _desugar_one(node: Node) -> Node:
    if isinstance(node, Chat):
        return Generate(Cross(node.messages), node.max_tokens, node.temperature,
                        model=node.model)
    if isinstance(node, Retrieve):
        return Prepare(Plus(node.fragments))
    if isinstance(node, Map):
        return Plus(tuple(
            Generate(User(text), node.max_tokens, node.temperature, model=node.model)
            for text in node.inputs
        ))
    if isinstance(node, Seq):
        return Cross(node.children)
    if isinstance(node, Repeat):
        return Plus((node.g,) * node.n)
    return node


def desugar(node: Node) -> Node:
    """Replace chat, retrieve, map, seq and repeat by what they stand for (see module doc).

    The n copies a repeat expands to are the same (immutable) G object.
    """
    return rewrite_bottom_up(node, _desugar_one)


# --------------------------------------------------------------------------------------------
# flatten


def _flatten_one(node: Node) -> Node:
    if isinstance(node, Plus):
        if not any(isinstance(c, (Plus, Prepare)) for c in node.children):
            return node
        kept: list[Node] = []
        prepared: list[Node] = []
        for child in node.children:
            if isinstance(child, Plus):
                kept.extend(child.children)
            elif isinstance(child, Prepare):
                prepared.extend(child.child.children)
            else:
                kept.append(child)
        merged = Plus(tuple(kept + prepared))
        return Prepare(merged) if prepared else merged
    if isinstance(node, Cross):
        if any(isinstance(c, Cross) for c in node.children):
            flat: list[Node] = []
            for child in node.children:
                flat.extend(child.children if isinstance(child, Cross) else (child,))
            node = Cross(tuple(flat))
        return node.children[0] if len(node.children) == 1 else node
    if isinstance(node, Prepare) and isinstance(node.child, Prepare):
        return node.child  # the plus below turned into a prepare: prepare(prepare(p)) = prepare(p)
    return node


def flatten(node: Node) -> Node:
    """Merge nested pluses and nested crosses, drop single-child crosses and let a prepared
    plus absorb the plus it sits in (see module doc)."""
    return rewrite_bottom_up(node, _flatten_one)


# --------------------------------------------------------------------------------------------
# distribute


def distribute(node: Node) -> Node:
    """Set ``inline_prompt=True`` on every G that is a direct child of a plus (including the
    plus of a prepare), so the enclosing prompt reuses that G's prompt and output span.

    A G shared by several pluses (e.g. the copies a repeat expands to) stays shared.
    """
    marked: dict[int, Generate] = {}

    def mark(child: Node) -> Node:
        if not isinstance(child, Generate) or child.inline_prompt:
            return child
        if id(child) not in marked:
            marked[id(child)] = dataclasses.replace(child, inline_prompt=True)
        return marked[id(child)]

    def one(current: Node) -> Node:
        if not isinstance(current, Plus):
            return current
        kids = tuple(mark(c) for c in current.children)
        if all(a is b for a, b in zip(kids, current.children, strict=True)):
            return current
        return Plus(kids)

    return rewrite_bottom_up(node, one)


# --------------------------------------------------------------------------------------------
# canonical_order


def canonical_order(node: Node) -> Node:
    """Sort each plus's children by content hash: a plus's meaning does not depend on the
    order of its children, so any order of the same spans yields an identical tree."""
    hashes: dict[int, str] = {}

    def key(child: Node) -> str:
        digest = hashes.get(id(child))
        if digest is None:
            digest = hashes[id(child)] = content_hash(child)
        return digest

    def one(current: Node) -> Node:
        if not isinstance(current, Plus) or len(current.children) < 2:
            return current
        ordered = tuple(sorted(current.children, key=key))
        if all(a is b for a, b in zip(ordered, current.children, strict=True)):
            return current
        return Plus(ordered)

    return rewrite_bottom_up(node, one)


# --------------------------------------------------------------------------------------------
# optimize

#: The passes :func:`optimize` applies, in order, each round.
PASSES: tuple[Pass, ...] = (desugar, flatten, distribute, canonical_order)


def optimize(node: Node, *, max_rounds: int = 64, locality_fanin: int | None = None) -> Node:
    """Validate ``node``, then apply :data:`PASSES` until a round changes nothing.

    Returns the normal form described in the module docstring (``node`` itself when it is
    already in normal form). Raises :class:`~span_workflows.errors.SpanQueryError` for an
    invalid query, ``ValueError`` for a bad ``max_rounds`` and ``RuntimeError`` if no fixed
    point is reached within ``max_rounds`` rounds (a bug: two rounds always suffice).

    ``locality_fanin`` (an int >= 2; off by default) first applies the attention-locality
    rewrite, :func:`span_workflows.compiler.locality.tournament`, once, after desugaring.
    """
    if not isinstance(max_rounds, int) or isinstance(max_rounds, bool) or max_rounds < 1:
        raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")
    validate(node)
    current = node
    if locality_fanin is not None:
        from span_workflows.compiler.locality import tournament

        current = tournament(flatten(desugar(current)), locality_fanin)
    for _ in range(max_rounds):
        result = current
        for rewrite in PASSES:
            result = rewrite(result)
        if result is current:
            return current
        current = result
    raise RuntimeError(f"optimize reached no fixed point within {max_rounds} rounds")


def ordered_for_stock(query: Node, *, max_rounds: int = 64) -> Node:
    """The stock baseline's normal form: every pass of :func:`optimize` but
    :func:`canonical_order`, so a plain chat prompt keeps its plus children in the order
    given."""
    node = query
    for _ in range(max_rounds):
        new = distribute(flatten(desugar(node)))
        if new is node:
            break
        node = new
    return node


# --------------------------------------------------------------------------------------------
# the tree a query runs as

def normalize(query: Node, *, optimize_query: bool = True, span_mode: bool = True,
              locality_fanin: int | None = None) -> Node:
    """The tree that is executed: optimized (span mode, ``locality_fanin`` as the optimizer
    takes it) or desugared in order (stock), tool instructions in place. A top-level join
    holding a message raises :class:`SpanQueryError` with its path in ``query`` (the
    optimizer reorders a plus)."""
    if isinstance(query, (Plus, Cross)):
        for i, child in enumerate(query.children):
            if isinstance(child, MESSAGE_TYPES):
                raise SpanQueryError(child_path("", query, i), "a top-level join must join G's")
    query = with_tool_prompts(query)
    node = optimize(query, locality_fanin=locality_fanin) if optimize_query else query
    return node if span_mode else ordered_for_stock(query)  # (stock: after the optimizer's checks)



__all__ = [
    "PASSES", "Pass", "canonical_order", "desugar", "distribute", "flatten", "normalize",
    "optimize", "ordered_for_stock",
]
