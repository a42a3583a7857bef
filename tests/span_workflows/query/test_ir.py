"""Tests for span_workflows.query.ir: node construction, immutability, repr, hashing, traversal."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from span_workflows.query.ir import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    JOIN_TYPES,
    MESSAGE_TYPES,
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
    System,
    User,
    children_of,
    content_hash,
    iter_nodes,
)


def _reference_canonical(node: object) -> str:
    """The original recursive definition of the canonical text, to pin the format."""
    if isinstance(node, tuple):
        return "[" + ",".join(_reference_canonical(x) for x in node) + "]"
    if hasattr(node, "__dataclass_fields__"):
        parts = [type(node).__name__]
        for f in dataclasses.fields(node):  # type: ignore[arg-type]
            parts.append(f"{f.name}={_reference_canonical(getattr(node, f.name))}")
        return "(" + ";".join(parts) + ")"
    return json.dumps(node)


def _sample_nodes() -> list[object]:
    g = Generate(User("q"), max_tokens=5, temperature=0.1, n=2, model="m", inline_prompt=True)
    return [
        System("s"), User("u"), Assistant("a"), Fragment("f", "src"),
        Plus((User("a"), User("b"))), Cross((System("s"), User("u"))),
        Seq((User("x"),), as_list=True), g,
        Chat((System("s"), User("u")), 7, 0.2, "m"),
        Retrieve("query", (Fragment("d1"), Fragment("d2"))),
        Prepare(Plus((Fragment("d"),))), Repeat(3, g), Map(("i1", "i2"), 4, 0.3, "m"),
    ]


def test_message_construction_and_defaults() -> None:
    assert System("s").text == "s"
    assert User("u").text == "u"
    assert Assistant("a").text == "a"
    frag = Fragment("doc")
    assert (frag.text, frag.source) == ("doc", "")
    assert Fragment("doc", "a.txt").source == "a.txt"
    assert set(MESSAGE_TYPES) == {System, User, Assistant, Fragment}
    assert set(JOIN_TYPES) == {Plus, Cross, Seq}


def test_generate_defaults_follow_spnl() -> None:
    node = Generate(User("x"))
    assert node.max_tokens == DEFAULT_MAX_TOKENS == 0
    assert node.temperature == DEFAULT_TEMPERATURE == 0.6
    assert node.n == 1
    assert node.model is None
    assert node.inline_prompt is False


def test_sugar_defaults() -> None:
    chat = Chat((User("x"),))
    assert (chat.max_tokens, chat.temperature, chat.model) == (0, 0.6, None)
    mapped = Map(("a",))
    assert (mapped.max_tokens, mapped.temperature, mapped.model) == (0, 0.6, None)
    assert Seq((User("x"),)).as_list is False
    assert Repeat(2, Generate(User("x"))).g.input == User("x")
    assert Prepare(Plus((User("x"),))).child == Plus((User("x"),))


@pytest.mark.parametrize("node", _sample_nodes(), ids=lambda n: type(n).__name__)
def test_nodes_are_frozen_and_slotted(node: object) -> None:
    first = dataclasses.fields(node)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(node, first, None)
    with pytest.raises((AttributeError, TypeError)):
        node.extra = 1  # type: ignore[attr-defined]
    assert not hasattr(node, "__dict__")


@pytest.mark.parametrize("node", _sample_nodes(), ids=lambda n: type(n).__name__)
def test_nodes_are_hashable_and_compare_by_value(node: object) -> None:
    copy = dataclasses.replace(node)  # type: ignore[type-var]
    assert copy == node
    assert copy is not node
    assert hash(copy) == hash(node)
    assert len({node, copy}) == 1


def test_repr_of_messages_and_joins() -> None:
    assert repr(System("be brief")) == "S('be brief')"
    assert repr(User("hi")) == "U('hi')"
    assert repr(Assistant("ok")) == "A('ok')"
    assert repr(Fragment("doc", "src")) == "F('doc')"
    assert repr(Plus((User("a"), User("b")))) == "+(U('a'), U('b'))"
    assert repr(Cross((System("s"), User("u")))) == "x(S('s'), U('u'))"
    assert repr(Seq((User("a"),))) == "seq(U('a'))"


def test_repr_shortens_and_collapses_whitespace() -> None:
    text = "word " * 20
    shown = repr(User(text))
    assert shown.startswith("U('word word")
    assert shown.endswith("…')")
    assert len(shown) == len("U('')") + 24
    assert repr(User("a\n\n  b")) == "U('a b')"


def test_repr_of_generate_shows_only_non_defaults() -> None:
    assert repr(Generate(User("x"))) == "G(U('x'))"
    assert repr(Generate(User("x"), 5, 0.1, 3)) == "G(U('x'), max_tokens=5, temperature=0.1, n=3)"


def test_repr_of_sugar() -> None:
    g = Generate(User("x"))
    assert repr(Chat((User("a"),))) == "C(U('a'))"
    assert repr(Retrieve("q", (Fragment("a"), Fragment("b")))) == "R('q', 2 fragments)"
    assert repr(Prepare(Plus((User("a"),)))) == "prepare(+(U('a')))"
    assert repr(Repeat(3, g)) == "repeat(3, G(U('x')))"
    assert repr(Map(("a", "b", "c"))) == "map(3 inputs)"


def test_content_hash_is_sha256_of_canonical_text() -> None:
    expected = hashlib.sha256(b'(User;text="hi")').hexdigest()
    assert content_hash(User("hi")) == expected
    plus = Plus((User("a"), Fragment("b")))
    canonical = '(Plus;children=[(User;text="a"),(Fragment;text="b";source="")])'
    assert content_hash(plus) == hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.parametrize("node", _sample_nodes(), ids=lambda n: type(n).__name__)
def test_content_hash_matches_reference_definition(node: object) -> None:
    reference = hashlib.sha256(_reference_canonical(node).encode()).hexdigest()
    assert content_hash(node) == reference  # type: ignore[arg-type]


def test_content_hash_is_stable_and_discriminating() -> None:
    assert content_hash(User("x")) == content_hash(User("x"))
    assert content_hash(User("x")) != content_hash(System("x"))
    assert content_hash(User("x")) != content_hash(User("y"))
    assert content_hash(Fragment("x")) != content_hash(Fragment("x", "src"))
    a, b = User("a"), User("b")
    assert content_hash(Cross((a, b))) != content_hash(Cross((b, a)))
    assert content_hash(Plus((a, b))) != content_hash(Cross((a, b)))
    g = Generate(User("x"))
    assert content_hash(g) != content_hash(dataclasses.replace(g, inline_prompt=True))
    assert content_hash(g) != content_hash(dataclasses.replace(g, max_tokens=1))


def test_content_hash_of_very_deep_tree_does_not_recurse() -> None:
    node: object = User("leaf")
    for i in range(5000):
        node = Plus((node,)) if i % 2 else Generate(Cross((System("s"), node)))  # type: ignore
    assert len(content_hash(node)) == 64  # type: ignore[arg-type]


def test_children_of_every_node_type() -> None:
    g = Generate(User("x"))
    frags = (Fragment("a"), Fragment("b"))
    assert children_of(User("x")) == ()
    assert children_of(Fragment("x")) == ()
    assert children_of(Plus((User("a"), User("b")))) == (User("a"), User("b"))
    assert children_of(Cross((User("a"),))) == (User("a"),)
    assert children_of(Seq((User("a"),))) == (User("a"),)
    assert children_of(g) == (User("x"),)
    assert children_of(Chat((User("a"),))) == (User("a"),)
    assert children_of(Retrieve("q", frags)) == frags
    assert children_of(Prepare(Plus(frags))) == (Plus(frags),)
    assert children_of(Repeat(2, g)) == (g,)
    assert children_of(Map(("a",))) == ()


def test_iter_nodes_is_depth_first_preorder() -> None:
    a, b, c = User("a"), Fragment("b"), Fragment("c")
    plus = Plus((b, c))
    tree = Generate(Cross((a, plus)))
    cross = tree.input
    assert list(iter_nodes(tree)) == [tree, cross, a, plus, b, c]


def test_iter_nodes_handles_deep_trees() -> None:
    node: object = User("leaf")
    for _ in range(10_000):
        node = Plus((node,))
    count = sum(1 for _ in iter_nodes(node))  # type: ignore[arg-type]
    assert count == 10_001
