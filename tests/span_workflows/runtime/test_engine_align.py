"""How a judge reads its drafts, on the real engine (SmolLM2-135M, block size 32): every
alignment but ``crop`` puts every draft token in the judge's prompt; ``recompute`` (what
``crop=False`` always did) reads all but each draft's last block from the draft's own KV and
computes that block in the judge's prepare step; ``pad`` and ``bias`` fill the last block by
generation (the plugin's logits processor), so the judge reads every draft token from the cache;
and in every case the judge's answer equals a fresh engine's on the same prompt."""

from __future__ import annotations

import pytest

from span_workflows.query.ir import Cross, Generate, Plus, System, User
from span_workflows.query.sampling import Sampling
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.plan import Fill, Request

pytestmark = pytest.mark.engine

SYSTEM = "You pick the best line."
PROMPTS = ("Write one short sentence about the sea.", "Write one short sentence about a fox.")
JUDGE = "Which line is best? Answer 1 or 2."


def _judge(align: str | None = None, max_tokens: int = 24, **sampling) -> Generate:
    """Two greedy drafts (different prompts) and a judge over them."""
    options = Sampling.from_options(sampling)
    drafts = tuple(Generate(User(p), max_tokens, 0.0, sampling=options) for p in PROMPTS)
    return Generate(Cross((System(SYSTEM), Plus(drafts), User(JUDGE))), 4, 0.0, align=align)


def _run(engine, align: str, query: Generate | None = None):
    engine.reset_cache()
    return engine.execute(query or _judge(), span_options=SpanOptions(align=align), logprobs=5)


@pytest.fixture(scope="module")
def recomputed(engine):
    """The judge with ``align="recompute"`` (shared: other alignments compare with it)."""
    return _run(engine, "recompute")


def _drafts(result):
    """(span, draft result) per draft, in prompt order."""
    spans = [s for s in result.query.spans if s.kind == "generated"]
    return [(s, result.nested[s.label.removeprefix("G@")]) for s in spans]


def _holds_every_draft_token(engine, result) -> None:
    tokens = result.query.token_ids
    for span, draft in _drafts(result):
        whole = list(draft.query.token_ids) + draft.token_ids
        segment = tokens[span.offset:span.offset + span.length]
        assert segment[:len(whole)] == whole  # the draft's prompt and its whole output
        assert set(segment[len(whole):]) <= {engine.layout_tokens.pad}  # then padding only
        assert span.content_tokens == len(whole)
    assert result.metrics.nested_lost_tokens == 0
    question = next(s for s in result.query.spans if s.kind == "cross")
    assert result.metrics.cached_tokens == question.offset  # all of it read from the cache


def _equals_a_fresh_run(engine, result) -> None:
    """The judge's prompt computed from nothing (each span by its own prepare, no draft KV)
    gives the same answer and first-token log-probabilities."""
    tq = result.query
    weights = engine.router.named(result.metrics.weights).lora  # the judge's weights
    engine.reset_cache()
    prepares = [Request.prepare(p) for p in tq.prepare]
    for request in prepares:
        request.weights = weights
    engine._run(prepares)
    [fresh] = engine._run([Request(tq.token_ids, 4, 0.0, logprobs=5, segments=tq.segments,
                                   weights=weights)])
    assert fresh.texts[0] == result.text
    for token, logprob in fresh.first_logprobs.items():
        assert abs(result.first_logprobs[token] - logprob) < 1e-3, token


def test_crop_off_reads_every_draft_token_from_the_cache_but_the_last_block(
        engine, recomputed) -> None:
    """``recompute`` (``crop=False``): no draft token is lost; each draft's last block is
    computed by a prepare request, in the judge's own step, from the draft's own cached
    blocks — so the judge itself reads every draft token from the cache."""
    result = recomputed
    _holds_every_draft_token(engine, result)
    m = result.metrics
    drafts = _drafts(result)
    assert m.prepare_requests == 1 + len(drafts)  # the system prefix and each draft's tail
    assert m.final_steps == 1  # those prepares and the judge, in one step
    tails = sum((s.content_tokens - 1) % engine.block_size + 1 for s, _ in drafts)
    assert m.nested_computed_tokens == tails  # the real tokens of each last block, no more
    assert all(d.metrics.fill_tokens == 0 for _, d in drafts)
    _equals_a_fresh_run(engine, result)


def test_pad_fills_each_drafts_last_block_by_generation(engine, recomputed) -> None:
    padded = _run(engine, "pad")
    _holds_every_draft_token(engine, padded)
    m = padded.metrics
    assert m.prepare_requests == 1  # the system prefix only: every draft block was cached
    assert m.nested_computed_tokens == 0 and m.nested_cached_share == 1.0
    end = engine.tokenizer.eos_token_id
    for span, draft in _drafts(padded):
        # the text and its end token (or its whole budget), no pads
        assert draft.token_ids[-1] == end or (len(draft.token_ids) == 24
                                               and draft.finish_reason == "length")
        assert 1 <= draft.metrics.fill_tokens <= engine.block_size
        # pads and one stop token: the request was one token past a block boundary
        assert (len(draft.query.token_ids) + len(draft.token_ids)
                + draft.metrics.fill_tokens) % engine.block_size == 1
        assert span.length == span.content_tokens + draft.metrics.fill_tokens - 1
    # the drafts' texts are unchanged, and so is what the judge reads
    assert [d.text for _, d in _drafts(padded)] == [d.text for _, d in _drafts(recomputed)]
    assert padded.query.token_ids == recomputed.query.token_ids
    assert padded.text == recomputed.text
    _equals_a_fresh_run(engine, padded)


def test_crop_loses_each_drafts_partial_last_block_and_a_gs_own_align_wins(engine) -> None:
    cropped = _run(engine, "pad", _judge(align="crop"))  # the judge's own align: crop
    assert all(d.metrics.fill_tokens == 0 for _, d in _drafts(cropped))
    lost = sum(len(d.query.token_ids) + len(d.token_ids) - s.content_tokens
               for s, d in _drafts(cropped))
    assert lost > 0 and cropped.metrics.nested_lost_tokens == lost
    assert cropped.metrics.nested_cached_share < 1.0
    _equals_a_fresh_run(engine, cropped)


def test_the_bias_processor_moves_a_drafts_end_to_a_block_end(engine) -> None:
    """A strong bias on the real engine: lowered everywhere but a block's last position,
    raised there whatever the model wants — the text ends exactly where its block fills, and
    the fill is the stop token alone."""
    bs = engine.block_size
    prompt = list(engine.compiler.inner_prompt(Generate(User(PROMPTS[0]), 8, 0.0)).token_ids)
    fill = Fill(engine.layout_tokens.pad, engine.layout_tokens.marker,
                engine.compiler.end_ids, 80,
                {"boost": 60.0, "min_prob": 0.0, "window": bs - 1})
    [out] = engine._run([Request(prompt, 80 + bs, 0.0, fill=fill)])
    tokens = out.token_ids[0]
    text = fill.text_end(tokens)
    assert tokens[text - 1] in fill.ends and (len(prompt) + text) % bs == 0
    assert tokens[text:] == [fill.stop]
    assert text == (bs - 1 - len(prompt)) % bs + 1  # the first block end after the prompt


def test_bias_reads_every_draft_token_from_the_cache(engine) -> None:
    biased = _run(engine, "bias")
    assert biased.query.options.align == "bias"
    _holds_every_draft_token(engine, biased)
    assert biased.metrics.nested_computed_tokens == 0
    assert all(d.metrics.fill_tokens >= 1 for _, d in _drafts(biased))


def test_a_draft_with_a_stop_sequence_is_not_filled_but_recomputed(engine) -> None:
    result = _run(engine, "pad", _judge(stop=["\n\n"]))
    _holds_every_draft_token(engine, result)
    assert all(d.metrics.fill_tokens == 0 for _, d in _drafts(result))
    assert result.metrics.nested_computed_tokens > 0
