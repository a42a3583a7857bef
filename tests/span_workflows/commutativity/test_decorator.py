"""Tests for the @commutative decorator."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from span_workflows.commutativity.decorator import as_plus, commutative
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Fragment, Generate, Plus, User


def test_result_list_becomes_plus_of_fragments_and_nodes() -> None:
    @commutative
    def search(question: str) -> list:
        return ["doc one", User(question), "doc two"]

    assert search("q?") == Plus((Fragment("doc one"), User("q?"), Fragment("doc two")))


def test_result_forms() -> None:
    existing = Plus((Fragment("a"),))

    @commutative
    def give(value: object) -> object:
        return value

    assert give(existing) is existing
    assert give("single") == Plus((Fragment("single"),))
    assert give(("a", "b")) == Plus((Fragment("a"), Fragment("b")))
    assert give(x for x in ["g"]) == Plus((Fragment("g"),))
    assert give(User("u")) == Plus((User("u"),))


@pytest.mark.parametrize("empty", [[], (), None])
def test_empty_result_names_the_function(empty: object) -> None:
    @commutative
    def find_nothing() -> object:
        return empty

    with pytest.raises(SpanQueryError, match="find_nothing"):
        find_nothing()


def test_bad_result_items() -> None:
    @commutative
    def numbers() -> list:
        return ["ok", 3]

    with pytest.raises(SpanQueryError, match=r"numbers\(\): item 1 is int"):
        numbers()

    @commutative
    def mapping() -> dict:
        return {"a": 1}

    with pytest.raises(SpanQueryError, match="must be a collection"):
        mapping()


def test_result_form_preserves_metadata_and_marks() -> None:
    def drafts(n: int) -> list[str]:
        """Make n drafts."""
        return [f"draft {i}" for i in range(n)]

    wrapped = commutative(drafts)
    assert wrapped.__name__ == "drafts"
    assert wrapped.__doc__ == "Make n drafts."
    assert wrapped.__wrapped__ is drafts
    assert wrapped.__span_commutative__ is True
    assert wrapped.__span_commutative_params__ == ()
    assert commutative()(drafts)(1) == Plus((Fragment("draft 0"),))


def test_async_result_form() -> None:
    @commutative
    async def fetch() -> list[str]:
        await asyncio.sleep(0)
        return ["b", "a"]

    assert inspect.iscoroutinefunction(fetch)
    assert asyncio.run(fetch()) == Plus((Fragment("b"), Fragment("a")))
    assert fetch.__span_commutative__ is True


def test_parameter_form_wraps_named_arguments() -> None:
    seen: dict[str, object] = {}

    @commutative("docs", "notes")
    def answer(question: str, docs, notes=None, *, style: str = "short") -> Generate:
        """Answer a question."""
        seen.update(docs=docs, notes=notes, style=style)
        return Generate(User(question))

    answer("q", ["a", Fragment("b", "src")])
    assert seen == {"docs": Plus((Fragment("a"), Fragment("b", "src"))), "notes": None,
                    "style": "short"}
    answer("q", docs=("x",), notes=["n"], style="long")
    assert seen == {"docs": Plus((Fragment("x"),)), "notes": Plus((Fragment("n"),)),
                    "style": "long"}
    assert answer.__name__ == "answer"
    assert answer.__doc__ == "Answer a question."
    assert answer.__span_commutative__ is True
    assert answer.__span_commutative_params__ == ("docs", "notes")


def test_parameter_form_keeps_existing_plus_and_reports_bad_values() -> None:
    @commutative("docs")
    def take(docs):
        return docs

    plus = Plus((Fragment("a"),))
    assert take(plus) is plus
    with pytest.raises(SpanQueryError, match=r"argument 'docs' of .*take\(\) is empty"):
        take([])
    with pytest.raises(SpanQueryError, match="item 0 is float"):
        take([1.5])


def test_parameter_form_leaves_bad_calls_to_the_function() -> None:
    @commutative("docs")
    def take(docs):
        return docs

    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        take()


def test_async_parameter_form() -> None:
    @commutative("observations")
    async def step(observations) -> object:
        await asyncio.sleep(0)
        return observations

    assert inspect.iscoroutinefunction(step)
    assert asyncio.run(step(["log"])) == Plus((Fragment("log"),))
    assert step.__span_commutative_params__ == ("observations",)


def test_unknown_parameter_is_a_type_error_at_decoration() -> None:
    with pytest.raises(TypeError, match=r"has no parameter 'doc'"):
        @commutative("doc")
        def answer(docs):
            return docs


def test_variadic_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="variadic"):
        @commutative("docs")
        def star(*docs):
            return docs

    with pytest.raises(TypeError, match="variadic"):
        @commutative("kw")
        def kwargs(**kw):
            return kw


def test_bad_decorator_arguments() -> None:
    with pytest.raises(TypeError, match="parameter names"):
        commutative(42)
    with pytest.raises(TypeError, match="parameter names"):
        commutative("not an identifier")


def test_as_plus_directly() -> None:
    assert as_plus(["a"], "docs") == Plus((Fragment("a"),))
    with pytest.raises(SpanQueryError, match="^docs is empty"):
        as_plus([], "docs")
    with pytest.raises(SpanQueryError, match="^docs must be a collection"):
        as_plus(b"bytes", "docs")
