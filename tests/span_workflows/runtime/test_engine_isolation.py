"""Isolation and tenant safety of the span cache on the real engine (SmolLM2-135M): what a hit
means when spans were computed in context, when hits land in the step that computes them,
across cache salts, and for requests that do not come from the planner."""

from __future__ import annotations

import pytest
from engine_texts import SYSTEM, A, B, C, lora_of

from span_vllm import contract
from span_workflows.compiler.compile import SpanPrompt
from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.plan import Probe, Request, StepCount

pytestmark = pytest.mark.engine

LONG_QUESTION = "Please answer carefully and completely, in one sentence. " * 8 + \
    "What is the capital of Freedonia?"


def _query(docs: list[str], question: str = LONG_QUESTION, max_tokens: int = 12) -> Generate:
    return Generate(Cross((System(SYSTEM), Plus(tuple(Fragment(d) for d in docs)),
                           User(question))), max_tokens=max_tokens, temperature=0.0)


def _raw(engine, token_ids, extra_args=None, salt=None):
    """One request straight to vLLM, bypassing the planner."""
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": list(token_ids)}
    if salt:
        prompt["cache_salt"] = salt
    params = SamplingParams(max_tokens=8, temperature=0.0, extra_args=extra_args)
    [out] = engine._llm.generate([prompt], params, use_tqdm=False)
    return out


def test_tail_after_spans_computed_in_context_is_never_reused(engine) -> None:
    """The main request computes its spans in context (no prepares ran): neither those spans
    nor the two-block ordered tail after them may serve a later hit."""
    engine.reset_cache()
    q = _query([A, B, C])
    tq = engine.compile(q, span_options="self")
    tail = next(s for s in tq.spans if s.kind == "cross")
    assert tail.length >= 2 * engine.block_size
    [unprepared] = engine._run([Request(tq.token_ids, 1, 0.0, segments=tq.segments)])
    assert unprepared.cached_tokens == 0
    before = engine.span_stats()["unregistered_blocks"]
    proper = engine.execute(q, span_options="self")
    assert engine.span_stats()["unregistered_blocks"] >= before
    assert proper.metrics.cached_tokens == tail.offset  # spans from prepares, tail computed
    engine.reset_cache()
    fresh = engine.execute(q, span_options="self")
    assert proper.text == fresh.text and proper.token_ids == fresh.token_ids


def test_a_hit_on_a_span_computed_in_the_same_step_is_copied_inside_the_pass(engine) -> None:
    """Prepares and the main request submitted together: the main request's span B must move
    from where its prepare computes it, in the step that computes it. On CPU each layer copies
    it, rotated, right after writing its KV, so the answer comes in that very step, and it is
    the answer (tokens, first-token log-probabilities, cached tokens) of the prepares run a
    step before (no link blocks: a linked block is recomputed in place, never adopted)."""
    q = _query([A, B])
    unlinked = SpanOptions(link_blocks=0)
    tq = engine.compile(q, span_options=unlinked)
    weights = engine.weights_of(q).lora  # the weights the planner runs q on

    def requests() -> tuple[list[Request], Request]:
        prepares = [Request.prepare(p) for p in tq.prepare]
        for request in prepares:
            request.weights = weights
        return prepares, Request(tq.token_ids, 12, 0.0, logprobs=5, segments=tq.segments,
                                 weights=weights)

    engine.reset_cache()
    prepares, final = requests()
    engine._run(prepares)
    [apart] = engine._run([final])
    engine.reset_cache()
    before = engine.span_stats()
    prepares, final = requests()
    together = engine._run([*prepares, final])[-1]
    after = engine.span_stats()
    assert after["same_step_copies"] > before["same_step_copies"]
    assert after["deferred_hits"] == before["deferred_hits"]
    [[to_first_token, _]] = engine._steps(StepCount([final.tag]))
    assert to_first_token == 1  # answered in the step that computed the spans
    assert together.token_ids == apart.token_ids
    assert together.cached_tokens == apart.cached_tokens == tq.spans[-1].offset
    for token, logprob in apart.first_logprobs.items():
        assert together.first_logprobs[token] == pytest.approx(logprob, abs=1e-4)
    engine.reset_cache()
    fresh = engine.execute(q, span_options=unlinked)
    assert fresh.token_ids == apart.token_ids[0]
    assert fresh.metrics.engine_steps == 1 and fresh.metrics.prepare_requests > 0


def test_cache_salt_separates_tenants_spans(engine) -> None:
    q = _query([A, B, C])
    engine.reset_cache()
    first = engine.execute(q, cache_salt="tenant-a")
    again = engine.execute(q, cache_salt="tenant-a")
    other = engine.execute(q, cache_salt="tenant-b")
    unsalted = engine.execute(q)
    # each span (they compute the prefix too: no prepare of the prefix alone)
    assert first.metrics.prepare_requests == 3
    assert again.metrics.prepare_requests == 0  # a salted query reads its own spans
    assert other.metrics.prepare_requests == 3  # another salt finds none of them
    assert unsalted.metrics.prepare_requests == 3
    assert first.text == again.text == other.text == unsalted.text
    # Nothing of tenant a is visible to tenant b, not even through a raw request.
    weights = [lora_of(engine, first)] * 4
    probe = engine._probe(Probe(list(first.query.prepare), ["tenant-b"] * 4, weights))
    assert probe == [True] * 4  # b's own prepares
    engine.reset_cache()
    engine.execute(q, cache_salt="tenant-a")
    assert engine._probe(Probe(list(first.query.prepare), ["tenant-b"] * 4,
                               weights)) == [False] * 4
    assert _raw(engine, first.query.token_ids, salt="tenant-b").num_cached_tokens == 0


def test_requests_that_do_not_come_from_the_planner_hash_as_stock(engine) -> None:
    """The same tokens as a span query, sent plainly or with a forged layout, read only what
    stock vLLM would (the prefix and the first span, which were computed exactly as a plain
    prompt computes them) and never an anchored sibling span."""
    q = _query([A, B, C])
    engine.reset_cache()
    fresh = _raw(engine, engine.compile(q).token_ids)
    for extra in (None, "forged"):
        engine.reset_cache()
        tq = engine.execute(q).query
        second = [s for s in tq.spans if s.kind == "plus"][1]
        args = contract.layout_args(tq.segments, "not-the-key") if extra else None
        out = _raw(engine, tq.token_ids, args)
        assert out.num_cached_tokens <= second.offset
        assert out.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_prefix_anchored_prepares_are_reused_across_questions_with_the_same_prefix(
        engine) -> None:
    engine.reset_cache()
    engine.execute(_query([A, B, C]))
    other = engine.execute(_query([C, B], "Where is the kite festival held?"))
    assert other.metrics.prepare_requests == 0
    prompts = [SpanPrompt(p.token_ids, p.segments) for p in other.query.prepare]
    probe = engine._probe(Probe(prompts, weights=[lora_of(engine, other)] * len(prompts)))
    assert all(probe)
