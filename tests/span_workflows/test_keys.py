"""Span keys of real queries: order-free across documents, specific to content, salt and
prefix; the same block hash chain the engine uses."""

from __future__ import annotations

import pytest

from span_workflows.builders import rag
from span_workflows.keys import QueryKeyer

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
    from span_workflows.builders import g, user

    assert keyer.route(g(user("hello"))).keys == ()
    with pytest.raises(ValueError):
        QueryKeyer(keyer.tokenizer, 0)
