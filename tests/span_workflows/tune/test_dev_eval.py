"""The dev score on the real SmolLM2-135M (Hugging Face transformers only, no vLLM engine):
the span prompt's cache, decoded on token by token, predicts what :func:`span_forward`
predicts (so greedy span answers are the span mode the training optimizes), and a stock-form
dev score gives answers and counts."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from span_workflows.compiler.compile import Compiler
from span_workflows.query.span_options import SpanOptions
from span_workflows.tune.dev_eval import FORMS, dev_query, dev_score, end_ids
from span_workflows.tune.dev_set import LAYOUTS, make_dev_set
from span_workflows.tune.forward import span_forward, span_prompt_cache

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def base():
    from span_workflows.tune.train import load_base

    model, tokenizer, _ = load_base(None, "cpu")
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def base64(base):
    """The base in float64: the two paths then agree far below 1e-5 (in float32 their logits
    differ by a few 1e-5, the rounding of matmuls of other shapes)."""
    return copy.deepcopy(base[0]).double().eval()


def _small(layout_index: int):
    """A dev question cut short (three cards of about 40 tokens): the check is about the
    forward, not the cards."""
    q = make_dev_set(5, seed=2)[layout_index]
    docs = [q.documents[q.target][:180], *(d[:150] for i, d in enumerate(q.documents)
                                          if i != q.target)][:3]
    return dataclasses.replace(q, documents=tuple(docs), target=0)


@pytest.mark.parametrize(("layout_index", "link_blocks"), [(0, 1), (3, 0)])
def test_the_prompt_cache_continued_token_by_token_equals_span_forward(
        base, base64, layout_index: int, link_blocks: int) -> None:
    """``rag`` with link blocks (one plus of three spans), ``numbered`` (three plus groups of
    one span between ordered messages): the answer's logits from the prompt cache, fed one
    token at a time as greedy decoding does, equal :func:`span_forward`'s."""
    tokenizer = base[1]
    q = _small(layout_index)
    options = SpanOptions(link_blocks=link_blocks)
    tq = Compiler.for_tokenizer(tokenizer, 16, options=options).compile_generate(
        dev_query(q), options=options)
    assert sum(s.kind == "plus" for s in tq.spans) == 3
    assert any(len(s) > 2 and s[2] for s in tq.segments) == bool(link_blocks)
    answer = [*tokenizer.encode(q.answer + ".", add_special_tokens=False),
              *sorted(end_ids(tokenizer))[:1]]
    with torch.no_grad():
        expected = span_forward(base64, tq, answer)
        prompt = span_prompt_cache(base64, tq)
        out = base64(input_ids=torch.tensor([prompt.tail_ids]),
                     position_ids=prompt.tail_positions, past_key_values=prompt.cache,
                     use_cache=True)
        rows = [out.logits[0, -1]]
        position = int(prompt.tail_positions[0, -1]) + 1
        for token in answer[:-1]:
            out = base64(input_ids=torch.tensor([[token]]),
                         position_ids=torch.tensor([[position]]),
                         past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1])
            position += 1
    got = torch.stack(rows)
    assert got.shape == expected.shape and got.dtype == torch.float64
    assert (got - expected).abs().max() < 1e-5


def test_a_stock_dev_score_answers_every_question(base) -> None:
    model, tokenizer = base
    questions = make_dev_set(4, seed=0)
    model.train()  # dev_score evaluates in eval mode and puts training back
    try:
        score = dev_score(model, tokenizer, questions, form="stock", max_new_tokens=12)
        assert model.training
    finally:
        model.eval()
    assert score.form == "stock" and score.total == 4 and len(score.answers) == 4
    assert all(a.strip() for a in score.answers)
    assert 0 <= score.correct <= 4 and score.accuracy == score.correct / 4
    assert score.by_layout == {layout: score.by_layout[layout] for layout in LAYOUTS[:4]}
    assert sum(c for c, _ in score.by_layout.values()) == score.correct
    assert all(t == 1 for _, t in score.by_layout.values())
    with pytest.raises(ValueError, match="form must be one of"):
        dev_score(model, tokenizer, questions, form="plain")
    assert FORMS == ("span", "stock", "chat")
