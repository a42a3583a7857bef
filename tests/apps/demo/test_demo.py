"""The stdlib RAG demo on the real engine (one question, a small csv index, to stay fast)."""

from __future__ import annotations

import pytest

from span_workflows.apps.demo.corpus import block_documents, module_documents
from span_workflows.apps.demo.run import DEFAULT_QUESTIONS, PASSAGE_BLOCKS, run_demo
from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME
from span_workflows.runtime.retrieval import VectorIndex

pytestmark = pytest.mark.engine


def test_run_demo_one_question(engine):
    chunker = engine.chunker(PASSAGE_BLOCKS)
    passages = block_documents(module_documents("csv"), chunker, group="csv")
    index = VectorIndex([*passages], progress=False)
    lines: list[str] = []
    question = DEFAULT_QUESTIONS[1]
    rows = run_demo(engine, questions=[question], k=3, console=lines.append, index=index,
                    max_tokens=16)

    assert [(r["question"], r["order"]) for r in rows] == [
        (question, "retrieved"), (question, "reversed"),
    ]
    first, again = rows
    for row in rows:
        assert row["answer"].strip()
        assert len(row["sources"]) == 3 and all(row["sources"])
        assert row["span_prompt_tokens"] > 0 and row["stock_prompt_tokens"] > 0
        assert row["span_ttft_s"] > 0 and row["stock_ttft_s"] > 0
    assert again["sources"] == list(reversed(first["sources"]))
    assert any("reader" in source for source in first["sources"])
    # The first retrieval: every passage a miss, yet no more tokens computed than stock
    # (passages end near a block boundary; the system prompt was seen by the warm-up).
    assert first["span"]["prepare_requests"] > 0
    assert 0 < first["span_computed_tokens"] <= first["stock_computed_tokens"]
    # Position-independent reuse: the reordered span run finds the documents in the cache.
    assert again["span_cached_tokens"] > 0
    assert again["span_cached_tokens"] >= again["stock_cached_tokens"]
    assert again["span"]["prepare_requests"] == 0
    # span queries on the span-ready adapter, stock on the base, and the table says so
    assert {(r["weights"], r["stock_weights"]) for r in rows} == {
        (SPAN_MODEL_NAME, BASE_MODEL_NAME)}
    report = "\n".join(lines)
    assert "Cached tokens: span" in report and "RAG over the Python stdlib docs" in report
    assert "adapter / base" in report
    # whether each span answer is stock's, word for word, in a column and the closing line
    for row in rows:
        assert row["same_as_stock"] == (row["answer"] == row["stock_answer"])
    same = sum(r["same_as_stock"] for r in rows)
    assert "Same as" in report and f"Span answers equal to stock's: {same} of 2." in report
