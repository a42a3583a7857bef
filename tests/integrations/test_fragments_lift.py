"""The fragment registry and prompt lifting (span_workflows.query.lift); no engine needed."""

from __future__ import annotations

import asyncio

from span_workflows import Fragment, Plus, System, User, commutative
from span_workflows.query.lift import (
    Run,
    commutative_outputs,
    find_fragments,
    is_registered,
    lift,
    lift_messages,
    register,
    register_all,
    span_id,
)

A = "Alpha document: the quick brown fox jumps."
B = "Beta document: a lazy dog sleeps all day."
C = "Gamma document: rivers flow down to the sea."


def test_register_returns_content_hash() -> None:
    assert register(A) == span_id(A) == span_id(A)
    assert is_registered(A)
    assert span_id(A) != span_id(B)


def test_find_fragments_non_overlapping_on_word_boundaries() -> None:
    register(A)
    register(B)
    text = f"Intro.\n{A}\n\n{B}\nOutro."
    found = find_fragments(text)
    assert [text[s:e] for s, e, _ in found] == [A, B]
    assert [sid for _, _, sid in found] == [span_id(A), span_id(B)]
    register("cat sat on")
    assert find_fragments("concat sat one") == []  # inside words: no match


def test_lift_splits_ordered_text_and_runs() -> None:
    for t in (A, B, C):
        register(t)
    pieces = lift(f"Use the context.\n\n{B}\n\n{A}\n---\n{C}\n\nQuestion: why?")
    assert pieces == [
        "Use the context.",
        Run((B, A, C), (span_id(B), span_id(A), span_id(C))),
        "Question: why?",
    ]
    # text with letters between fragments splits the run and stays ordered
    pieces = lift(f"{A}\nSee also:\n{B}")
    assert pieces == [Run((A,), (span_id(A),)), "See also:", Run((B,), (span_id(B),))]
    assert lift("nothing registered here") == ["nothing registered here"]


def test_lift_messages_builds_plus_between_ordered_text() -> None:
    for t in (A, B):
        register(t)
    q = lift_messages([("system", f"Answer.\n\n{A}\n\n{B}"), ("user", "Why?")], max_tokens=8)
    assert q.input.children == (
        System("Answer."), Plus((Fragment(A), Fragment(B))), User("Why?"),
    )
    q = lift_messages([("user", f"Context:\n{B}\n{A}\nQuestion: why?")])
    assert q.input.children == (
        User("Context:"), Plus((Fragment(B), Fragment(A))), User("Question: why?"),
    )


def test_register_all_and_commutative_outputs() -> None:
    assert register_all(Plus((Fragment(A), Fragment(C)))) == [A, C]

    @commutative
    def search(q: str) -> list[str]:
        return [B, C]

    wrapped = commutative_outputs(search)
    assert wrapped("q") == [B, C]
    assert is_registered(C)

    async def asearch(q: str) -> list[str]:
        return [A]

    assert asyncio.run(commutative_outputs(asearch)("q")) == [A]
