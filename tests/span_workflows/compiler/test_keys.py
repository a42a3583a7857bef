"""Span keys of real queries: order-free across documents, specific to content, salt and
prefix; the same block hash chain the engine uses."""

from __future__ import annotations

import pytest

from span_workflows.compiler.keys import QueryKeyer
from span_workflows.query.builders import rag

DOCS = [f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(4)]
BS = 32


@pytest.fixture(scope="module")
def keyer(tokenizer) -> QueryKeyer:
    return QueryKeyer(tokenizer, BS, with_prompt=True)


def test_the_same_documents_in_another_order_have_the_same_keys(keyer) -> None:
    a = keyer.route(rag("Answer briefly.", DOCS[:3], "What is first?"))
    b = keyer.route(rag("Answer briefly.", [DOCS[2], DOCS[0], DOCS[1]], "Another question?"))
    assert a.keys and set(a.keys) == set(b.keys)
    assert a.span_tokens >= 3 * 2 * BS  # every document fills at least two blocks
    assert a.prompt.index("Document 0") < a.prompt.index("Document 2")
    assert b.prompt.index("Document 2") < b.prompt.index("Document 0")  # the text prefix differs


def test_keys_name_content_context_and_salt(keyer) -> None:
    base = set(keyer.route(rag("Answer briefly.", DOCS[:2], "Q?")).keys)
    shared = set(keyer.route(rag("Answer briefly.", DOCS[1:3], "Q?")).keys)
    assert base & shared and base != shared  # DOCS[1] in common, not the others
    other_system = set(keyer.route(rag("Be terse.", DOCS[:2], "Q?")).keys)
    assert not base & other_system  # anchored spans chain over the prefix
    salted = set(keyer.route(rag("Answer briefly.", DOCS[:2], "Q?"), cache_salt="t1").keys)
    assert salted and not base & salted


def test_a_query_without_spans_has_no_keys(keyer) -> None:
    from span_workflows.query.builders import g, user

    assert keyer.route(g(user("hello"))).keys == ()
    with pytest.raises(ValueError):
        QueryKeyer(keyer.tokenizer, 0)


def _tool_rag():
    """A RAG step of an agent: its G may call a tool, so the planner adds the tool
    instructions to its system message before optimizing it."""
    import dataclasses

    from span_workflows.query.sampling import ToolSpec

    node = rag("Answer briefly.", DOCS[:3], "Which document is first?", max_tokens=8)
    tools = (ToolSpec("lookup", "Look a word up."),)
    return dataclasses.replace(node, sampling=dataclasses.replace(node.sampling, tools=tools))


def test_a_query_is_keyed_by_the_tree_its_planner_runs(tokenizer) -> None:
    """The keys of a query are those of the tree the planner executes (tool instructions
    added, then optimized), compiled by the planner's own compiler: a router keyed otherwise
    sends a tool-using step where its spans are not."""
    from span_workflows.compiler.compile import Compiler
    from span_workflows.runtime.plan import Planner

    planner = Planner(Compiler.for_tokenizer(tokenizer, BS), 4096)
    keyer = planner.keyer()
    assert keyer is planner.keyer() and keyer.compiler is planner.compiler  # one keyer
    query = _tool_rag()
    runs = planner.normalize(query)
    expected = keyer.span_block_keys(planner.compiler.compile_generate(runs, {}))
    got = [k.key for k in keyer.route(query).keys]
    assert got and got == expected
    # the tool instructions are in the anchor: keys of the same documents without tools differ
    plain = {k.key for k in keyer.route(rag("Answer briefly.", DOCS[:3], "Q?")).keys}
    assert not plain & set(got)
