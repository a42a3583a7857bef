"""Tests for span_workflows.compiler.optimize: each pass, the normal form, and properties on random
trees.

The hypothesis strategy here generates random *valid* trees of every node type; it also drives
the JSON round-trip property.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from span_workflows.compiler.optimize import (
    PASSES,
    canonical_order,
    desugar,
    distribute,
    flatten,
    optimize,
)
from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import judge_generator, rag
from span_workflows.query.ir import (
    MESSAGE_TYPES,
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
    content_hash,
    iter_nodes,
)
from span_workflows.query.json_ir import from_json, to_json
from span_workflows.query.validate import MAX_DEPTH, validate

A, B, C, D = Fragment("A"), Fragment("B"), Fragment("C"), Fragment("D")


def _inline(g: Generate) -> Generate:
    return dataclasses.replace(g, inline_prompt=True)


# ---------------------------------------------------------------------------------------------
# desugar


def test_desugar_chat() -> None:
    node = Chat((System("s"), User("u")), 7, 0.1, "m")
    assert desugar(node) == Generate(Cross((System("s"), User("u"))), 7, 0.1, model="m")


def test_desugar_retrieve() -> None:
    assert desugar(Retrieve("q", (A, B))) == Prepare(Plus((A, B)))


def test_desugar_map() -> None:
    assert desugar(Map(("x", "y"), 4, 0.2, "m")) == Plus((
        Generate(User("x"), 4, 0.2, model="m"), Generate(User("y"), 4, 0.2, model="m"),
    ))


def test_desugar_seq_and_repeat() -> None:
    g = Generate(User("draft"), 9)
    assert desugar(Seq((User("a"), User("b")), as_list=True)) == Cross((User("a"), User("b")))
    expanded = desugar(Repeat(3, g))
    assert expanded == Plus((g, g, g))


def test_desugar_is_bottom_up_and_keeps_the_rest() -> None:
    node = Generate(Seq((Chat((Seq((User("a"),)),)), Plus((A,)))))
    assert desugar(node) == Generate(Cross((Generate(Cross((Cross((User("a"),)),))), Plus((A,)))))
    plain = Generate(Cross((System("s"), Plus((A, B)))))
    assert desugar(plain) is plain


# ---------------------------------------------------------------------------------------------
# flatten


def test_flatten_merges_nested_plus() -> None:
    assert flatten(Plus((A, Plus((B, Plus((C,)))), D))) == Plus((A, B, C, D))


def test_flatten_merges_nested_cross_and_drops_single_child_cross() -> None:
    assert flatten(Cross((User("a"), Cross((User("b"), User("c")))))) == Cross(
        (User("a"), User("b"), User("c"))
    )
    assert flatten(Generate(Cross((User("only"),)))) == Generate(User("only"))
    assert flatten(Cross((Cross((User("x"),)),))) == User("x")


def test_flatten_keeps_single_child_plus_and_mixed_nesting() -> None:
    node = Plus((A,))
    assert flatten(node) is node
    mixed = Cross((Plus((A, B)), User("q")))
    assert flatten(mixed) is mixed
    assert flatten(Plus((Cross((A, B)),))) == Plus((Cross((A, B)),))


def test_flatten_prepare_absorbs_parent_plus() -> None:
    node = Plus((A, Prepare(Plus((B, C))), D))
    assert flatten(node) == Prepare(Plus((A, D, B, C)))


def test_flatten_merges_several_prepares_and_nested_levels() -> None:
    node = Plus((Prepare(Plus((A,))), Plus((B, Prepare(Plus((C,))))), Prepare(Plus((D,)))))
    # The inner plus becomes prepare(+(B, C)); the outer one absorbs all three prepares.
    assert flatten(node) == Prepare(Plus((A, B, C, D)))


def test_flatten_collapses_prepare_of_prepare() -> None:
    node = Prepare(Plus((A, Prepare(Plus((B,))))))
    assert flatten(node) == Prepare(Plus((A, B)))


# ---------------------------------------------------------------------------------------------
# distribute


def test_distribute_marks_generates_under_plus_only() -> None:
    inner = Generate(User("draft"), 5)
    outer = Generate(Cross((System("s"), Plus((inner, A)), Generate(User("solo")))))
    assert distribute(outer) == Generate(
        Cross((System("s"), Plus((_inline(inner), A)), Generate(User("solo"))))
    )


def test_distribute_inside_prepare_and_is_stable() -> None:
    inner = Generate(User("x"))
    node = Prepare(Plus((inner, B)))
    marked = distribute(node)
    assert marked == Prepare(Plus((_inline(inner), B)))
    assert distribute(marked) is marked


# ---------------------------------------------------------------------------------------------
# canonical_order


def test_canonical_order_sorts_plus_children_by_content_hash() -> None:
    node = Plus((C, A, D, B))
    expected = tuple(sorted((A, B, C, D), key=content_hash))
    assert canonical_order(node).children == expected
    assert canonical_order(Plus(expected)).children == expected


def test_canonical_order_leaves_cross_order_alone() -> None:
    node = Cross((C, A, B))
    assert canonical_order(node) is node


def test_canonical_order_is_order_invariant_in_nested_pluses() -> None:
    one = Cross((System("s"), Plus((A, Plus((B, C)), D))))
    two = Cross((System("s"), Plus((D, Plus((C, B)), A))))
    assert canonical_order(one) == canonical_order(two)


# ---------------------------------------------------------------------------------------------
# optimize


def test_passes_tuple() -> None:
    assert PASSES == (desugar, flatten, distribute, canonical_order)


def test_optimize_rag_order_invariance() -> None:
    first = optimize(rag("sys", ["A", "B", "C"], "q"))
    second = optimize(rag("sys", ["C", "A", "B"], "q"))
    assert first == second
    assert to_json(first) == to_json(second)


def test_optimize_judge_generator() -> None:
    node = judge_generator(3, "write", "judge", system="s", model="m")
    gen = Generate(User("write"), 64, 0.5, model="m", inline_prompt=True)
    assert optimize(node) == Generate(
        Cross((System("s"), Plus((gen, gen, gen)), User("judge"))), 64, 0.0, model="m"
    )


def test_optimize_everything_at_once() -> None:
    node = Chat((
        System("s"),
        Retrieve("q", (B, A)),
        Seq((User("u1"), User("u2"))),
        Plus((Map(("m",), 2), Prepare(Plus((C,))))),
    ))
    expected_plus = Plus(tuple(sorted(
        (A, B), key=content_hash
    )))
    last = Prepare(Plus(tuple(sorted(
        (C, Generate(User("m"), 2, inline_prompt=True)), key=content_hash
    ))))
    assert optimize(node) == Generate(Cross((
        System("s"), Prepare(expected_plus), User("u1"), User("u2"), last,
    )))


def test_optimize_returns_normal_forms_unchanged() -> None:
    node = optimize(rag("s", ["x", "y"], "q"))
    assert optimize(node) is node


def test_optimize_validates_first() -> None:
    with pytest.raises(SpanQueryError, match="plus has no children"):
        optimize(Generate(Plus(())))
    with pytest.raises(ValueError, match="max_rounds"):
        optimize(User("x"), max_rounds=0)


def test_optimize_reports_missing_fixed_point() -> None:
    with pytest.raises(RuntimeError, match="fixed point"):
        optimize(Repeat(2, Generate(User("x"))), max_rounds=1)
    assert optimize(Repeat(2, Generate(User("x"))), max_rounds=2) == Plus(
        (_inline(Generate(User("x"))),) * 2
    )


def test_optimize_deepest_trees() -> None:
    # 256 levels of G over a cross: optimize, JSON and validation must not recurse.
    node: Node = User("leaf")
    for i in range((MAX_DEPTH - 1) // 2):
        node = Generate(Cross((System(f"s{i}"), node)))
    validate(node)
    once = optimize(node)
    assert once is node  # already in normal form
    plus_chain: Node = User("leaf")
    for _ in range(MAX_DEPTH - 1):
        plus_chain = Plus((plus_chain, Fragment("x")))
    flat = optimize(plus_chain)
    assert isinstance(flat, Plus)
    assert len(flat.children) == MAX_DEPTH
    # `==` on deep trees recurses; compare their JSON instead.
    # A chat counts as the two levels (G over a cross) it desugars to.
    chat_chain: Node = User("leaf")
    for _ in range((MAX_DEPTH - 1) // 2):
        chat_chain = Chat((System("s"), chat_chain))
    first = optimize(chat_chain)
    assert to_json(optimize(first)) == to_json(first)
    assert not any(isinstance(n, Chat) for n in iter_nodes(first))


def test_optimize_shares_repeat_copies() -> None:
    node = Repeat(128, Generate(Plus(tuple(Fragment(str(i)) for i in range(50)))))
    out = optimize(node)
    assert isinstance(out, Plus)
    assert len(out.children) == 128
    assert all(child is out.children[0] for child in out.children)


# ---------------------------------------------------------------------------------------------
# Properties on random valid trees

_texts = st.text(max_size=6)
_temps = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
_models = st.sampled_from([None, "m1", "m2"])
_fragments = st.builds(Fragment, _texts, st.sampled_from(["", "src"]))
_leaves = st.one_of(
    st.builds(System, _texts), st.builds(User, _texts), st.builds(Assistant, _texts), _fragments,
    st.builds(Retrieve, _texts, st.lists(_fragments, min_size=1, max_size=3).map(tuple)),
    st.builds(Map, st.lists(_texts, min_size=1, max_size=3).map(tuple),
              st.integers(0, 100), _temps, _models),
)


def _extend(kids: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
    lists = st.lists(kids, min_size=1, max_size=4).map(tuple)
    gens = st.builds(Generate, kids, st.integers(0, 100), _temps, st.integers(1, 3), _models,
                     st.booleans())
    return st.one_of(
        st.builds(Plus, lists), st.builds(Cross, lists), st.builds(Seq, lists, st.booleans()),
        gens, st.builds(Chat, lists, st.integers(0, 100), _temps, _models),
        st.builds(Prepare, st.builds(Plus, lists)), st.builds(Repeat, st.integers(1, 3), gens),
    )


trees = st.recursive(_leaves, _extend, max_leaves=16)


def _leaf_key(node: Node) -> tuple[str, str, str]:
    return (type(node).__name__, node.text, getattr(node, "source", ""))  # type: ignore


def expected_leaves(node: Node) -> Counter:
    """The message leaves a tree stands for: repeats count n times, map inputs are users."""
    counts: Counter = Counter()
    stack: list[tuple[Node, int]] = [(node, 1)]
    while stack:
        current, times = stack.pop()
        if isinstance(current, MESSAGE_TYPES):
            counts[_leaf_key(current)] += times
        elif isinstance(current, Map):
            for text in current.inputs:
                counts[("User", text, "")] += times
        elif isinstance(current, Repeat):
            stack.append((current.g, times * current.n))
        else:
            stack.extend((kid, times) for kid in children_of(current))
    return counts


def assert_normal_form(node: Node) -> None:
    for current in iter_nodes(node):
        assert isinstance(current, (*MESSAGE_TYPES, Plus, Cross, Generate, Prepare))
        if isinstance(current, Plus):
            kids = current.children
            assert not any(isinstance(k, (Plus, Prepare)) for k in kids)
            assert all(k.inline_prompt for k in kids if isinstance(k, Generate))
            hashes = [content_hash(k) for k in kids]
            assert hashes == sorted(hashes)
        if isinstance(current, Cross):
            assert len(current.children) > 1
            assert not any(isinstance(k, Cross) for k in current.children)
        if isinstance(current, Prepare):
            assert isinstance(current.child, Plus)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_optimize_is_idempotent_and_normal(tree: Node) -> None:
    once = optimize(tree)
    assert optimize(once) == once
    assert optimize(once) is once
    assert_normal_form(once)
    validate(once)


@settings(max_examples=300, deadline=None)
@given(trees)
def test_each_pass_is_idempotent_on_optimized_trees(tree: Node) -> None:
    once = optimize(tree)
    for rewrite in PASSES:
        assert rewrite(once) is once


@settings(max_examples=300, deadline=None)
@given(trees)
def test_optimize_preserves_message_leaves(tree: Node) -> None:
    assert expected_leaves(optimize(tree)) == expected_leaves(tree)


@settings(max_examples=200, deadline=None)
@given(st.lists(trees, min_size=1, max_size=5), st.data())
def test_top_plus_keeps_its_leaves_and_ignores_order(children: list[Node], data) -> None:
    top = Plus(tuple(children))
    query = Generate(Cross((System("s"), top, User("q"))))
    out = optimize(query)
    assert isinstance(out, Generate) and isinstance(out.input, Cross)
    joined = out.input.children[1]
    assert isinstance(joined, (Plus, Prepare))
    assert expected_leaves(joined) == expected_leaves(top)
    shuffled = data.draw(st.permutations(children))
    assert optimize(Generate(Cross((System("s"), Plus(tuple(shuffled)), User("q"))))) == out


@settings(max_examples=300, deadline=None)
@given(trees)
def test_json_round_trip(tree: Node) -> None:
    text = to_json(tree)
    assert from_json(text) == tree
    assert to_json(from_json(text)) == text
    assert from_json(to_json(tree, indent=2)) == tree
