"""Attention-locality rewrite: a k-way judge over commutative candidates becomes a tournament.

A judge ``G(x(prefix..., +(c1, ..., ck), suffix...))`` attends over all ``k`` candidates at
once; small models lose what sits in the middle of a long context. :func:`tournament` rewrites
it into rounds of small judges (the paper's *attention locality*)::

    G(x(S, +(c1..c8), U))            # fan-in 2 →
    round 1: J1 = G(x(S, +(c1, c2), U)) ... J4 = G(x(S, +(c7, c8), U))
    round 2: J12 = G(x(S, J1, J2, U)), J34 = G(x(S, J3, J4, U))
    round 3: G(x(S, J12, J34, U))    # 3 rounds, 7 judges

Every judge is a copy of the original (same prefix, same instruction, same ``max_tokens``,
``temperature`` and model), so each one copies out the answer of its group and the next round
judges the winners' answers. Candidates are grouped in canonical (content-hash) order, so the
same candidates in any order give the same tournament.

Round 1 keeps the plus: its candidates' KV is reused at any position as before (drafts under
it are inline generations, marked by :func:`~span_workflows.compiler.optimize.distribute`). From
round 2
on, the winners sit in the judge's *ordered* part: the compiler renders a G there as its output
text only (an assistant turn), which is the point — a G under a plus would bring its whole
prompt (every candidate of its group) back into the next judge's context, and a G whose prompt
has spans cannot be inlined. A lone leftover candidate (e.g. the 7th of 7 with fan-in 2) gets a
bye into the next round.

The rewrite applies to a G whose input is a cross holding exactly one plus of at least 3 (and
more than ``fanin``) candidates, each a G or a message; anything else is left alone. It is off
by default: ``optimize(q, locality_fanin=2)`` or ``Engine(locality_fanin=2)``.
"""

from __future__ import annotations

import dataclasses

from span_workflows.query.ir import (
    MESSAGE_TYPES,
    Cross,
    Generate,
    Node,
    Plus,
    children_of,
    content_hash,
    rewrite_bottom_up,
)

#: The smallest plus the rewrite touches.
MIN_CANDIDATES = 3


def tournament(node: Node, fanin: int = 2) -> Node:
    """Rewrite every k-way judge in ``node`` into a tournament of ``fanin``-way judges.

    Returns ``node`` itself when no judge qualifies (see the module docstring). Raises
    ``ValueError`` unless ``fanin`` is an int >= 2.
    """
    _check_fanin(fanin)
    return rewrite_bottom_up(node, lambda current: _rewrite_judge(current, fanin))


def judge_parts(g: Node, fanin: int = 2) -> tuple[list[Node], Plus, list[Node]] | None:
    """``(prefix, plus, suffix)`` of a judge the rewrite applies to, else ``None``."""
    if not isinstance(g, Generate) or not isinstance(g.input, Cross):
        return None
    kids = g.input.children
    where = [i for i, c in enumerate(kids) if isinstance(c, Plus)]
    if len(where) != 1:
        return None
    plus = kids[where[0]]
    assert isinstance(plus, Plus)
    if len(plus.children) < max(MIN_CANDIDATES, fanin + 1):
        return None
    if not all(isinstance(c, (Generate, *MESSAGE_TYPES)) for c in plus.children):
        return None
    return list(kids[: where[0]]), plus, list(kids[where[0] + 1:])


def rounds(node: Node) -> int:
    """How many judge rounds sit on the longest chain of judges in ``node`` (a plain G is 1)."""
    depth: dict[int, int] = {}

    def walk(n: Node) -> int:
        if id(n) in depth:
            return depth[id(n)]
        below = max((walk(c) for c in children_of(n)), default=0)
        own = 1 if isinstance(n, Generate) and _has_judge_input(n) else 0
        depth[id(n)] = below + own
        return depth[id(n)]

    return walk(node)


def _has_judge_input(g: Generate) -> bool:
    """A G that judges: its input is a cross holding a plus or another G."""
    return isinstance(g.input, Cross) and any(
        isinstance(c, (Plus, Generate)) for c in g.input.children
    )


def _rewrite_judge(node: Node, fanin: int) -> Node:
    parts = judge_parts(node, fanin)
    if parts is None:
        return node
    assert isinstance(node, Generate)
    prefix, plus, suffix = parts
    hashes = {id(c): content_hash(c) for c in plus.children}
    candidates: list[Node] = sorted(plus.children, key=lambda c: hashes[id(c)])

    def judge(inner: Node | tuple[Node, ...]) -> Generate:
        middle = (inner,) if not isinstance(inner, tuple) else inner
        return dataclasses.replace(
            node, input=Cross((*prefix, *middle, *suffix)), inline_prompt=False
        )

    # round 1: the plus of each group, as the original judge read its candidates
    layer: list[Node] = []
    for group in _groups(candidates, fanin):
        layer.append(group[0] if len(group) == 1 else judge(Plus(tuple(group))))
    # later rounds: the winners' answers in the ordered part of the next judge
    while len(layer) > 1:
        layer = [
            group[0] if len(group) == 1 else judge(tuple(group))
            for group in _groups(layer, fanin)
        ]
    return layer[0]


def _groups(items: list[Node], fanin: int) -> list[list[Node]]:
    return [items[i:i + fanin] for i in range(0, len(items), fanin)]


def _check_fanin(fanin: object) -> None:
    if not isinstance(fanin, int) or isinstance(fanin, bool) or fanin < 2:
        raise ValueError(f"locality fan-in must be an int >= 2, got {fanin!r}")


__all__ = ["MIN_CANDIDATES", "judge_parts", "rounds", "tournament"]
