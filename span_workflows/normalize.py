"""The tree a query runs as: what the planner executes and what span keys are computed from.

:func:`normalize` refuses a top-level join holding a message, adds the tool instructions to
every G that may call tools (:func:`~span_workflows.tool_prompt.with_tool_prompts`), then
optimizes (span mode) or puts every plus in its given order (stock). One function, so that
:class:`~span_workflows.plan.Planner` and :class:`~span_workflows.keys.QueryKeyer` never
disagree on which tree a query is.
"""

from __future__ import annotations

from span_workflows.errors import SpanQueryError
from span_workflows.ir import MESSAGE_TYPES, Cross, Node, Plus, child_path
from span_workflows.optimize import optimize, ordered_for_stock
from span_workflows.tool_prompt import with_tool_prompts


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


__all__ = ["normalize"]
