"""Tests for span_workflows.query.pretty."""

from __future__ import annotations

from span_workflows.query.builders import rag
from span_workflows.query.ir import (
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Plus,
    Prepare,
    Repeat,
    Retrieve,
    Seq,
    User,
)
from span_workflows.query.pretty import label, pretty


def test_rag_tree() -> None:
    node = rag("You are a helpful assistant.", ["doc one", "doc two"], "What is the answer?",
               max_tokens=64)
    assert pretty(node, width=18) == "\n".join([
        "G max_tokens=64 temperature=0.0",
        "└── x",
        "    ├── S 'You are a helpful…'",
        "    ├── +",
        "    │   ├── F 'doc one'",
        "    │   └── F 'doc two'",
        "    └── U 'What is the answe…'",
    ])


def test_nested_branches_keep_vertical_bars() -> None:
    node = Cross((Plus((User("a"), Plus((User("b"), User("c"))))), User("d")))
    assert pretty(node) == "\n".join([
        "x",
        "├── +",
        "│   ├── U 'a'",
        "│   └── +",
        "│       ├── U 'b'",
        "│       └── U 'c'",
        "└── U 'd'",
    ])


def test_sugar_nodes() -> None:
    g = Generate(User("draft"), 8, 0.5, n=2, model="m", inline_prompt=True)
    node = Seq((
        Chat((Assistant("hi"),), 3, 0.0, "m"),
        Retrieve("query", (Fragment("f", "a.txt"),)),
        Prepare(Plus((Fragment("p"),))),
        Repeat(3, g),
        Map(("one", "two"), 5),
    ))
    assert pretty(node) == "\n".join([
        "seq",
        "├── chat max_tokens=3 temperature=0.0 model=m",
        "│   └── A 'hi'",
        "├── retrieve 'query'",
        "│   └── F 'f' source='a.txt'",
        "├── prepare",
        "│   └── +",
        "│       └── F 'p'",
        "├── repeat n=3",
        "│   └── G max_tokens=8 temperature=0.5 n=2 model=m inline_prompt",
        "│       └── U 'draft'",
        "└── map max_tokens=5 temperature=0.6",
        "    ├── 'one'",
        "    └── 'two'",
    ])


def test_text_is_collapsed_and_cut() -> None:
    assert label(User("a\n\n b")) == "U 'a b'"
    assert label(User("x" * 50), width=10) == "U '" + "x" * 9 + "…'"
    assert label(User("x" * 10), width=10) == "U '" + "x" * 10 + "'"


def test_single_leaf() -> None:
    assert pretty(User("hello")) == "U 'hello'"


def test_deep_tree_prints_without_recursion() -> None:
    node: object = User("leaf")
    for _ in range(3000):
        node = Plus((node,))
    lines = pretty(node).split("\n")  # type: ignore[arg-type]
    assert len(lines) == 3001
    assert lines[-1] == " " * 4 * 2999 + "└── U 'leaf'"
