"""Print a span-query tree with box-drawing characters, one node per line::

    G max_tokens=64 temperature=0.0
    └── x
        ├── S 'You are a helpful…'
        ├── +
        │   ├── F 'doc one'
        │   └── F 'doc two'
        └── U 'What is…'

Labels: ``S``/``U``/``A``/``F`` messages (with their text, shortened), ``G`` with its
parameters, ``+`` plus, ``x`` cross, ``seq``, ``chat``, ``retrieve``, ``prepare``, ``repeat``
and ``map`` (whose input strings are listed under it).
"""

from __future__ import annotations

from span_workflows.query.ir import (
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
    children_of,
)

_MESSAGE_LABELS = {System: "S", User: "U", Assistant: "A", Fragment: "F"}


def pretty(node: Node, *, width: int = 40) -> str:
    """The tree as text, one node per line (no trailing newline).

    Texts are shown with runs of whitespace collapsed and cut to ``width`` characters (an
    ellipsis marks a cut). Iterative, so deep trees are fine.
    """
    lines: list[str] = []
    # Entries: (node or map-input text, prefix of this line, prefix for its children).
    stack: list[tuple[object, str, str]] = [(node, "", "")]
    while stack:
        item, prefix, child_prefix = stack.pop()
        if isinstance(item, str):
            lines.append(prefix + _quote(item, width))
            continue
        lines.append(prefix + label(item, width=width))  # type: ignore[arg-type]
        kids: tuple[object, ...] = (
            item.inputs if isinstance(item, Map) else children_of(item)  # type: ignore[arg-type]
        )
        last = len(kids) - 1
        for i in range(last, -1, -1):
            branch, extend = ("└── ", "    ") if i == last else ("├── ", "│   ")
            stack.append((kids[i], child_prefix + branch, child_prefix + extend))
    return "\n".join(lines)


def label(node: Node, *, width: int = 40) -> str:
    """The one-line label of ``node`` alone (no children)."""
    if isinstance(node, tuple(_MESSAGE_LABELS)):
        text = f"{_MESSAGE_LABELS[type(node)]} {_quote(node.text, width)}"
        if isinstance(node, Fragment) and node.source:
            text += f" source={_quote(node.source, width)}"
        return text
    if isinstance(node, Plus):
        return "+"
    if isinstance(node, Cross):
        return "x"
    if isinstance(node, Seq):
        return "seq"
    if isinstance(node, Generate):
        parts = ["G", f"max_tokens={node.max_tokens}", f"temperature={node.temperature}"]
        if node.n != 1:
            parts.append(f"n={node.n}")
        if node.model is not None:
            parts.append(f"model={node.model}")
        if node.inline_prompt:
            parts.append("inline_prompt")
        if node.align is not None:
            parts.append(f"align={node.align}")
        return " ".join(parts)
    if isinstance(node, Chat):
        return " ".join(["chat", *_params(node.max_tokens, node.temperature, node.model)])
    if isinstance(node, Map):
        return " ".join(["map", *_params(node.max_tokens, node.temperature, node.model)])
    if isinstance(node, Retrieve):
        return f"retrieve {_quote(node.query, width)}"
    if isinstance(node, Prepare):
        return "prepare"
    if isinstance(node, Repeat):
        return f"repeat n={node.n}"
    return f"? {type(node).__name__}"


def _params(max_tokens: int, temperature: float, model: str | None) -> list[str]:
    parts = [f"max_tokens={max_tokens}", f"temperature={temperature}"]
    if model is not None:
        parts.append(f"model={model}")
    return parts


def _quote(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    if len(text) > width:
        text = text[: max(width - 1, 0)] + "…"
    return repr(text)


__all__ = ["label", "pretty"]
