"""The training forward computes what the engine computes: first-token log-probabilities of
span mode (documents moved since they were cached, so their keys are re-rotated; with and
without link blocks; on the base and with the span-ready LoRA adapter active) and of stock mode
equal the engine's within 1e-3 nat (float32); so do the log-probabilities of every token of a
whole answer, teacher-forced, at 8 documents with the LoRA active, in span and stock form."""

from __future__ import annotations

import pytest
import torch

from span_workflows import optimize, rag
from span_workflows.compiler.model import ADAPTERS_DIR, BASE_MODEL_NAME, SPAN_MODEL_NAME
from span_workflows.query.span_options import SpanOptions
from span_workflows.tune.forward import span_forward, stock_forward
from span_workflows.tune.train import _end_of_turn

pytestmark = pytest.mark.engine

SYSTEM = "Use the documents to answer. Keep it short."
DOCS = [
    "The Plyack Mill stands on the stream below Skoxbury. It was built by the miller Hedda "
    "Stoaxson in 1788. It has seven millstones, and its wheel still turns in spring.",
    "The Jueng Library was founded in 1901 by the scholar Ivo Trayckman. It lies in the old "
    "square of Glioton and has four reading rooms. " * 2,
    "The Shoax Canal runs from the river to Flyness. The engineer Margit Vlueck dug it in "
    "1822; it has eleven locks and a towpath lined with poplars.",
]
QUESTION = "Who built the Plyack Mill?"


@pytest.fixture(scope="module")
def model(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(engine.model_dir),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapted(engine):
    """The base with the span-ready adapter as a LoRA (peft, not merged): what training runs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(ADAPTERS_DIR / SPAN_MODEL_NAME)).eval()


def _check(engine_logprobs: dict[int, float], logits: torch.Tensor) -> None:
    ours = torch.log_softmax(logits[0].double(), dim=-1)
    assert engine_logprobs
    for token, logprob in engine_logprobs.items():
        assert abs(float(ours[token]) - logprob) < 1e-3, (token, logprob, float(ours[token]))


@pytest.mark.parametrize(("link_blocks", "weights"), [(0, BASE_MODEL_NAME), (1, BASE_MODEL_NAME),
                                                      (0, SPAN_MODEL_NAME)])
def test_span_forward_equals_the_engine_in_span_mode(engine, model, adapted, link_blocks: int,
                                                     weights: str) -> None:
    options = SpanOptions(link_blocks=link_blocks)
    engine.reset_cache()
    # cache every document in another combination first: the query below reads them moved
    engine.execute(rag(SYSTEM, DOCS[:2], "Where is the Jueng Library?", max_tokens=1),
                   span_options=options, weights=weights)
    engine.execute(rag(SYSTEM, DOCS[2:], "Where is the Shoax Canal?", max_tokens=1),
                   span_options=options, weights=weights)
    query = rag(SYSTEM, DOCS, QUESTION, max_tokens=1)
    result = engine.execute(query, logprobs=5, span_options=options, weights=weights)
    assert result.metrics.weights == weights
    assert result.metrics.prepare_requests == 0 and result.metrics.cached_tokens > 0
    assert result.metrics.link_requests == (2 if link_blocks else 0)
    tq = engine.compile(query, span_options=options)
    assert tq.token_ids == result.query.token_ids
    with torch.no_grad():
        logits = span_forward(adapted if weights == SPAN_MODEL_NAME else model, tq,
                              [result.token_ids[0]])
    _check(result.first_logprobs, logits)


def test_stock_forward_equals_the_engine_in_stock_mode(engine, model) -> None:
    query = rag(SYSTEM, DOCS, QUESTION, max_tokens=1)
    result = engine.execute_many([query], span_mode=False, logprobs=5)[0]
    assert result.metrics.weights == BASE_MODEL_NAME
    prompt = engine.compile(query, span_mode=False).token_ids
    with torch.no_grad():
        logits = stock_forward(model, prompt, [result.token_ids[0], _end_of_turn(
            engine.tokenizer)])
    _check(result.first_logprobs, logits)


def test_span_forward_differs_from_full_attention_over_the_same_tokens(engine, model) -> None:
    """The check above could fail: the span forward is not plain attention over its tokens."""
    tq = engine.compile(optimize(rag(SYSTEM, DOCS, QUESTION)))
    with torch.no_grad():
        span = torch.log_softmax(span_forward(model, tq, [0])[0].double(), dim=-1)
        full = torch.log_softmax(stock_forward(model, tq.token_ids, [0])[0].double(), dim=-1)
    assert (span - full).abs().max() > 1e-2


def test_gradients_reach_the_adapters_through_every_span(engine, model) -> None:
    from peft import LoraConfig, get_peft_model

    tuned = get_peft_model(model, LoraConfig(r=4, target_modules=["k_proj", "v_proj"],
                                             lora_dropout=0.0))
    try:
        tq = engine.compile(optimize(rag(SYSTEM, DOCS, QUESTION)),
                            span_options=SpanOptions(link_blocks=1))
        answer = engine.tokenizer.encode("Hedda Stoaxson.", add_special_tokens=False)
        logits = span_forward(tuned, tq, answer)
        torch.nn.functional.cross_entropy(logits, torch.tensor(answer)).backward()
        grads = [p.grad for n, p in tuned.named_parameters() if "lora_B" in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        tuned.unload()


EIGHT = [f"The {c} lighthouse of {town} was built by {who} in {year}; its lamp is {c} and it "
         f"stands {m} metres above the bay, where the ferries from {town} turn north."
         for c, town, who, year, m in [
             ("red", "Varnholm", "Elira Quast", 1842, 31), ("white", "Ostmere", "Bram Tolk", 1861,
                                                            24),
             ("green", "Kelby", "Ida Marr", 1799, 40), ("blue", "Faro Sul", "Jon Adder", 1903, 18),
             ("black", "Tresk", "Una Vell", 1877, 52), ("grey", "Holm", "Per Ask", 1820, 27),
             ("yellow", "Lune", "Cai Rho", 1888, 35), ("orange", "Brae", "Ola Fenn", 1910, 22)]]
EIGHT_QUESTION = "Who built the green lighthouse, and in which year? Answer in a sentence."


def _check_answer(engine_logprobs: list[dict[int, float]], logits: torch.Tensor) -> int:
    """Every generated token's top log-probabilities equal ours within 1e-3; returns how many
    positions were compared."""
    ours = torch.log_softmax(logits.double(), dim=-1)
    assert len(engine_logprobs) == ours.shape[0]
    for position, top in enumerate(engine_logprobs):
        assert top
        for token, logprob in top.items():
            assert abs(float(ours[position, token]) - logprob) < 1e-3, (position, token)
    return len(engine_logprobs)


@pytest.mark.parametrize("span_mode", [True, False])
def test_a_whole_answer_at_eight_documents_with_the_lora_equals_the_engine(
        engine, adapted, span_mode: bool) -> None:
    from span_workflows.tune.train import TRAINED_OPTIONS

    options = SpanOptions(**TRAINED_OPTIONS)  # what the adapter is served with
    query = rag(SYSTEM, EIGHT, EIGHT_QUESTION, max_tokens=16)
    engine.reset_cache()
    if span_mode:  # the documents cached in other orders first: the query reads them moved
        engine.execute(rag(SYSTEM, EIGHT[4:], "Which lamp is blue?", max_tokens=1),
                       weights=SPAN_MODEL_NAME)
        engine.execute(rag(SYSTEM, EIGHT[:4][::-1], "Which lamp is red?", max_tokens=1),
                       weights=SPAN_MODEL_NAME)
    [result] = engine.execute_many([query], span_mode=span_mode, logprobs=5,
                                   weights=SPAN_MODEL_NAME)
    assert result.metrics.weights == SPAN_MODEL_NAME
    answer = result.token_ids
    assert len(answer) >= 8
    with torch.no_grad():
        if span_mode:
            assert result.metrics.prepare_requests == 0 and result.metrics.cached_tokens > 0
            assert result.metrics.link_requests == 0
            tq = engine.compile(query, span_options=options)
            assert tq.token_ids == result.query.token_ids
            logits = span_forward(adapted, tq, answer)
        else:
            prompt = engine.compile(query, span_mode=False).token_ids
            logits = stock_forward(adapted, prompt, answer)
    assert _check_answer(result.logprobs, logits) == len(answer)
