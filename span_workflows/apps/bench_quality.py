"""``span-workflows bench quality``: answer quality of every span mode next to stock vLLM.

One run, one engine, one model, the same questions: invented-fact RAG questions
(:mod:`span_workflows.apps.qa_set`), each over ``n_docs`` documents in random order of which
exactly one holds the answer, answered greedily. For each *variant* and document count a row:

* ``accuracy`` — normalized exact match of the answer in the first 40 generated tokens, with
  its 95 % Wilson interval (``ci_low``, ``ci_high``) and per fact kind (``acc_who`` …);
* ``kl_first_token`` — mean KL divergence of the first generated token's distribution from
  stock's (top-20 log-probabilities; tokens missing from a top-20 get its smallest value);
  ``kl_vs_layout`` — the same against full attention over the variant's own token layout;
* ``ttft_hit_s`` / ``speedup_hit`` — TTFT of a span-cache hit at 16 documents × 440 tokens
  (documents reordered since they were cached) and stock's TTFT on the same prompt over it.

Variants: ``stock`` (the plain chat prompt, vLLM's prefix caching), the span modes of
:class:`~span_workflows.layout.SpanOptions` (what spans attend to × where the padding goes ×
marker), and ``full@<layout>`` — the span layout's tokens with ordinary full attention, which
separates what the layout costs from what isolation costs.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from span_workflows.apps.qa_set import QUESTION_KINDS, Question, is_correct, make_questions
from span_workflows.builders import rag
from span_workflows.layout import SpanOptions

SYSTEM = "Answer the question using only the documents. Be brief."
MAX_TOKENS = 40
TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of answering: ``stock``, span mode ``options``, or (``layout_only``) the span
    layout of ``options`` with full attention."""

    name: str
    options: SpanOptions | None = None
    layout_only: bool = False

    @property
    def is_span(self) -> bool:
        """Whether this variant reuses span KV (and so has a hit TTFT)."""
        return self.options is not None and not self.layout_only


def _span(name: str, **fields: Any) -> Variant:
    return Variant(name, SpanOptions(**fields))


def _layout(name: str, **fields: Any) -> Variant:
    return Variant(name, SpanOptions(**fields), layout_only=True)


#: Every variant the benchmark knows, by name.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("stock"),
    _span("prefix"),
    _span("prefix/link", link_blocks=1),
    _span("prefix/pad-inside", pad="inside"),
    _span("prefix/pad-before", pad="before"),
    _span("prefix/marker", marker=True),
    _span("self", attend="self"),
    _span("self/link", attend="self", link_blocks=1),
    _span("self/marker", attend="self", marker=True),
    _layout("full@pad-after"),
    _layout("full@pad-inside", pad="inside"),
    _layout("full@pad-before", pad="before"),
    _layout("full@marker", marker=True),
)}


@dataclass
class _Answers:
    correct: list[bool]
    facts: list[str]
    first: list[dict[int, float]]


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def kl_top(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) from two top-k log-probability dicts: over p's tokens, each missing from q
    taken at q's smallest listed log-probability (an upper bound of its true value)."""
    if not p or not q:
        return float("nan")
    floor = min(q.values())
    return sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items())


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def answer(engine: Any, variant: Variant, questions: Sequence[Question], batch: int = 16,
           progress: Callable[[int], None] | None = None) -> _Answers:
    """Answer every question with ``variant``; greedy, :data:`MAX_TOKENS` tokens."""
    texts: list[str] = []
    first: list[dict[int, float]] = []
    for chunk in _chunks(questions, batch):
        queries = [rag(SYSTEM, q.documents, q.question, max_tokens=MAX_TOKENS, temperature=0.0)
                   for q in chunk]
        if variant.options is None:
            results = engine.execute_many(queries, span_mode=False, logprobs=TOP_LOGPROBS)
            texts += [r.text for r in results]
            first += [r.first_logprobs for r in results]
        elif variant.layout_only:
            prompts = [engine.compile(q, span_options=variant.options).token_ids
                       for q in queries]
            outs = engine.complete_many(prompts, max_tokens=MAX_TOKENS,
                                        logprobs=TOP_LOGPROBS)
            texts += [o.texts[0] for o in outs]
            first += [o.first_logprobs for o in outs]
        else:
            results = engine.execute_many(queries, logprobs=TOP_LOGPROBS,
                                          span_options=variant.options)
            texts += [r.text for r in results]
            first += [r.first_logprobs for r in results]
        if progress is not None:
            progress(len(chunk))
    return _Answers([is_correct(q.answer, t) for q, t in zip(questions, texts, strict=True)],
                    [q.fact for q in questions], first)


def hit_ttft(engine: Any, options: SpanOptions | None, docs: Sequence[str], question: str,
             reps: int = 3) -> float:
    """Median TTFT of ``question`` over ``docs`` when its spans are cached (documents
    reordered since they were prepared); with ``options=None``, stock's TTFT on a fresh
    cache."""
    times = []
    rng = random.Random(1)
    for _ in range(reps):
        engine.reset_cache()
        shuffled = list(docs)
        rng.shuffle(shuffled)
        if options is None:
            times.append(engine.stock(rag(SYSTEM, shuffled, question, max_tokens=1))
                         .metrics.ttft_s)
            continue
        engine.execute(rag(SYSTEM, docs, question, max_tokens=1), span_options=options)
        times.append(engine.execute(rag(SYSTEM, shuffled, question, max_tokens=1),
                                    span_options=options).metrics.ttft_s)
    return statistics.median(times)


def bench_quality(engine: Any, variant_names: Sequence[str], docs_counts: Sequence[int],
                  count: int, *, seed: int = 0, ttft_docs: int = 16, ttft_doc_tokens: int = 440,
                  reps: int = 3, progress: bool = True) -> list[dict[str, Any]]:
    """One row per (variant, document count); see the module docstring. ``stock`` is always
    run (the reference of ``kl_first_token`` and ``speedup_hit``)."""
    from tqdm.auto import tqdm

    from span_workflows.apps.bench import documents

    names = ["stock", *[n for n in variant_names if n != "stock"]]
    variants = [_variant(n) for n in names]
    layouts = {_layout_name(v.options): VARIANTS[_layout_name(v.options)]
               for v in variants if v.is_span and _layout_name(v.options) in VARIANTS}
    runs = {v.name: v for v in [*variants, *layouts.values()]}
    bar = tqdm(total=len(runs) * len(docs_counts) * count, desc="quality", unit="q",
               disable=not progress)
    rows: list[dict[str, Any]] = []
    for n_docs in docs_counts:
        questions = make_questions(count, n_docs, seed)
        answers: dict[str, _Answers] = {}
        for name, variant in runs.items():
            bar.set_postfix_str(f"{name}, {n_docs} docs")
            engine.reset_cache()
            answers[name] = answer(engine, variant, questions, progress=bar.update)
        for variant in variants:
            own = answers[variant.name]
            layout = (answers.get(_layout_name(variant.options)) if variant.is_span else None)
            rows.append(_row(variant, n_docs, own, answers["stock"], layout))
    bar.close()
    ttft_texts = documents(engine.tokenizer, ttft_docs, ttft_doc_tokens)
    ttft_question = "Which module do the documents describe first?"
    stock_ttft = hit_ttft(engine, None, ttft_texts, ttft_question, reps)
    for row in rows:
        variant = runs[row["variant"]]
        if variant.name == "stock":
            row["ttft_hit_s"], row["speedup_hit"] = stock_ttft, 1.0
        elif variant.is_span:
            t = hit_ttft(engine, variant.options, ttft_texts, ttft_question, reps)
            row["ttft_hit_s"], row["speedup_hit"] = t, stock_ttft / t
        else:
            row["ttft_hit_s"] = row["speedup_hit"] = None
    return rows


def _variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("--variants", f"unknown variant {name!r} (known: "
                                           f"{', '.join(VARIANTS)})") from None


def _layout_name(options: SpanOptions | None) -> str:
    """The ``full@…`` variant with the same token layout as span mode ``options``."""
    if options is None:
        return ""
    if options.marker:
        return "full@marker"
    return f"full@pad-{options.pad}"


def _row(variant: Variant, n_docs: int, own: _Answers, stock: _Answers,
         layout: _Answers | None) -> dict[str, Any]:
    n = len(own.correct)
    hits = sum(own.correct)
    low, high = wilson(hits, n)
    row: dict[str, Any] = {
        "variant": variant.name, "n_docs": n_docs, "questions": n, "accuracy": hits / n,
        "ci_low": low, "ci_high": high,
    }
    for fact in QUESTION_KINDS:
        picked = [c for c, f in zip(own.correct, own.facts, strict=True) if f == fact]
        row[f"acc_{fact}"] = sum(picked) / len(picked) if picked else float("nan")
    row["kl_first_token"] = _mean_kl(stock.first, own.first)
    row["kl_vs_layout"] = _mean_kl(layout.first, own.first) if layout is not None else None
    return row


def _mean_kl(ref: list[dict[int, float]], other: list[dict[int, float]]) -> float:
    values = [kl_top(p, q) for p, q in zip(ref, other, strict=True)]
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


__all__ = ["MAX_TOKENS", "SYSTEM", "VARIANTS", "Variant", "answer", "bench_quality", "hit_ttft",
           "kl_top", "wilson"]
