"""Tell the model about its tools: the system text of every G that may call tools.

A G whose :class:`~span_workflows.query.sampling.Sampling` uses tools gets
:func:`~span_workflows.query.sampling.tool_instructions` as system text, before its optimization:
appended to its first message when that is a system message, else as a new first (system)
message. The text depends only on the tools and the tool choice, so every turn of an agent
renders the same prefix and reads it from the cache.
"""

from __future__ import annotations

import dataclasses

from span_workflows.query.ir import Cross, Generate, Node, System, rewrite_bottom_up
from span_workflows.query.sampling import tool_instructions


def with_tool_prompts(query: Node) -> Node:
    """``query`` with the tool instructions in the input of every G that uses tools
    (``query`` itself when none does)."""

    def rule(node: Node) -> Node:
        if not isinstance(node, Generate) or not node.sampling.uses_tools:
            return node
        text = tool_instructions(node.sampling)
        kids = node.input.children if isinstance(node.input, Cross) else (node.input,)
        if isinstance(kids[0], System):
            kids = (System(f"{kids[0].text}\n\n{text}"), *kids[1:])
        else:
            kids = (System(text), *kids)
        return dataclasses.replace(node, input=Cross(kids))

    return rewrite_bottom_up(query, rule)


__all__ = ["with_tool_prompts"]
