"""A process-wide registry of retrieved fragments, and *lifting* prompts back into span queries.

Framework integrations (LangChain, LlamaIndex) see prompts as flat strings: a retriever returns
documents, a template and ``format_docs`` paste them into a message, and the model receives one
text. To send the documents as commutative spans anyway, retrievers :func:`register` every text
they return, and the span-aware model :func:`lift` s each prompt message: it finds the registered
fragments inside it, whatever the template put around them, and splits the message into ordered
text and *runs* of fragments. A run becomes a ``plus`` of fragments between the ordered text
before and after it (:func:`lift_messages`), so the documents hit the span cache in any order.

Fragments next to each other form one run when only whitespace or punctuation (the separators a
``format_docs`` puts between documents, e.g. ``"\\n\\n"`` or ``"\\n---\\n"``) lies between them;
that glue is dropped. Other text between fragments ends the run and stays in order.

>>> sid = register("Paris is the capital of France.")
>>> pieces = lift("Context:\\nParis is the capital of France.\\n\\nQuestion: capital?")
>>> pieces[0], pieces[1].texts, pieces[2]
('Context:', ('Paris is the capital of France.',), 'Question: capital?')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from span_workflows.query.ir import (
    ROLE_MESSAGES,
    Assistant,
    Cross,
    Fragment,
    Generate,
    Node,
    Plus,
    System,
    User,
)
from span_workflows.query.sampling import Sampling

#: Fragments shorter than this (after stripping) are not registered: they would match anywhere.
MIN_FRAGMENT_CHARS = 8
#: The registry keeps at most this many fragments (least recently registered dropped first).
MAX_FRAGMENTS = 4096
#: Glue between two fragments of one run: at most this long, whitespace and punctuation only.
MAX_GLUE_CHARS = 32

_lock = threading.Lock()
_registry: OrderedDict[str, str] = OrderedDict()  # span_id -> text


def span_id(text: str) -> str:
    """The content hash that identifies a fragment (16 hex digits of its SHA-256)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def register(text: str) -> str:
    """Remember ``text`` as a commutative fragment; return its span id.

    Registering the same text again refreshes it. Texts shorter than
    :data:`MIN_FRAGMENT_CHARS` (stripped) get an id but are not looked for in prompts.
    """
    if not isinstance(text, str):
        raise TypeError(f"a fragment must be a str, got {type(text).__name__}")
    sid = span_id(text)
    if len(text.strip()) < MIN_FRAGMENT_CHARS:
        return sid
    with _lock:
        _registry.pop(sid, None)
        _registry[sid] = text
        while len(_registry) > MAX_FRAGMENTS:
            _registry.popitem(last=False)
    return sid


def register_all(value: object) -> list[str]:
    """Register every item of a commutative collection and return the items' texts.

    ``value``: a :class:`~span_workflows.query.ir.Plus` (e.g. what an ``@commutative`` function
    returns), a str, or an iterable of strs / fragments / objects with a ``page_content`` or
    ``text`` attribute (LangChain documents, LlamaIndex nodes).
    """
    if isinstance(value, Plus):
        items: Iterable[object] = value.children
    elif isinstance(value, (str, Fragment)):
        items = [value]
    elif value is None:
        items = []
    else:
        items = value  # type: ignore[assignment]
    texts = []
    for item in items:
        text = _text_of(item)
        register(text)
        texts.append(text)
    return texts


def _text_of(item: object) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, (Fragment, User, System, Assistant)):
        return item.text
    for attr in ("page_content", "text"):
        value = getattr(item, attr, None)
        if isinstance(value, str):
            return value
    raise TypeError(f"cannot register a {type(item).__name__} as a fragment; expected a str")


def is_registered(text: str) -> bool:
    """Whether ``text`` is a registered fragment."""
    with _lock:
        return _registry.get(span_id(text)) == text


def clear() -> None:
    """Forget every registered fragment."""
    with _lock:
        _registry.clear()


def _snapshot() -> list[tuple[str, str]]:
    with _lock:
        return list(_registry.items())


def find_fragments(text: str, fragments: Sequence[str] | None = None
                   ) -> list[tuple[int, int, str]]:
    """Non-overlapping occurrences of fragments in ``text``: ``(start, end, id)``.

    ``fragments``: the texts to look for (default: the registered fragments). An occurrence
    counts only on word boundaries (no letter or digit right before or after it). Where
    occurrences overlap, the earlier one wins, and at the same start the longer one.
    """
    found: list[tuple[int, int, str]] = []
    candidates = (_snapshot() if fragments is None
                  else [(span_id(f), f) for f in dict.fromkeys(fragments) if f])
    for sid, frag in candidates:
        at = text.find(frag)
        while at >= 0:
            end = at + len(frag)
            if _boundary(text, at, end):
                found.append((at, end, sid))
            at = text.find(frag, at + 1)
    found.sort(key=lambda f: (f[0], -(f[1] - f[0])))
    chosen: list[tuple[int, int, str]] = []
    last_end = 0
    for start, end, sid in found:
        if start >= last_end:
            chosen.append((start, end, sid))
            last_end = end
    return chosen


def _boundary(text: str, start: int, end: int) -> bool:
    before = text[start - 1] if start > 0 else ""
    after = text[end] if end < len(text) else ""
    return not (before.isalnum() and text[start].isalnum()) and not (
        after.isalnum() and text[end - 1].isalnum()
    )


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive fragments of a prompt whose order carries no meaning."""

    texts: tuple[str, ...]
    span_ids: tuple[str, ...]


Piece = str | Run


def lift(text: str, fragments: Sequence[str] | None = None) -> list[Piece]:
    """Split a prompt text into ordered text (``str``) and fragment runs (:class:`Run`).

    ``fragments``: the texts that commute (default: the registered fragments). Text next to a
    run is stripped of surrounding whitespace; pieces that are then empty are left out. A text
    without fragments comes back as ``[text]``.
    """
    occurrences = find_fragments(text, fragments)
    if not occurrences:
        return [text]
    pieces: list[Piece] = []
    run_texts: list[str] = []
    run_ids: list[str] = []
    at = 0

    def close_run() -> None:
        if run_texts:
            pieces.append(Run(tuple(run_texts), tuple(run_ids)))
            run_texts.clear()
            run_ids.clear()

    for start, end, sid in occurrences:
        between = text[at:start]
        if not (run_texts and _is_glue(between)):
            close_run()
            if between.strip():
                pieces.append(between.strip())
        run_texts.append(text[start:end])
        run_ids.append(sid)
        at = end
    close_run()
    tail = text[at:].strip()
    if tail:
        pieces.append(tail)
    return pieces


def _is_glue(text: str) -> bool:
    return len(text) <= MAX_GLUE_CHARS and not any(c.isalnum() for c in text)


def lift_messages(
    messages: Sequence[tuple[str, str]],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    model: str | None = None,
    n: int = 1,
    sampling: Sampling | None = None,
    fragments: Sequence[str] | None = None,
) -> Generate:
    """A generation over chat ``messages`` (``(role, text)``; role system, user, assistant or
    tool), with the fragments inside system and user messages lifted into plus spans
    (``fragments``: the texts that commute; default: the registered fragments).

    A message ``before <docs> after`` becomes ``role(before), +(F, F, ...), role(after)`` in the
    ordered join; assistant messages stay whole (they are outputs, not retrieved text). Tool
    results are user messages (the text the caller rendered); consecutive ones, the results of
    one assistant turn's calls, commute: they become one plus. ``sampling`` is the G's.
    """
    from span_workflows.query.builders import g

    parts: list[Node] = []
    tools: list[Node] = []
    for role, text in messages:
        if role == "tool":
            tools.append(User(text))
            continue
        if tools:
            parts.append(tools[0] if len(tools) == 1 else Plus(tuple(tools)))
            tools = []
        cls = ROLE_MESSAGES.get(role)
        if cls is None:
            raise ValueError(f"unknown role {role!r}; expected system, user, assistant or tool")
        pieces = lift(text, fragments) if role != "assistant" else [text]
        for piece in pieces:
            if isinstance(piece, Run):
                parts.append(Plus(tuple(Fragment(t) for t in piece.texts)))
            else:
                parts.append(cls(piece))
    if tools:
        parts.append(tools[0] if len(tools) == 1 else Plus(tuple(tools)))
    if not parts:
        parts.append(User(""))
    query = g(Cross(tuple(parts)), max_tokens=max_tokens, temperature=temperature, n=n,
              model=model)
    return query if sampling is None else dataclasses.replace(query, sampling=sampling)


def commutative_outputs(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``func`` (sync or async) so that the collection it returns is registered as
    commuting fragments; the wrapper returns the items' texts (a ``list[str]``), which any
    template or ``format_docs`` can paste into a prompt. ``func`` may also be an
    ``@commutative`` function (returning a plus)."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> list[str]:
            return register_all(await func(*args, **kwargs))

        async_wrapper.__span_commutative__ = True  # type: ignore[attr-defined]
        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> list[str]:
        return register_all(func(*args, **kwargs))

    wrapper.__span_commutative__ = True  # type: ignore[attr-defined]
    return wrapper


__all__ = [
    "MAX_FRAGMENTS", "MAX_GLUE_CHARS", "MIN_FRAGMENT_CHARS", "Piece", "Run", "clear",
    "commutative_outputs", "find_fragments", "is_registered", "lift", "lift_messages",
    "register", "register_all", "span_id",
]
