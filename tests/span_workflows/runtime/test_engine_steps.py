"""Engine steps of span queries on the real engine: a hit of cached documents in a new
combination answers in one step, its link blocks computed in the answer's own forward pass
(the same first-token log-probabilities as with a step of their own), as without links (the
span-ready model's span options); a cold query with links prepares, links and answers in one
step too; a reordered set takes one, a one-document miss one; and every shortcut keeps what a
hit means — the answer and its first-token log-probabilities equal a fresh engine's."""

from __future__ import annotations

import pytest
from engine_texts import QUESTION, SYSTEM, A, B, C

from span_workflows import rag
from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User
from span_workflows.query.span_options import SpanOptions

pytestmark = pytest.mark.engine

#: One link block per span (the default; the span-ready model records none).
LINKED = SpanOptions(link_blocks=1)
D = ("The Copperfield Library lends telescopes to its members on clear nights and asks "
     "them back before the morning bell rings at seven. ") * 2


def _ordered(docs: list[str], question: str = QUESTION) -> Generate:
    return Generate(Cross((System(SYSTEM), Plus(tuple(Fragment(d) for d in docs)),
                           User(question))), max_tokens=12, temperature=0.0)


def _fresh(engine, query: Generate):
    engine.reset_cache()
    return engine.execute(query, optimize_query=False, logprobs=5)


def _same_answer(hit, fresh) -> None:
    assert hit.text == fresh.text
    for token, logprob in fresh.first_logprobs.items():
        assert abs(hit.first_logprobs[token] - logprob) < 1e-3, token


def _linked_hit(engine, combo: Generate, *, links_with_answer: bool):
    """``combo`` answered after its documents were cached in other combinations."""
    engine.reset_cache()
    engine.execute(_ordered([A, B]), optimize_query=False, span_options=LINKED)
    engine.execute(_ordered([C, D]), optimize_query=False, span_options=LINKED)
    engine.planner.links_with_answer = links_with_answer
    try:
        return engine.execute(combo, optimize_query=False, logprobs=5, span_options=LINKED)
    finally:
        engine.planner.links_with_answer = True


def test_a_new_combination_with_links_answers_in_one_step(engine) -> None:
    combo = _ordered([D, A, C])  # every document cached, never together, never in this order
    hit = _linked_hit(engine, combo, links_with_answer=True)
    assert hit.metrics.prepare_requests == 0
    assert hit.metrics.link_requests == 2  # the first span follows its context: no link
    assert hit.metrics.engine_steps == 1  # the link blocks in the answer's own forward pass
    assert hit.metrics.final_steps == 1
    cross = next(s for s in hit.query.spans if s.kind == "cross")
    assert hit.metrics.cached_tokens == cross.offset  # link blocks: shared as they are written
    again = engine.execute(combo, optimize_query=False, span_options=LINKED)
    assert again.metrics.engine_steps == 1 and again.metrics.link_requests == 0
    # exactly what a step of their own computes
    two_steps = _linked_hit(engine, combo, links_with_answer=False)
    assert two_steps.metrics.engine_steps == 2 and two_steps.metrics.link_requests == 2
    assert two_steps.metrics.cached_tokens == cross.offset
    assert hit.metrics.prepared_tokens == two_steps.metrics.prepared_tokens == 2 * 32
    assert hit.text == two_steps.text
    assert hit.first_logprobs.keys() == two_steps.first_logprobs.keys()
    for token, logprob in two_steps.first_logprobs.items():
        assert abs(hit.first_logprobs[token] - logprob) < 1e-4, token
    engine.reset_cache()
    _same_answer(hit, engine.execute(combo, optimize_query=False, logprobs=5,
                                     span_options=LINKED))


def test_without_link_blocks_a_new_combination_is_one_step(engine) -> None:
    """What ``link_blocks=0`` (the span-ready model's option) buys: no link step."""
    no_links = SpanOptions(link_blocks=0)
    engine.reset_cache()
    engine.execute(_ordered([A, B]), optimize_query=False, span_options=no_links)
    engine.execute(_ordered([C, D]), optimize_query=False, span_options=no_links)
    combo = _ordered([D, A, C])
    hit = engine.execute(combo, optimize_query=False, span_options=no_links, logprobs=5)
    assert hit.metrics.prepare_requests == 0 and hit.metrics.link_requests == 0
    assert hit.metrics.engine_steps == 1
    engine.reset_cache()
    fresh = engine.execute(combo, optimize_query=False, span_options=no_links, logprobs=5)
    assert fresh.metrics.engine_steps == 1  # the prepares run in the answer's own step
    assert fresh.metrics.prepare_requests == 3  # one per span, the prefix with them
    _same_answer(hit, fresh)


def test_a_reordered_set_and_stock_take_one_step(engine) -> None:
    engine.reset_cache()
    engine.execute(rag(SYSTEM, [A, B, C], QUESTION, max_tokens=8))
    hit = engine.execute(rag(SYSTEM, [C, A, B], QUESTION, max_tokens=8))
    assert hit.metrics.engine_steps == 1 and hit.metrics.prepare_requests == 0
    assert engine.stock(rag(SYSTEM, [B, C, A], QUESTION, max_tokens=8)).metrics.engine_steps == 1


def test_a_cold_query_prepares_links_and_answers_in_one_step(engine) -> None:
    engine.reset_cache()
    cold = engine.execute(_ordered([A, B, C]), optimize_query=False, logprobs=5,
                          span_options=LINKED)
    # the prefix is computed by the span prepares (no prepare of its own): one per span; the
    # links read them as they are written, and the answer reads both (copies inside the pass)
    assert cold.metrics.prepare_requests == 3 and cold.metrics.link_requests == 2
    assert cold.metrics.engine_steps == 1
    engine.reset_cache()
    engine.planner.links_with_answer = False
    try:
        three = engine.execute(_ordered([A, B, C]), optimize_query=False, logprobs=5,
                               span_options=LINKED)
    finally:
        engine.planner.links_with_answer = True
    assert three.metrics.engine_steps == 3 and three.text == cold.text
    for token, logprob in three.first_logprobs.items():
        assert abs(cold.first_logprobs[token] - logprob) < 1e-4, token
    engine.reset_cache()
    plain = engine.execute(_ordered([A, B, C]), optimize_query=False,
                           span_options=SpanOptions(link_blocks=0))
    # without links the prepares go with the answer: one step (the plugin copies each span
    # to where the answer reads it inside the forward pass that computes it)
    assert plain.metrics.prepare_requests == 3 and plain.metrics.engine_steps == 1


def test_one_document_is_computed_by_the_answer_itself_and_reused_later(engine) -> None:
    """The only span of a plus follows its context exactly as a prepare would compute it:
    the main request computes it, and its blocks are cached from there — a later query with
    that document among others, elsewhere, reads it and answers as a fresh engine does."""
    engine.reset_cache()
    alone = engine.execute(_ordered([B]), optimize_query=False)
    assert alone.metrics.prepare_requests == 0 and alone.metrics.engine_steps == 1
    assert alone.metrics.cached_tokens == 0
    later = _ordered([A, B])
    hit = engine.execute(later, optimize_query=False, logprobs=5)
    assert hit.metrics.prepare_requests == 1  # A only; B and the prefix were cached
    b_span = hit.query.spans[2]
    assert hit.metrics.prepared_tokens < b_span.offset + b_span.length
    _same_answer(hit, _fresh(engine, later))
