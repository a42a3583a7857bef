"""Tests for span_workflows.query.builders."""

from __future__ import annotations

import pytest

from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import (
    agent_step,
    assistant,
    chat,
    cross,
    fragment,
    g,
    judge_generator,
    plus,
    rag,
    repeat,
    retrieve,
    system,
    user,
)
from span_workflows.query.ir import (
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Plus,
    Repeat,
    Retrieve,
    System,
    User,
)


def test_message_builders() -> None:
    assert system("s") == System("s")
    assert user("u") == User("u")
    assert assistant("a") == Assistant("a")
    assert fragment("f") == Fragment("f", "")
    assert fragment("f", source="doc.txt") == Fragment("f", "doc.txt")


@pytest.mark.parametrize("builder", [system, user, assistant, fragment])
def test_message_builders_reject_non_str(builder) -> None:
    with pytest.raises(SpanQueryError, match="^text: must be a str, got int"):
        builder(3)


def test_fragment_rejects_non_str_source() -> None:
    with pytest.raises(SpanQueryError) as err:
        fragment("f", source=None)  # type: ignore[arg-type]
    assert err.value.path == "source"


def test_g_from_str_list_and_node() -> None:
    assert g("hi") == Generate(User("hi"))
    assert g(["a", system("s")]) == Generate(Cross((User("a"), System("s"))))
    assert g(("a",)) == Generate(Cross((User("a"),)))
    node = plus("x", "y")
    assert g(node, max_tokens=5, temperature=0.2, n=3, model="m") == Generate(
        node, 5, 0.2, 3, "m"
    )


def test_g_defaults_and_int_temperature_becomes_float() -> None:
    node = g("x", temperature=1)
    assert node.temperature == 1.0
    assert isinstance(node.temperature, float)
    assert (node.max_tokens, node.n, node.model, node.inline_prompt) == (0, 1, None, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens must be an integer between 0 and 1000000"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"temperature": 3.0}, "temperature must be a finite number between 0 and 2"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"n": 0}, "n must be an integer between 1 and 128"),
        ({"n": 129}, "n must be an integer between 1 and 128"),
        ({"model": ""}, "model must be a non-empty str or None"),
    ],
)
def test_g_validates_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(SpanQueryError, match=message):
        g("x", **kwargs)


def test_g_rejects_bad_input() -> None:
    with pytest.raises(SpanQueryError, match="^input: is empty"):
        g([])
    with pytest.raises(SpanQueryError, match=r"^input: expected a node or a str, got int"):
        g(5)  # type: ignore[arg-type]
    with pytest.raises(SpanQueryError, match=r"^input\[1\]: expected a node or a str"):
        g(["a", 5])  # type: ignore[list-item]


@pytest.mark.parametrize(("builder", "cls"), [(plus, Plus), (cross, Cross)])
def test_plus_and_cross(builder, cls) -> None:
    expected = cls((User("a"), Fragment("b")))
    assert builder("a", fragment("b")) == expected
    assert builder(["a", fragment("b")]) == expected
    assert builder(("a", fragment("b"))) == expected
    assert builder("only") == cls((User("only"),))


@pytest.mark.parametrize("builder", [plus, cross])
def test_plus_and_cross_reject_empty_and_bad_children(builder) -> None:
    with pytest.raises(SpanQueryError, match="^children: is empty"):
        builder()
    with pytest.raises(SpanQueryError, match="^children: is empty"):
        builder([])
    with pytest.raises(SpanQueryError, match=r"^children\[1\]: expected a node or a str"):
        builder("a", 1.5)


def test_chat() -> None:
    node = chat(system("s"), "u", assistant("a"), max_tokens=9, temperature=0, model="m")
    assert node == Chat((System("s"), User("u"), Assistant("a")), 9, 0.0, "m")
    assert isinstance(node.temperature, float)
    assert chat([system("s"), "u"]) == Chat((System("s"), User("u")))
    with pytest.raises(SpanQueryError, match="^messages: is empty"):
        chat()


def test_retrieve() -> None:
    node = retrieve("q", ["a", fragment("b", "src")])
    assert node == Retrieve("q", (Fragment("a"), Fragment("b", "src")))
    with pytest.raises(SpanQueryError, match="^docs: is empty"):
        retrieve("q", [])
    with pytest.raises(SpanQueryError, match=r"^docs\[0\]: expected a str or a fragment"):
        retrieve("q", [user("x")])  # type: ignore[list-item]
    with pytest.raises(SpanQueryError, match="^docs: expected a list, got str"):
        retrieve("q", "abc")
    with pytest.raises(SpanQueryError, match="^query: must be a str"):
        retrieve(None, ["a"])  # type: ignore[arg-type]


def test_repeat() -> None:
    gen = g("draft", max_tokens=10)
    assert repeat(4, gen) == Repeat(4, gen)
    with pytest.raises(SpanQueryError, match="^g: repeat\\(\\) needs a g node, got User"):
        repeat(2, user("x"))  # type: ignore[arg-type]
    with pytest.raises(SpanQueryError, match="n must be an integer between 1 and 128, got 0"):
        repeat(0, gen)
    with pytest.raises(SpanQueryError, match="n must be an integer between 1 and 128"):
        repeat(True, gen)  # type: ignore[arg-type]


def test_rag_shape() -> None:
    node = rag("sys", ["A", fragment("B", "b.txt")], "q?", model="m")
    assert node == Generate(
        Cross((System("sys"), Plus((Fragment("A"), Fragment("B", "b.txt"))), User("q?"))),
        max_tokens=256, temperature=0.0, model="m",
    )
    assert rag(System("s"), ["d"], User("q")).input.children[0] == System("s")
    with pytest.raises(SpanQueryError, match="^docs: is empty"):
        rag("s", [], "q")
    with pytest.raises(SpanQueryError, match="^question: must be a str"):
        rag("s", ["d"], 1)  # type: ignore[arg-type]


def test_judge_generator_shape() -> None:
    node = judge_generator(3, "write", "pick the best", system="judge", model="m")
    generator = Generate(User("write"), 64, 0.5, model="m")
    assert node == Generate(
        Cross((System("judge"), Repeat(3, generator), User("pick the best"))),
        64, 0.0, model="m",
    )
    bare = judge_generator(2, "w", "j", max_tokens=5, judge_max_tokens=7, temperature=1.0,
                           judge_temperature=0.3)
    assert bare == Generate(
        Cross((Repeat(2, Generate(User("w"), 5, 1.0)), User("j"))), 7, 0.3
    )


def test_judge_generator_validates_n() -> None:
    with pytest.raises(SpanQueryError, match="n must be an integer between 1 and 128"):
        judge_generator(0, "w", "j")


def test_agent_step_shape() -> None:
    node = agent_step(
        [("user", "fix the bug"), assistant("looking"), ("assistant", "ran tests")],
        ["log A", fragment("log B"), g("summarize", max_tokens=4)],
        system="agent", instruction="next action?", model="m",
    )
    assert node == Generate(
        Cross((
            System("agent"), User("fix the bug"), Assistant("looking"), Assistant("ran tests"),
            Plus((Fragment("log A"), Fragment("log B"), Generate(User("summarize"), 4))),
            User("next action?"),
        )),
        128, 0.0, model="m",
    )


def test_agent_step_without_observations_or_optional_parts() -> None:
    node = agent_step([("system", "s"), ("user", "u")], [])
    assert node == Generate(Cross((System("s"), User("u"))), 128, 0.0)


def test_agent_step_errors() -> None:
    with pytest.raises(SpanQueryError, match=r"^history\[0\]: unknown role 'tool'"):
        agent_step([("tool", "x")], [])
    with pytest.raises(SpanQueryError, match=r"^history\[1\]: expected a node or a \(role"):
        agent_step([user("a"), 3], [])  # type: ignore[list-item]
    with pytest.raises(SpanQueryError, match=r"^observations\[0\]: expected a node or a str"):
        agent_step([user("a")], [b"bytes"])  # type: ignore[list-item]
    with pytest.raises(SpanQueryError, match="^history: agent_step"):
        agent_step([], [])
    with pytest.raises(SpanQueryError, match="^history: expected a list"):
        agent_step("user: hi", [])  # type: ignore[arg-type]
