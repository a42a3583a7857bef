"""Where a prompt puts its documents: the layouts framework users write, for training.

A span query built with :func:`span_workflows.query.builders.rag` keeps each document a message of
its own. Framework prompts do not: LangChain's RAG tutorial pastes the retrieved context into the
*system* message, other templates paste it into the *user* message, number the documents or put
a source header above each. The integrations lift such prompts back into spans
(:func:`span_workflows.query.lift.lift_messages`), so the span-ready adapter must answer well
from each of them. :func:`layout_messages` renders one training example in a layout; the
wording of each layout varies from example to example.

``rag`` is the builder's layout and has no messages of its own (the stream compiles the builder
query); the others are chat messages ``(role, text)`` holding the documents verbatim.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: The layouts and their shares of the span-form and stock-form training examples.
LAYOUT_SHARES: dict[str, float] = {
    "rag": 0.4, "system": 0.2, "user": 0.2, "numbered": 0.1, "sources": 0.1,
}
LAYOUTS: tuple[str, ...] = tuple(LAYOUT_SHARES)

_SYSTEM_CONTEXT = (
    "{system}\n\nContext:\n\n{context}",
    "{system} Use the following pieces of retrieved context.\n\n{context}",
    "{system}\n\n{context}",
)
_USER_CONTEXT = (
    "Context:\n{context}\n\nQuestion: {question}",
    "{context}\n\n{question}",
    "Here are some documents.\n\n{context}\n\nAnswer this: {question}",
)
_SEPARATORS = ("\n\n", "\n\n", "\n---\n", "\n\n\n")


def draw_layout(rng: random.Random) -> str:
    """A layout drawn by :data:`LAYOUT_SHARES`."""
    roll, total = rng.random(), 0.0
    for name, share in LAYOUT_SHARES.items():
        total += share
        if roll < total:
            return name
    return LAYOUTS[-1]


def layout_messages(layout: str, system: str, documents: Sequence[str], question: str,
                    titles: Sequence[str], rng: random.Random) -> list[tuple[str, str]]:
    """The chat messages of one example in ``layout`` (not ``rag``): every document appears
    verbatim; ``titles[i]`` names document ``i`` in a source header."""
    if layout == "system":
        context = rng.choice(_SEPARATORS).join(documents)
        return [("system", rng.choice(_SYSTEM_CONTEXT).format(system=system, context=context)),
                ("user", question)]
    if layout == "user":
        context = rng.choice(_SEPARATORS).join(documents)
        return [("system", system),
                ("user", rng.choice(_USER_CONTEXT).format(context=context, question=question))]
    if layout == "numbered":
        style = rng.choice(("[{n}] ", "{n}. ", "Document {n}:\n"))
        context = "\n\n".join(style.format(n=i + 1) + d for i, d in enumerate(documents))
        return [("system", system), ("user", f"{context}\n\nQuestion: {question}")]
    if layout == "sources":
        header = rng.choice(("Source: {t}\n", "[{t}]\n", "From {t}:\n"))
        context = "\n\n".join(header.format(t=t) + d
                              for t, d in zip(titles, documents, strict=True))
        return [("system", system), ("user", f"{context}\n\n{question}")]
    raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS[1:])}")


__all__ = ["LAYOUTS", "LAYOUT_SHARES", "draw_layout", "layout_messages"]
