"""Pictures of span queries for notebooks: the tree as a graph, the token form as HTML.

* :func:`draw_tree` draws a query tree with matplotlib (no graphviz needed): one box per node,
  coloured by kind (messages, ``G``, ``+`` plus, ``x`` cross, sugar).
* :func:`show_token_form` renders a :class:`~span_workflows.compiler.compile.TokenizedQuery` as an
  HTML string: one coloured block per span (ordered prefix, plus span, generated span, ordered
  tail), its decoded text, and how much of it is padding to the KV block boundary. In a notebook:
  ``IPython.display.HTML(show_token_form(engine.compile(q), engine.tokenizer))``.
"""

from __future__ import annotations

import html
from typing import Any

from span_workflows.query.ir import (
    Assistant,
    Cross,
    Fragment,
    Generate,
    Node,
    Plus,
    Prepare,
    System,
    User,
    children_of,
)
from span_workflows.query.pretty import label

#: Fill colours of :func:`draw_tree`'s boxes, by node type (others: ``_OTHER``).
NODE_COLORS: dict[type, str] = {
    System: "#d9d9d9", User: "#cfe2f3", Assistant: "#d9ead3", Fragment: "#fff2cc",
    Generate: "#f4cccc", Plus: "#b6d7a8", Cross: "#b4a7d6", Prepare: "#a2c4c9",
}
_OTHER = "#eeeeee"

#: Background colours of :func:`show_token_form`'s spans, by span kind.
SPAN_COLORS: dict[str, str] = {
    "prefix": "#e8e8e8", "plus": "#c9f0c0", "generated": "#f9d3d3", "cross": "#dcd3f5",
}


def tree_layout(node: Node) -> tuple[list[tuple[Node, float, int]], list[tuple[int, int]]]:
    """Positions for :func:`draw_tree`: ``(node, x, depth)`` per occurrence (leaves at
    consecutive x, parents centred over their children) and ``(parent, child)`` index pairs.
    Iterative; a subtree shared by several parents is drawn once per occurrence."""
    items: list[tuple[Node, float, int]] = []
    edges: list[tuple[int, int]] = []
    kids_of: dict[int, list[int]] = {}
    order: list[int] = []
    stack: list[tuple[Node, int, int]] = [(node, 0, -1)]
    while stack:
        current, depth, parent = stack.pop()
        index = len(items)
        items.append((current, 0.0, depth))
        kids_of[index] = []
        if parent >= 0:
            edges.append((parent, index))
            kids_of[parent].append(index)
        order.append(index)
        for child in reversed(children_of(current)):
            stack.append((child, depth + 1, index))
    next_leaf = 0.0
    xs: dict[int, float] = {}
    # leaves left to right in pre-order, then parents at the mean of their children
    for index in order:
        if not kids_of[index]:
            xs[index] = next_leaf
            next_leaf += 1.0
    for index in reversed(order):
        if kids_of[index]:
            xs[index] = sum(xs[k] for k in kids_of[index]) / len(kids_of[index])
    placed = [(n, xs[i], d) for i, (n, _, d) in enumerate(items)]
    return placed, edges


def draw_tree(node: Node, ax: Any = None, *, width: int = 18, fontsize: float = 8.0) -> Any:
    """Draw ``node``'s tree with matplotlib and return the axes.

    Labels are :func:`span_workflows.query.pretty.label` with texts cut to ``width`` characters.
    With no ``ax`` a new figure is made, sized to the tree.
    """
    import matplotlib.pyplot as plt

    placed, edges = tree_layout(node)
    leaves = max(x for _, x, _ in placed) + 1
    depth = max(d for _, _, d in placed) + 1
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.0 + 1.6 * leaves, 24), 0.8 + 1.1 * depth))
    for parent, child in edges:
        _, x0, y0 = placed[parent]
        _, x1, y1 = placed[child]
        ax.plot([x0, x1], [-y0, -y1], color="#888888", linewidth=0.8, zorder=1)
    for n, x, d in placed:
        text = _box_label(n, width)
        ax.text(
            x, -d, text, ha="center", va="center", fontsize=fontsize, zorder=2,
            bbox={"boxstyle": "round,pad=0.3", "facecolor": NODE_COLORS.get(type(n), _OTHER),
                  "edgecolor": "#555555", "linewidth": 0.6},
        )
    ax.set_xlim(-0.7, leaves - 0.3)
    ax.set_ylim(-depth + 0.4, 0.6)
    ax.axis("off")
    return ax


def _box_label(node: Node, width: int) -> str:
    """A narrow, multi-line label: a G's parameters on their own lines."""
    if isinstance(node, Generate):
        lines = ["G", f"max_tokens={node.max_tokens}", f"T={node.temperature:g}"]
        if node.n != 1:
            lines.append(f"n={node.n}")
        if node.inline_prompt:
            lines.append("inline")
        return "\n".join(lines)
    return label(node, width=width)


def show_token_form(tq: Any, tokenizer: Any, *, max_chars: int = 400) -> str:
    """The token form ``tq`` as HTML: one coloured block per span with its kind, offset,
    length, label and decoded text (cut to ``max_chars``), padding counted apart.

    Colours: grey ordered prefix, green plus span (reusable at any position), red generated
    span (a nested G's prompt and output), violet ordered tail.
    """
    rows = [
        "<div style='font-family:monospace;font-size:12px;line-height:1.4'>",
        f"<div><b>{len(tq.token_ids)} tokens</b>, KV block size {tq.block_size}, "
        f"{len(tq.prepare)} prepare requests, max_tokens={tq.max_tokens}</div>",
    ]
    for span in tq.spans:
        content = tq.token_ids[span.offset: span.offset + span.content_tokens]
        pad = span.length - span.content_tokens
        text = tokenizer.decode(content, skip_special_tokens=False)
        if len(text) > max_chars:
            text = text[: max_chars - 1] + "…"
        colour = SPAN_COLORS.get(span.kind, "#ffffff")
        blocks = span.length / tq.block_size
        head = (f"{span.kind} @{span.offset} · {span.length} tokens ({blocks:g} blocks)"
                + (f" · {pad} pad" if pad > 0 else "")
                + (f" · {html.escape(span.label)}" if span.label else ""))
        rows.append(
            f"<div class='span span-{span.kind}' style='background:{colour};margin:3px 0;"
            f"padding:4px 6px;border-left:4px solid #666;white-space:pre-wrap'>"
            f"<div style='font-weight:bold;color:#333'>{head}</div>"
            f"{html.escape(text)}</div>"
        )
    rows.append("</div>")
    return "\n".join(rows)


__all__ = ["NODE_COLORS", "SPAN_COLORS", "draw_tree", "show_token_form", "tree_layout"]
