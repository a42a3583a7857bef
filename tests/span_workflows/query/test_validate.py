"""Tests for span_workflows.query.validate."""

from __future__ import annotations

import pytest

from span_workflows.errors import SpanQueryError
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
    System,
    User,
    child_segment,
    join_path,
    walk,
)
from span_workflows.query.validate import MAX_DEPTH, MAX_EXPANDED_NODES, validate


def _error(node: object) -> SpanQueryError:
    with pytest.raises(SpanQueryError) as err:
        validate(node)
    return err.value


def _chain(levels: int) -> object:
    """A tree of exactly ``levels`` levels: nested pluses over one user message."""
    node: object = User("leaf")
    for _ in range(levels - 1):
        node = Plus((node,))
    return node


def test_valid_trees_pass() -> None:
    g = Generate(User("x"), 5, 0.0, 2, "m", True)
    tree = Generate(Cross((
        System("s"), Assistant("a"), Plus((Fragment("f", "src"), g)),
        Seq((User("1"), User("2")), as_list=True),
        Chat((User("c"),), 1, 2.0, None), Retrieve("q", (Fragment("d"),)),
        Prepare(Plus((Fragment("p"),))), Repeat(128, g), Map(("a", "b"), 1_000_000, 0),
    )))
    assert validate(tree) is None


def test_path_of_cross_child() -> None:
    err = _error(Generate(Cross((System("s"), User("u"), Plus(())))))
    assert err.path == "input.cross[2]"
    assert str(err) == "input.cross[2]: plus has no children"


@pytest.mark.parametrize(
    ("node", "path"),
    [
        (Plus((User("a"), User(3))), "plus[1]"),
        (Cross((User(3),)), "cross[0]"),
        (Seq((User("a"), User(3))), "seq[1]"),
        (Seq((User("a"), User(3)), as_list=True), "[1]"),
        (Generate(Seq((User(3),), as_list=True)), "input[0]"),
        (Chat((User("a"), User(3))), "chat.messages[1]"),
        (Repeat(2, Generate(User(3))), "repeat.g.input"),
        (Retrieve("q", (Fragment("a"), Fragment(3))), "retrieve.fragments[1]"),
        (Prepare(Plus((User("a"), User(3)))), "prepare.plus[1]"),
        (
            Generate(Cross((System("s"), Generate(Plus((User(3),)))))),
            "input.cross[1].input.plus[0]",
        ),
    ],
)
def test_path_convention(node: object, path: str) -> None:
    err = _error(node)
    assert err.path == path
    assert err.message == "text must be a str, got int"


def test_map_input_path() -> None:
    err = _error(Generate(Map(("ok", 5))))
    assert str(err) == "input.map.inputs[1]: input must be a str, got int"


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (Plus(()), "plus has no children"),
        (Cross(()), "cross has no children"),
        (Seq(()), "seq has no children"),
        (Chat(()), "chat has no messages"),
        (Map(()), "map has no inputs"),
        (Retrieve("q", ()), "retrieve has no fragments"),
        (Plus([User("a")]), "plus children must be a tuple, got list"),  # type: ignore[arg-type]
    ],
)
def test_empty_or_non_tuple_collections(node: object, message: str) -> None:
    assert _error(node).message == message


@pytest.mark.parametrize("value", [-1, 1_000_001, 1.0, "5", True, None])
def test_max_tokens_range_and_type(value: object) -> None:
    err = _error(Generate(User("x"), max_tokens=value))  # type: ignore[arg-type]
    assert err.path == ""
    assert err.message.startswith("max_tokens must be an integer between 0 and 1000000, got")


@pytest.mark.parametrize("value", [0, 1_000_000])
def test_max_tokens_bounds_are_inclusive(value: int) -> None:
    validate(Generate(User("x"), max_tokens=value))


@pytest.mark.parametrize("value", [-0.1, 2.01, float("nan"), float("inf"), "0.5", True, None])
def test_temperature_range_and_type(value: object) -> None:
    err = _error(Chat((User("x"),), temperature=value))  # type: ignore[arg-type]
    assert err.message.startswith("temperature must be a finite number between 0 and 2, got")


@pytest.mark.parametrize("value", [0, 2, 0.0, 2.0, 1])
def test_temperature_bounds_are_inclusive(value: float) -> None:
    validate(Map(("x",), temperature=value))


@pytest.mark.parametrize("value", [0, 129, -1, 1.0, True])
def test_generate_n_range(value: object) -> None:
    assert _error(Generate(User("x"), n=value)).message.startswith(  # type: ignore[arg-type]
        "n must be an integer between 1 and 128"
    )


@pytest.mark.parametrize("value", [0, 129, 2.0])
def test_repeat_n_range(value: object) -> None:
    err = _error(Cross((User("a"), Repeat(value, Generate(User("x"))))))  # type: ignore[arg-type]
    assert err.path == "cross[1]"
    assert err.message.startswith("n must be an integer between 1 and 128")


def test_generate_needs_input() -> None:
    err = _error(Plus((Generate(None),)))  # type: ignore[arg-type]
    assert (err.path, err.message) == ("plus[0]", "g has no input")


def test_model_must_be_non_empty_str_or_none() -> None:
    assert _error(Generate(User("x"), model="")).message.startswith("model must be")
    assert _error(Generate(User("x"), model=3)).message.startswith("model must be")  # type: ignore
    validate(Generate(User("x"), model="granite"))


def test_flags_must_be_bools() -> None:
    assert _error(Generate(User("x"), inline_prompt=1)).message.startswith(  # type: ignore
        "inline_prompt must be a bool"
    )
    assert _error(Seq((User("x"),), as_list="yes")).message.startswith(  # type: ignore
        "as_list must be a bool"
    )


def test_texts_must_be_str_and_valid_unicode() -> None:
    assert _error(Fragment("x", source=3)).message == "source must be a str, got int"  # type: ignore
    assert _error(Retrieve(3, (Fragment("x"),))).message == "query must be a str, got int"  # type: ignore
    err = _error(Cross((User("ok"), System("bad \ud800"))))
    assert err.path == "cross[1]"
    assert "lone surrogate" in err.message


def test_non_node_values() -> None:
    err = _error(Generate(Cross((User("a"), "plain text"))))  # type: ignore[arg-type]
    assert str(err) == "input.cross[1]: expected a span-query node, got str"
    assert _error({"user": "x"}).message == "expected a span-query node, got dict"


def test_structural_child_kinds() -> None:
    err = _error(Prepare(Cross((User("a"),))))  # type: ignore[arg-type]
    assert str(err) == "prepare: a prepare must wrap a plus, got cross"
    err = _error(Repeat(2, User("a")))  # type: ignore[arg-type]
    assert str(err) == "repeat.g: a repeat must wrap a g, got user"
    err = _error(Retrieve("q", (Fragment("a"), User("b"))))  # type: ignore[arg-type]
    assert str(err) == "retrieve.fragments[1]: a retrieve holds fragments, got user"


def test_first_bad_node_in_document_order_wins() -> None:
    err = _error(Cross((Plus((User(1),)), Plus(()))))  # type: ignore[arg-type]
    assert err.path == "cross[0].plus[0]"


def test_depth_limit_is_exact() -> None:
    validate(_chain(MAX_DEPTH))
    err = _error(_chain(MAX_DEPTH + 1))
    assert err.message == "tree is deeper than 256 levels"
    assert err.path == ""


def test_sugar_counts_the_levels_it_stands_for() -> None:
    node: object = User("leaf")
    for _ in range((MAX_DEPTH - 1) // 2):
        node = Chat((node,))  # type: ignore[arg-type]
    validate(node)  # 2 * 127 + 1 = 255 levels
    assert _error(Chat((Chat((node,)),))).message == "tree is deeper than 256 levels"
    retrieve = Retrieve("q", (Fragment("f"),))  # prepare, plus, fragment: 3 levels
    validate(_wrap(retrieve, MAX_DEPTH - 3))
    assert _error(_wrap(retrieve, MAX_DEPTH - 2)).path == ""
    mapped = Map(("x",))  # plus, g, user: 3 levels
    validate(_wrap(mapped, MAX_DEPTH - 3))
    assert _error(_wrap(mapped, MAX_DEPTH - 2)).message == "tree is deeper than 256 levels"


def _wrap(node: object, times: int) -> object:
    for _ in range(times):
        node = Plus((node,))  # type: ignore[arg-type]
    return node


def test_very_deep_tree_fails_cleanly() -> None:
    err = _error(_chain(20_000))
    assert err.message == "tree is deeper than 256 levels"


def test_shared_subtree_counts_depth_at_each_use() -> None:
    shared = _chain(MAX_DEPTH - 1)
    validate(Plus((shared, shared)))  # 256 levels
    err = _error(Plus((shared, Plus((shared,)))))  # second use is one level deeper
    assert err.message == "tree is deeper than 256 levels"


def test_shared_subtrees_are_checked_once() -> None:
    node: object = User("x")
    for _ in range(200):
        node = Plus((node, node))  # 2**200 paths, 201 distinct objects
    with pytest.raises(SpanQueryError, match="expands to more than"):
        validate(node)


def test_expanded_size_limit_counts_repeats() -> None:
    inner = Generate(Plus((User("x"),) * 100))
    ok = Repeat(128, inner)  # 1 + 128 * 102 nodes
    validate(ok)
    nested = Repeat(128, Generate(Plus((ok,) * 5)))  # the plus is fine, the repeat is not
    err = _error(Cross((User("a"), nested)))
    assert err.message == f"query expands to more than {MAX_EXPANDED_NODES} nodes"
    assert err.path == "cross[1]"


def test_join_path_and_child_segment() -> None:
    assert join_path("", "input") == "input"
    assert join_path("input", "cross[2]") == "input.cross[2]"
    assert join_path("input", "[0]") == "input[0]"
    assert child_segment(Plus((User("a"),)), 3) == "plus[3]"
    assert child_segment(Seq((User("a"),), as_list=True), 1) == "[1]"
    assert child_segment(Generate(User("a")), 0) == "input"
    assert child_segment(Repeat(1, Generate(User("a"))), 0) == "repeat.g"
    with pytest.raises(TypeError):
        child_segment(User("a"), 0)


def test_walk_yields_paths_in_preorder() -> None:
    g = Generate(User("q"))
    tree = Generate(Cross((System("s"), Plus((Fragment("a"), Repeat(2, g))))))
    assert [p for p, _ in walk(tree)] == [
        "", "input", "input.cross[0]", "input.cross[1]", "input.cross[1].plus[0]",
        "input.cross[1].plus[1]", "input.cross[1].plus[1].repeat.g",
        "input.cross[1].plus[1].repeat.g.input",
    ]
    assert dict(walk(tree))["input.cross[1].plus[1].repeat.g"] is g
