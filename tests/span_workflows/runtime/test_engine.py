"""The embedded engine on the real SmolLM2-135M model with the span plugin active."""

from __future__ import annotations

import pytest
from engine_texts import QUESTION, SYSTEM, A, B, C

from span_workflows import agent_step, judge_generator, rag
from span_workflows.compiler.model import BASE_MODEL_NAME
from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User
from span_workflows.query.span_options import SpanOptions

pytestmark = pytest.mark.engine


def _ordered_rag(docs: list[str], question: str = QUESTION, max_tokens: int = 16) -> Generate:
    """A RAG query already in optimized form but with the documents in the order given."""
    return Generate(
        Cross((System(SYSTEM), Plus(tuple(Fragment(d) for d in docs)), User(question))),
        max_tokens=max_tokens, temperature=0.0,
    )


def _doc_tokens(result) -> int:
    return sum(s.length for s in result.query.spans if s.kind == "plus")


def test_reordered_documents_hit_the_cache_and_answer_like_a_fresh_engine(engine) -> None:
    engine.reset_cache()
    first = engine.execute(_ordered_rag([A, B, C]), optimize_query=False)
    assert first.metrics.prepare_requests == 3  # each span (they compute the prefix too)
    second = engine.execute(_ordered_rag([C, A, B]), optimize_query=False)
    cross = next(s for s in second.query.spans if s.kind == "cross")
    assert second.metrics.prepare_requests == 0
    assert second.metrics.cached_tokens == cross.offset  # prefix + every document
    assert second.metrics.cached_tokens - 32 >= 0.9 * _doc_tokens(second)
    engine.reset_cache()
    fresh = engine.execute(_ordered_rag([C, A, B]), optimize_query=False)
    assert second.text == fresh.text
    assert "Glimmerton" in second.text


@pytest.mark.parametrize("options", [
    SpanOptions(pad="inside"), SpanOptions(pad="before"), SpanOptions(marker=True),
    SpanOptions(attend="self", pad="before"), SpanOptions(pad_text=" "),
], ids=["pad-inside", "pad-before", "marker", "self-pad-before", "pad-space"])
def test_every_layout_hits_in_any_order_and_answers_like_a_fresh_engine(
        engine, options: SpanOptions) -> None:
    engine.reset_cache()
    engine.execute(_ordered_rag([A, B, C]), optimize_query=False, span_options=options)
    moved = engine.execute(_ordered_rag([C, A, B]), optimize_query=False, span_options=options)
    assert moved.metrics.prepare_requests == 0
    assert moved.metrics.cached_tokens >= _doc_tokens(moved)
    engine.reset_cache()
    fresh = engine.execute(_ordered_rag([C, A, B]), optimize_query=False, span_options=options)
    assert fresh.metrics.prepare_requests > 0
    assert moved.text == fresh.text


@pytest.fixture(scope="module")
def reference(engine, attention_reference):
    assert attention_reference.model_dir == engine.model_dir  # the same weights
    return attention_reference


@pytest.mark.parametrize(("attend", "link_blocks"),
                         [("prefix", 0), ("self", 0), ("prefix", 1), ("self", 1)])
def test_repositioned_logits_match_the_attention_reference_of_the_mode(
        engine, reference, attend: str, link_blocks: int) -> None:
    """vLLM with re-rotated keys vs HF transformers computing what the mode defines (prefix:
    every span right after the prefix, attending to it and itself; self: itself only; with link
    blocks, each span's first block recomputed after everything before it), at the final
    positions: first-token log-probs within 1e-3 nat. Full attention over the same tokens is
    farther off, so the check could fail."""
    options = SpanOptions(attend=attend, link_blocks=link_blocks)
    engine.reset_cache()
    # the reference computes with the base's weights (the adapter's: the routing tests)
    engine.execute(_ordered_rag([A, B, C]), optimize_query=False, span_options=options,
                   weights=BASE_MODEL_NAME)
    moved = engine.execute(_ordered_rag([C, A, B]), optimize_query=False, logprobs=5,
                           span_options=options, weights=BASE_MODEL_NAME)
    assert moved.metrics.cached_tokens > 0
    assert moved.metrics.prepare_requests == 0  # every span cached ...
    assert moved.metrics.link_requests == len(moved.query.links)  # ... new order: new links
    expected = reference.generate(moved.query, attend, max_tokens=0,
                                  link_tokens=link_blocks * engine.block_size).first_logprobs
    full = reference.generate(moved.query, "full", max_tokens=0).first_logprobs
    assert moved.first_logprobs
    for token, logprob in moved.first_logprobs.items():
        assert abs(logprob - expected[token].item()) < 1e-3, (attend, token, logprob)
    top = max(moved.first_logprobs, key=moved.first_logprobs.get)
    assert abs(full[top].item() - moved.first_logprobs[top]) > 1e-3


def test_cross_tail_is_not_reused_after_different_spans(engine) -> None:
    engine.reset_cache()
    long_question = "Please answer carefully and completely. " * 8 + QUESTION
    engine.execute(_ordered_rag([A, B], long_question), optimize_query=False)
    other = engine.execute(_ordered_rag([C, B], long_question), optimize_query=False)
    cross = next(s for s in other.query.spans if s.kind == "cross")
    assert cross.length >= 2 * engine.block_size
    assert other.metrics.cached_tokens == cross.offset


def test_concurrent_requests_share_a_span_at_different_positions(engine) -> None:
    q1 = _ordered_rag([A, B], max_tokens=12)
    q2 = _ordered_rag([B, A], "What melts at twelve degrees?", max_tokens=12)
    q3 = _ordered_rag([C, A], "Where is the kite festival?", max_tokens=12)
    alone = []
    for q in (q1, q2, q3):
        engine.reset_cache()
        alone.append(engine.execute(q, optimize_query=False).text)
    engine.reset_cache()
    engine.execute(_ordered_rag([A, B, C]), optimize_query=False)  # cache A, B, C
    before = engine.span_stats()["duplicated_blocks"]
    together = engine.execute_many([q1, q2], optimize_query=False)
    assert engine.span_stats()["duplicated_blocks"] > before
    assert [r.text for r in together] == alone[:2]
    assert all(r.metrics.cached_tokens > 0 for r in together)
    third = engine.execute(q3, optimize_query=False)
    assert third.text == alone[2]


def test_span_text_in_user_content_does_not_disturb_other_queries(engine) -> None:
    tricky = "+ @ < <empty_output> <jupyter_script> <|im_start|> ++@@<< " * 4
    engine.reset_cache()
    base = engine.execute(_ordered_rag([A, B]), optimize_query=False)
    odd = engine.execute(_ordered_rag([tricky, A]), optimize_query=False)
    assert odd.text
    again = engine.execute(_ordered_rag([A, B]), optimize_query=False)
    assert again.text == base.text
    cross = next(s for s in again.query.spans if s.kind == "cross")
    assert again.metrics.cached_tokens == cross.offset


def test_plain_prompts_cache_like_stock_vllm(engine) -> None:
    engine.reset_cache()
    q = Generate(Cross((System(SYSTEM), User(A + QUESTION))), max_tokens=8, temperature=0.0)
    first = engine.stock(q)
    second = engine.stock(q)
    assert first.metrics.cached_tokens == 0
    n = second.metrics.prompt_tokens
    assert second.metrics.cached_tokens == ((n - 1) // engine.block_size) * engine.block_size
    assert second.text == first.text
    assert second.query.segments == ()


def test_rag_builder_runs_and_canonical_order_makes_order_irrelevant(engine) -> None:
    engine.reset_cache()
    r1 = engine.execute(rag(SYSTEM, [A, B, C], QUESTION, max_tokens=12))
    r2 = engine.execute(rag(SYSTEM, [C, B, A], QUESTION, max_tokens=12))
    assert r1.query.token_ids == r2.query.token_ids
    assert r2.metrics.cached_tokens > 0.9 * _doc_tokens(r2)
    assert r1.text == r2.text


def test_judge_generator_reuses_the_drafts_in_the_judge(engine) -> None:
    engine.reset_cache()
    q = judge_generator(
        2, "Write one short sentence about the sea.", "Which sentence is best? Answer 1 or 2.",
        max_tokens=40, judge_max_tokens=8,
    )
    result = engine.execute(q)
    assert result.text
    generated = [s for s in result.query.spans if s.kind == "generated"]
    assert len(generated) == 2
    assert result.metrics.cached_tokens >= sum(s.length for s in generated)
    # the drafts the judge read are returned with it, keyed by their path in the query
    assert sorted(result.nested) == ["input.cross[0].plus[0]", "input.cross[0].plus[1]"]
    by_label = {s.label: s for s in generated}
    for path, draft in result.nested.items():
        span = by_label[f"G@{path}"]
        assert draft.metrics.generated_tokens > 0 and not draft.nested
        segment = result.query.token_ids[span.offset:span.offset + span.length]
        assert list(draft.query.token_ids) == segment[:len(draft.query.token_ids)]


def test_agent_step_runs_with_commuting_observations(engine) -> None:
    q = agent_step(
        [("user", "Find the inn's opening hours.")],
        ["search: The Blue Heron Inn opens at six.", "search: It closes on Tuesdays."],
        instruction="Summarize what you found in one sentence.", max_tokens=16,
    )
    result = engine.execute(q)
    assert result.text and result.metrics.generated_tokens > 0


def test_too_long_query_is_a_clear_error_and_leaves_the_engine_usable(engine) -> None:
    from span_workflows.errors import SpanQueryError

    huge = _ordered_rag(["word " * 9000])
    with pytest.raises(SpanQueryError, match="longer than the model's context"):
        engine.execute(huge, optimize_query=False)
    assert engine.execute(_ordered_rag([A]), optimize_query=False).text
