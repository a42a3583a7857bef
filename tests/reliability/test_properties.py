"""Property-based tests (hypothesis) that complement tests/span_workflows/query/test_json_ir.py and
test_optimize.py: the parser never fails with anything but SpanQueryError, the optimizer keeps
the leaves under *every* plus and ignores the order of *every* plus, and the compiler (on the
real SmolLM2 tokenizer) puts markers only at block starts and decodes back to the texts."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from span_workflows.compiler.compile import Compiler
from span_workflows.compiler.optimize import optimize
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    MESSAGE_TYPES,
    Cross,
    Fragment,
    Generate,
    Node,
    Plus,
    Prepare,
    System,
    User,
    children_of,
    iter_nodes,
    rewrite_bottom_up,
)
from span_workflows.query.json_ir import from_json, parse_json
from span_workflows.query.span_options import SpanOptions

BS = 32
_FIXTURE_OK = [HealthCheck.function_scoped_fixture]
#: Shared counter of generated cases, printed at the end of the module (tests/README.md).
CASES: Counter = Counter()


# ---------------------------------------------------------------------------------------------
# Parser: any input fails, if at all, with one typed error

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from(["g", "plus", "cross", "user", "input"]),
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(st.sampled_from(["g", "plus", "cross", "seq", "user", "system", "input",
                                       "max_tokens", "temperature", "n", "repeat", "map",
                                       "fragment", "chat", "messages", "plux"]),
                      kids, max_size=3),
    max_leaves=24,
)


def _parse_outcome(value: object) -> None:
    try:
        from_json(value)  # type: ignore[arg-type]
    except SpanQueryError as err:
        assert str(err)
        assert "\n" not in err.message  # one line


@settings(max_examples=100, deadline=None)
@given(_json_values)
def test_any_json_value_parses_or_raises_a_span_query_error(value: object) -> None:
    CASES["parser"] += 1
    _parse_outcome(value)
    _parse_outcome(json.dumps(value))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_parse_or_raise_a_span_query_error(data: bytes) -> None:
    CASES["parser"] += 1
    _parse_outcome(data)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-tfnrulas \\', max_size=60))
def test_json_like_noise_never_escapes_as_another_error(text: str) -> None:
    CASES["parser"] += 1
    try:
        expected = json.loads(text)
    except (ValueError, RecursionError):
        with pytest.raises(SpanQueryError, match="^malformed JSON|nests deeper"):
            parse_json(text)
    else:
        assert parse_json(text) == expected
    _parse_outcome(text)


# ---------------------------------------------------------------------------------------------
# Optimizer: every plus keeps its leaves; every plus is order-free

_texts = st.text(min_size=1, max_size=5)
_msgs = st.one_of(st.builds(System, _texts), st.builds(User, _texts), st.builds(Fragment, _texts))


def _extend(kids: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
    lists = st.lists(kids, min_size=1, max_size=3).map(tuple)
    return st.one_of(
        st.builds(Plus, lists), st.builds(Cross, lists),
        st.builds(Generate, kids, st.integers(0, 8), st.just(0.0)),
    )


_trees = st.recursive(_msgs, _extend, max_leaves=12)


def _plus_leaf_sets(node: Node) -> Counter:
    """Multiset over every plus of the tree of the multiset of message leaves below it (a plus
    absorbed into its parent plus by flattening is counted as part of its parent)."""
    found: Counter = Counter()
    for current in iter_nodes(node):
        if isinstance(current, Plus):
            found[frozenset(_leaves(current).items())] += 1
    return found


def _leaves(node: Node) -> Counter:
    out: Counter = Counter()
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, MESSAGE_TYPES):
            out[(type(current).__name__, current.text)] += 1
        else:
            stack.extend(children_of(current))
    return out


def _top_level_pluses(node: Node) -> list[Plus]:
    """The pluses not directly inside another plus (flattening merges those). A cross of one
    child counts as that child (the optimizer drops it), so ``+(x(+(a)))`` has one."""
    out: list[Plus] = []
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        current, under_plus = stack.pop()
        if isinstance(current, Plus) and not under_plus:
            out.append(current)
        single_cross = isinstance(current, Cross) and len(current.children) == 1
        inner = isinstance(current, (Plus, Prepare)) or (under_plus and single_cross)
        stack.extend((k, inner and not isinstance(k, Generate)) for k in children_of(current))
    return out


@settings(max_examples=100, deadline=None)
@given(_trees)
@example(Plus((Cross((Plus((System("0"),)),)),)))  # a plus inside a one-child cross in a plus
def test_optimize_twice_is_once_and_every_plus_keeps_its_leaves(tree: Node) -> None:
    CASES["optimizer"] += 1
    once = optimize(tree)
    assert optimize(once) == once
    before = Counter(frozenset(_leaves(p).items()) for p in _top_level_pluses(tree))
    after = Counter(frozenset(_leaves(p).items()) for p in _top_level_pluses(once))
    assert after == before


def _shuffle_every_plus(tree: Node, data: st.DataObject) -> Node:
    def rule(node: Node) -> Node:
        if isinstance(node, Plus) and len(node.children) > 1:
            return Plus(tuple(data.draw(st.permutations(node.children))))
        return node

    return rewrite_bottom_up(tree, rule)


@settings(max_examples=100, deadline=None)
@given(_trees, st.data())
def test_the_order_inside_any_plus_does_not_change_the_optimized_tree(tree: Node, data) -> None:
    CASES["optimizer"] += 1
    assert optimize(_shuffle_every_plus(tree, data)) == optimize(tree)


# ---------------------------------------------------------------------------------------------
# Compiler on the real tokenizer

_hostile = st.sampled_from([
    "<empty_output>", "<jupyter_script>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "\x00", "\x1b[2J", "\x1fSPANCONTENT0\x1f", "\r\n", "\t", "\u202e", "{{ 7*7 }}", "{% raw %}",
    "é", "日本", "🙂", " + ", "x",
])
_content = st.lists(_hostile | st.text(max_size=6), min_size=1, max_size=5).map("".join)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
    return Compiler.for_tokenizer(tokenizer, BS)


def _rag_like(system: str, docs: list[str], question: str) -> Generate:
    return Generate(Cross((System(system), Plus(tuple(Fragment(d) for d in docs)),
                           User(question))), max_tokens=4, temperature=0.0)


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(_content, st.lists(_content, min_size=1, max_size=4), _content)
def test_segments_at_block_starts_and_decoding_gives_back_the_texts(
    compiler: Compiler, system: str, docs: list[str], question: str
) -> None:
    CASES["compiler"] += 1
    tq = compiler.compile_generate(optimize(_rag_like(system, docs, question)),
                                   options=SpanOptions(marker=True))
    marker = compiler.tokens.marker
    at = [i for i, t in enumerate(tq.token_ids) if t == marker]
    starts = [s.offset for s in tq.spans if s.kind in ("plus", "cross")]
    assert at == starts == [s[0] for s in tq.segments]
    assert all(i % BS == 0 for i in at)
    for span in tq.spans:
        if span.kind != "cross":  # everything but the generation tail is whole blocks
            assert span.offset % BS == 0 and span.length % BS == 0
    # Decoding gives back each text, as far as the tokenizer itself can represent it (SmolLM2's
    # vocabulary lacks a few byte tokens, e.g. for U+40000: those come back as other bytes).
    tok = compiler.renderer.tokenizer

    def same(text: str) -> str:
        return tok.decode(compiler.renderer.encode_text(text))

    bodies = [tok.decode(tq.token_ids[s.offset + 1 : s.offset + s.content_tokens])
              for s in tq.spans if s.kind == "plus"]
    assert Counter(bodies) == Counter(
        tok.decode(compiler.renderer.span_chunk([Fragment(d)])) for d in docs
    )
    for doc in docs:
        assert any(same(doc) in body for body in bodies)
    text = tok.decode(tq.token_ids)
    for piece in (system, question, *docs):
        assert same(piece) in text
    # Prepares are whole blocks; only a plus of one span (computed in its own context by the
    # main request) needs none.
    assert all(len(p.token_ids) % BS == 0 for p in tq.prepare)
    assert tq.prepare or tq.main_computes_from == 0


@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURE_OK)
@given(st.lists(_content, min_size=2, max_size=4, unique=True), st.data())
def test_any_document_order_compiles_to_the_same_tokens(compiler: Compiler, docs, data) -> None:
    CASES["compiler"] += 1
    shuffled = data.draw(st.permutations(docs))
    assume(shuffled != docs)
    a = compiler.compile_generate(optimize(_rag_like("s", docs, "q")))
    b = compiler.compile_generate(optimize(_rag_like("s", shuffled, "q")))
    assert a.token_ids == b.token_ids and a.prepare == b.prepare


def test_report_cases() -> None:
    """Prints the number of generated cases (collected for tests/README.md)."""
    print(f"\nproperty cases tried: {dict(CASES)} total {sum(CASES.values())}")
