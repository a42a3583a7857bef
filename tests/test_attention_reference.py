"""The HF attention reference of span modes: masks, and first-token log-probs against
independent constructions (plain forwards, an isolated mask, KV assembled stage by stage)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from attention_reference import (
    AttentionReference,
    ReferenceOutput,
    base_allowed,
    build_plan,
    plus_groups,
)

from span_workflows import optimize, rag
from span_workflows.compiler.compile import Compiler, Span, TokenizedQuery
from span_workflows.query.span_options import SpanOptions

SYSTEM = "Answer from the documents."
DOCS = [
    "The Amber Lighthouse at Veldmere was built by Tomas Brightholt in 1873.",
    "The Copper Workshop in Dunford was founded by Elira Stonecroft in 1902.",
    "The ship Meridian Star was launched from Qualby harbour in 1951 by Bram Featherley.",
]
QUESTION = "Who built the Amber Lighthouse?"
GREEDY_TOKENS = 4

Run = Callable[..., ReferenceOutput]


@pytest.fixture(scope="module")
def ref(attention_reference: AttentionReference) -> AttentionReference:
    torch.manual_seed(0)
    return attention_reference


@pytest.fixture(scope="module")
def compiler(ref: AttentionReference) -> Compiler:
    return Compiler.for_tokenizer(ref.tokenizer, 32)


def _query(compiler: Compiler, docs: list[str], options: SpanOptions | None = None
           ) -> TokenizedQuery:
    g = optimize(rag(SYSTEM, docs, QUESTION, max_tokens=GREEDY_TOKENS, temperature=0.0))
    return compiler.compile_generate(g, options=options or SpanOptions(attend="prefix"))


@pytest.fixture(scope="module")
def tq3(compiler: Compiler) -> TokenizedQuery:
    tq = _query(compiler, DOCS)
    assert [s.kind for s in tq.spans] == ["prefix", "plus", "plus", "plus", "cross"]
    return tq


@pytest.fixture(scope="module")
def run(ref: AttentionReference, tq3: TokenizedQuery) -> Run:
    """``run(attention, link_tokens=0, max_tokens=GREEDY_TOKENS)`` on the 3-document query,
    each distinct call computed once per module."""
    memo: dict[tuple[str, int, int], ReferenceOutput] = {}

    def _run(attention: Any, link_tokens: int = 0, max_tokens: int = GREEDY_TOKENS
             ) -> ReferenceOutput:
        key = (attention, link_tokens, max_tokens)
        if key not in memo:
            memo[key] = ref.generate(tq3, attention, max_tokens=max_tokens,
                                     link_tokens=link_tokens)
        return memo[key]

    return _run


def _plain(ref: AttentionReference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([token_ids])).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# --- masks, without the model -------------------------------------------------------------

def _toy_spans() -> list[Span]:
    """prefix 0-3 | plus 4-6 | plus 7-9 | cross 10-11 | generated 12-13 | plus 14-15 | cross 16"""
    return [Span(0, 4, "prefix", 4), Span(4, 3, "plus", 3), Span(7, 3, "plus", 3),
            Span(10, 2, "cross", 2), Span(12, 2, "generated", 2), Span(14, 2, "plus", 2),
            Span(16, 1, "cross", 1)]


def test_plus_groups_split_at_ordered_spans() -> None:
    assert plus_groups(_toy_spans()) == [-1, 1, 1, -1, 4, 4, -1]


def test_base_masks_give_each_mode_its_context() -> None:
    spans = _toy_spans()
    prefix, self_, full = (base_allowed(spans, a) for a in ("prefix-final", "self", "full"))
    assert torch.equal(full, torch.tril(torch.ones(17, 17, dtype=torch.bool)))
    assert prefix[8].nonzero().flatten().tolist() == [0, 1, 2, 3, 7, 8]  # prefix + own span
    assert self_[8].nonzero().flatten().tolist() == [7, 8]
    # the second group's context is everything before it; generated spans are always alone
    assert prefix[15].nonzero().flatten().tolist() == [*range(12), 14, 15]
    assert prefix[13].nonzero().flatten().tolist() == [12, 13]
    assert torch.equal(prefix[10:12], full[10:12]) and torch.equal(self_[16], full[16])


def test_link_plan_routes_reads_between_originals_and_copies() -> None:
    plan = build_plan(_toy_spans(), "prefix-final", link_tokens=2)
    assert plan.link_positions == (4, 5, 7, 8, 12, 13, 14, 15)
    n = plan.num_tokens
    copy = {p: n + r for r, p in enumerate(plan.link_positions)}
    assert plan.position_ids.tolist() == [*range(n), *plan.link_positions]

    def reads(row: int) -> list[int]:
        return plan.allowed[row].nonzero().flatten().tolist()

    # a span's own later token reads its originals; a sibling never reads it
    assert reads(6) == [0, 1, 2, 3, 4, 5, 6]
    assert reads(9) == [0, 1, 2, 3, 7, 8, 9]
    # a copy reads everything before it as cached (an earlier span's link tokens in their
    # original version) and its own span's copies up to itself
    assert reads(copy[8]) == [0, 1, 2, 3, 4, 5, 6, copy[7], copy[8]]
    assert reads(copy[4]) == [0, 1, 2, 3, copy[4]]
    # later readers outside the span read copies: the tail, and the next group in prefix mode
    assert reads(10) == [0, 1, 2, 3, 6, 9, 10, *(copy[p] for p in (4, 5, 7, 8))]
    assert reads(15) == [0, 1, 2, 3, 6, 9, 10, 11, 14, 15, *(copy[p] for p in (4, 5, 7, 8))]
    assert reads(13) == [12, 13]  # generated: alone, with its own originals
    assert plan.decode_visible.nonzero().flatten().tolist() == sorted(
        set(range(n + len(copy))) - set(copy))


def test_link_tokens_zero_is_the_base_mode_exactly() -> None:
    spans = _toy_spans()
    for attention in ("prefix-final", "self"):
        plan = build_plan(spans, attention, link_tokens=0)
        assert plan.length == plan.num_tokens == 17 and plan.link_positions == ()
        assert torch.equal(plan.allowed, base_allowed(spans, attention))
        assert bool(plan.decode_visible.all())


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        build_plan(_toy_spans(), "full", link_tokens=1)
    with pytest.raises(ValueError):
        build_plan(_toy_spans(), "prefix-final", link_tokens=-1)
    with pytest.raises(ValueError):
        build_plan(_toy_spans(), "everything")  # type: ignore[arg-type]


# --- the model ------------------------------------------------------------------------------

def test_full_equals_a_plain_forward_and_generate(ref: AttentionReference, run: Run,
                                                  tq3: TokenizedQuery) -> None:
    out = run("full")
    assert out.first_logprobs.dtype == torch.float64
    assert out.first_logprobs.shape == (ref.model.config.vocab_size,)
    assert _max_diff(out.first_logprobs, _plain(ref, tq3.token_ids)) < 1e-4
    ids = torch.tensor([tq3.token_ids])
    with torch.no_grad():
        stock = ref.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=GREEDY_TOKENS, output_scores=True,
                                   return_dict_in_generate=True)
    expected = stock.sequences[0, ids.shape[1]:].tolist()
    assert list(out.token_ids) == expected
    assert out.text == ref.tokenizer.decode(expected, skip_special_tokens=True)
    stock_logprobs = [float(torch.log_softmax(scores[0].double(), -1)[t])
                      for scores, t in zip(stock.scores, expected, strict=True)]
    assert out.token_logprobs == pytest.approx(stock_logprobs, abs=1e-4)


def test_self_equals_an_independent_isolated_mask(ref: AttentionReference, run: Run,
                                                  tq3: TokenizedQuery) -> None:
    n = len(tq3.token_ids)
    segment = torch.zeros(n, dtype=torch.long)
    for i, span in enumerate(tq3.spans):
        segment[span.offset : span.offset + span.length] = i
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for i in range(n):
        if tq3.spans[int(segment[i])].kind == "plus":
            allowed[i] &= segment == segment[i]
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([tq3.token_ids]), attention_mask=mask,
                           position_ids=torch.arange(n)[None]).logits[0, -1]
    assert _max_diff(run("self").first_logprobs, torch.log_softmax(logits.double(), -1)) < 1e-5


def _forward(model: Any, token_ids: list[int], positions: list[int],
             keys: list[torch.Tensor], values: list[torch.Tensor], context: list[int]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Tokens at ``positions`` computed causally after the cached KV of ``context`` (picked
    from ``keys``/``values``); their KV per layer and the last one's logits."""
    from transformers import DynamicCache

    past = None
    if context:
        at = torch.tensor(context)
        past = DynamicCache(ddp_cache_data=[(k[:, :, at], v[:, :, at])
                                            for k, v in zip(keys, values, strict=True)])
    out = model(input_ids=torch.tensor([[token_ids[p] for p in positions]]),
                position_ids=torch.tensor([positions]), past_key_values=past, use_cache=True)
    q = len(positions)
    new = out.past_key_values.layers
    return ([layer.keys[:, :, -q:] for layer in new], [layer.values[:, :, -q:] for layer in new],
            out.logits[0, -1])


def _staged(ref: AttentionReference, tq: TokenizedQuery, attention: str, link_tokens: int,
            steps: int) -> tuple[torch.Tensor, list[int], list[float]]:
    """The span semantics built the way a span cache builds them: every span's KV computed
    in its own context by separate forwards, the first ``link_tokens`` tokens of each span
    recomputed after everything before them as cached (once the whole plus is), the KV
    spliced into one cache, then the tail and greedy decoding with plain causal attention over
    that cache. Returns the first token's log-probs, the greedy tokens and each one's
    log-prob."""
    model, n = ref.model, len(tq.token_ids)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (1, cfg.num_key_value_heads, n, head_dim)
    keys = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    values = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]

    def store(positions: list[int], kv: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        for layer in range(cfg.num_hidden_layers):
            keys[layer][:, :, positions] = kv[0][layer]
            values[layer][:, :, positions] = kv[1][layer]

    logits = torch.empty(0)
    group_start = 0
    links: list[list[int]] = []
    with torch.no_grad():
        for i, span in enumerate(tq.spans):
            positions = list(range(span.offset, span.offset + span.length))
            if span.kind in ("prefix", "cross"):
                computed = [(link, _forward(model, tq.token_ids, link, keys, values,
                                            list(range(link[0])))) for link in links]
                for link, (k, v, _) in computed:
                    store(link, (k, v))
                links = []
                k, v, logits = _forward(model, tq.token_ids, positions, keys, values,
                                        list(range(span.offset)))
                store(positions, (k, v))
                continue
            if i == 0 or tq.spans[i - 1].kind in ("prefix", "cross"):
                group_start = span.offset
            anchored = attention == "prefix-final" and span.kind == "plus"
            k, v, _ = _forward(model, tq.token_ids, positions, keys, values,
                               list(range(group_start)) if anchored else [])
            store(positions, (k, v))
            if positions[:link_tokens]:
                links.append(positions[:link_tokens])
        logprobs = first = torch.log_softmax(logits.double(), -1)
        tokens: list[int] = []
        chosen: list[float] = []
        while True:
            tokens.append(int(logprobs.argmax()))
            chosen.append(float(logprobs[tokens[-1]]))
            if len(tokens) == steps:
                break
            cached = list(range(keys[0].shape[2]))
            k, v, step = _forward(model, [*tq.token_ids, *tokens], [n + len(tokens) - 1],
                                  keys, values, cached)
            keys = [torch.cat([a, b], dim=2) for a, b in zip(keys, k, strict=True)]
            values = [torch.cat([a, b], dim=2) for a, b in zip(values, v, strict=True)]
            logprobs = torch.log_softmax(step.double(), -1)
    return first, tokens, chosen


@pytest.mark.parametrize(("attention", "link_tokens"),
                         [("prefix-final", 0), ("prefix-final", 3)])
def test_one_pass_equals_kv_assembled_stage_by_stage(ref: AttentionReference, run: Run,
                                                     tq3: TokenizedQuery, attention: str,
                                                     link_tokens: int) -> None:
    out = run(attention, link_tokens)
    first, tokens, chosen = _staged(ref, tq3, attention, link_tokens, GREEDY_TOKENS)
    assert _max_diff(out.first_logprobs, first) < 1e-4
    assert list(out.token_ids) == tokens
    assert out.token_logprobs == pytest.approx(chosen, abs=1e-4)


@pytest.mark.parametrize("attention", ["prefix", "prefix-final"])
def test_linking_every_token_of_two_prefix_spans_gives_full_attention(
        ref: AttentionReference, compiler: Compiler, attention: str) -> None:
    """The second span's link tokens read the first span as cached, which in prefix mode is
    what full attention computes for it; the first span already follows its context."""
    tq = _query(compiler, DOCS[:2])
    longest = max(s.length for s in tq.spans if s.kind == "plus")
    linked = ref.generate(tq, attention, max_tokens=GREEDY_TOKENS, link_tokens=longest)
    full = ref.generate(tq, "full", max_tokens=GREEDY_TOKENS)
    if attention != "prefix":  # built stage by stage, no plan
        assert linked.plan is not None
        assert len(linked.plan.link_positions) == tq.num_span_tokens
    assert _max_diff(linked.first_logprobs, full.first_logprobs) < 1e-4
    assert linked.token_ids == full.token_ids
    assert linked.token_logprobs == pytest.approx(full.token_logprobs, abs=1e-4)


def test_linking_every_token_of_three_spans_reads_earlier_spans_as_cached(
        run: Run, tq3: TokenizedQuery) -> None:
    """With three spans the third one's link tokens read the second as cached (computed
    without the first), so even linking every token is not full attention."""
    longest = max(s.length for s in tq3.spans if s.kind == "plus")
    linked, full = run("prefix-final", longest), run("full")
    assert _max_diff(linked.first_logprobs, full.first_logprobs) > 1e-3


def test_a_single_plus_span_in_prefix_mode_is_full_attention(ref: AttentionReference,
                                                             compiler: Compiler) -> None:
    tq = _query(compiler, DOCS[:1])
    assert [s.kind for s in tq.spans] == ["prefix", "plus", "cross"]
    prefix = ref.generate(tq, "prefix", max_tokens=0)
    assert prefix.token_ids == ()
    assert _max_diff(prefix.first_logprobs, _plain(ref, tq.token_ids)) < 1e-4


def test_span_modes_differ_measurably(run: Run) -> None:
    prefix, self_, full = run("prefix"), run("self"), run("full")
    top = int(prefix.first_logprobs.argmax())
    assert abs(prefix.first_logprobs[top] - self_.first_logprobs[top]) > 1e-3
    assert abs(prefix.first_logprobs[top] - full.first_logprobs[top]) > 1e-3
    linked = run("prefix", 3)
    assert abs(prefix.first_logprobs[top] - linked.first_logprobs[top]) > 1e-3
    # A span that moved saw its prefix at its prepare-time distance: not the final-position
    # pattern.
    final = run("prefix-final")
    assert abs(prefix.first_logprobs[top] - final.first_logprobs[top]) > 1e-3


def test_prefix_mode_without_moves_equals_the_final_position_pattern(
        ref: AttentionReference, compiler: Compiler) -> None:
    """With spans that are not moved (each one alone after the prefix), the staged build and
    the masked pattern are one computation: checks the staging and the key rotation."""
    tq = _query(compiler, DOCS[:1])
    staged = ref.generate(tq, "prefix", max_tokens=3, link_tokens=2)
    masked = ref.generate(tq, "prefix-final", max_tokens=3, link_tokens=2)
    assert _max_diff(staged.first_logprobs, masked.first_logprobs) < 1e-4
    assert staged.token_ids == masked.token_ids


def test_rotating_keys_equals_computing_them_at_the_new_position(ref: AttentionReference,
                                                                 compiler: Compiler) -> None:
    """The reference's key rotation (the model's own rotary embedding) moves keys exactly."""
    from attention_reference import _SplicedCache

    tq = _query(compiler, DOCS[:1])
    ids = tq.token_ids[:20]
    here, there = _SplicedCache(ref.model, 20), _SplicedCache(ref.model, 20)
    here.compute(ids, list(range(20)), [], list(range(20)), rotate_by=37)
    there.compute(ids, list(range(37, 57)), [], list(range(20)))
    # Alone (no context), tokens at 0.. rotated by 37 == tokens computed at 37..
    assert torch.allclose(here.keys[5], there.keys[5], atol=1e-4)
    assert torch.allclose(here.values[5], there.values[5], atol=1e-4)


@pytest.mark.parametrize("options", [SpanOptions(pad="inside"), SpanOptions(pad="before"),
                                     SpanOptions(marker=True)],
                         ids=["pad-inside", "pad-before", "marker"])
def test_padded_layouts_in_full_attention_equal_a_plain_forward(
        ref: AttentionReference, compiler: Compiler, options: SpanOptions) -> None:
    tq = _query(compiler, DOCS[:1], options)
    span = next(s for s in tq.spans if s.kind == "plus")
    assert span.pad_tokens > 0
    if options.pad != "after":  # the padding sits before the span's last token
        assert span.padding.stop < span.offset + span.length
    out = ref.generate(tq, "full", max_tokens=0, top_logprobs=5)
    assert _max_diff(out.first_logprobs, _plain(ref, tq.token_ids)) < 1e-4
    assert len(out.top_logprobs) == 5
    assert max(out.top_logprobs.values()) == pytest.approx(float(out.first_logprobs.max()))
