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

import json
import math
import random
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from span_workflows.apps.qa_set import QUESTION_KINDS, Question, is_correct, make_questions
from span_workflows.apps.report import wilson
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
    """A span variant: no link blocks unless ``fields`` ask for them (whatever the default)."""
    return Variant(name, SpanOptions(**{"link_blocks": 0, **fields}))


def _layout(name: str, **fields: Any) -> Variant:
    """The tokens of span variant ``fields``, read with full attention."""
    return Variant(name, _span(name, **fields).options, layout_only=True)


#: Every variant the benchmark knows, by name.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("stock"),
    _span("prefix"),
    _span("prefix/link", link_blocks=1),
    _span("prefix/link2", link_blocks=2),
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


class AnswerStore:
    """Answers of finished (variant, document count) runs in a JSON file, so a long run that
    stops (or one variant added later) resumes without answering anything twice. Entries are
    keyed by variant, document count, question count, seed and model."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                from span_workflows.errors import SpanQueryError

                raise SpanQueryError("--answers", f"{path} is not an answers file ({exc})"
                                     ) from None

    @staticmethod
    def key(variant: str, n_docs: int, count: int, seed: int, model: str) -> str:
        """The entry name of one run."""
        return f"{variant}|docs={n_docs}|questions={count}|seed={seed}|model={model}"

    def get(self, key: str) -> _Answers | None:
        """The stored answers of ``key``, if any."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        first = [{int(t): float(lp) for t, lp in d.items()} for d in entry["first"]]
        return _Answers(list(entry["correct"]), list(entry["facts"]), first)

    def put(self, key: str, answers: _Answers) -> None:
        """Store (and, with a path, save) the answers of ``key``."""
        self.entries[key] = {"correct": answers.correct, "facts": answers.facts,
                             "first": [{str(t): lp for t, lp in d.items()}
                                       for d in answers.first]}
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.entries))


def bench_quality(engine: Any, variant_names: Sequence[str], docs_counts: Sequence[int],
                  count: int, *, seed: int = 0, ttft_docs: int = 16, ttft_doc_tokens: int = 440,
                  reps: int = 3, progress: bool = True,
                  store: AnswerStore | None = None) -> list[dict[str, Any]]:
    """One row per (variant, document count); see the module docstring. ``stock`` is always
    run (the reference of ``kl_first_token`` and ``speedup_hit``), and so is the ``full@``
    variant of each span variant's layout (the reference of ``kl_vs_layout``) when
    ``variant_names`` lists it. Answers found in ``store`` are not computed again;
    ``ttft_docs=0`` skips the TTFT columns (``None``)."""
    from tqdm.auto import tqdm

    from span_workflows.apps.corpus import documents

    store = store or AnswerStore(None)
    model = Path(str(getattr(engine, "model_dir", "model"))).name
    names = ["stock", *dict.fromkeys(n for n in variant_names if n != "stock")]
    variants = [_variant(n) for n in names]
    bar = tqdm(total=len(variants) * len(docs_counts) * count, desc="quality", unit="q",
               disable=not progress)
    rows: list[dict[str, Any]] = []
    for n_docs in docs_counts:
        questions = make_questions(count, n_docs, seed)
        answers: dict[str, _Answers] = {}
        for variant in variants:
            key = store.key(variant.name, n_docs, count, seed, model)
            found = store.get(key)
            if found is None:
                bar.set_postfix_str(f"{variant.name}, {n_docs} docs")
                engine.reset_cache()
                found = answer(engine, variant, questions, progress=bar.update)
                store.put(key, found)
            else:
                bar.update(count)
            answers[variant.name] = found
        for variant in variants:
            layout = answers.get(_layout_name(variant.options)) if variant.is_span else None
            rows.append(_row(variant, n_docs, answers[variant.name], answers["stock"], layout))
    bar.close()
    if ttft_docs < 1:  # answers only
        for row in rows:
            row["ttft_hit_s"] = row["speedup_hit"] = None
        return rows
    ttft_texts = documents(engine.tokenizer, ttft_docs, ttft_doc_tokens)
    ttft_question = "Which module do the documents describe first?"
    stock_ttft = hit_ttft(engine, None, ttft_texts, ttft_question, reps)
    hits = {v.name: hit_ttft(engine, v.options, ttft_texts, ttft_question, reps)
            for v in variants if v.is_span}
    for row in rows:
        if row["variant"] == "stock":
            row["ttft_hit_s"], row["speedup_hit"] = stock_ttft, 1.0
        elif row["variant"] in hits:
            t = hits[row["variant"]]
            row["ttft_hit_s"], row["speedup_hit"] = t, stock_ttft / t
        else:
            row["ttft_hit_s"] = row["speedup_hit"] = None
    return rows


#: What ``bench quality`` runs unless ``--variants`` says otherwise.
DEFAULT_VARIANTS = ("stock", "prefix", "prefix/link", "self", "self/link", "full@pad-after")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (accuracy with its interval, per fact kind, KL, TTFT)."""
    def pct(value: float | None) -> str:
        return "–" if value is None or math.isnan(value) else f"{100 * value:.1f}"

    def num(value: float | None, digits: int = 3) -> str:
        return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"

    kinds = list(QUESTION_KINDS)
    head = ["variant", "docs", "questions", "accuracy %", "95 % CI",
            *[f"{k} %" for k in kinds], "KL vs stock", "KL vs layout", "hit TTFT (s)",
            "speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        speed = r.get("speedup_hit")
        cells = [r["variant"], str(r["n_docs"]), str(r["questions"]), pct(r["accuracy"]),
                 f"{pct(r['ci_low'])}–{pct(r['ci_high'])}",
                 *[pct(r[f"acc_{k}"]) for k in kinds], num(r["kl_first_token"]),
                 num(r["kl_vs_layout"]), num(r.get("ttft_hit_s"), 4),
                 "–" if speed is None else f"{speed:.1f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_quality(rows: list[dict[str, Any]], path: Path) -> None:
    """Accuracy (95 % intervals) per variant and document count, next to each span
    variant's hit speedup over stock; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["variant"] for r in rows))
    counts = sorted({r["n_docs"] for r in rows})
    fig, (acc_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.2),
                                           gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(counts)
    for j, n_docs in enumerate(counts):
        by_name = {r["variant"]: r for r in rows if r["n_docs"] == n_docs}
        xs = [i + (j - (len(counts) - 1) / 2) * width for i in range(len(names))]
        acc = [100 * by_name[n]["accuracy"] if n in by_name else math.nan for n in names]
        err = [[100 * (by_name[n]["accuracy"] - by_name[n]["ci_low"]) if n in by_name else 0
                for n in names],
               [100 * (by_name[n]["ci_high"] - by_name[n]["accuracy"]) if n in by_name else 0
                for n in names]]
        acc_ax.bar(xs, acc, width, yerr=err, capsize=3, label=f"{n_docs} documents")
    acc_ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    acc_ax.set_ylabel("answers correct (%)")
    acc_ax.set_title("invented-fact RAG answers (greedy)")
    acc_ax.grid(True, axis="y", alpha=0.3)
    acc_ax.legend()
    fast = {r["variant"]: r["speedup_hit"] for r in rows if r.get("speedup_hit")}
    speed_ax.bar(list(fast), list(fast.values()), color="tab:green")
    speed_ax.set_yscale("log")
    speed_ax.set_ylabel("stock TTFT / span-hit TTFT")
    speed_ax.set_title("TTFT speedup, 16 documents reordered")
    speed_ax.tick_params(axis="x", rotation=30)
    speed_ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_quality(args: Any) -> int:
    """``span-workflows bench quality``: run, print the table, write what was asked for."""
    from span_workflows.apps.report import print_table
    from span_workflows.engine import Engine

    names = list(args.variants or DEFAULT_VARIANTS)
    for name in names:
        _variant(name)  # unknown names fail before the engine starts
    if args.questions < 1:
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("--questions", "must be at least 1")
    store = AnswerStore(args.answers)
    engine = Engine(args.model, kv_cache_gib=4, progress=True)
    try:
        rows = bench_quality(engine, names, args.docs or [4, 8], args.questions,
                             seed=args.seed, reps=args.reps, store=store)
    finally:
        engine.close()
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(rows))
    if args.plot:
        plot_quality(rows, args.plot)
    return 0


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


__all__ = ["DEFAULT_VARIANTS", "MAX_TOKENS", "SYSTEM", "VARIANTS", "AnswerStore", "Variant",
           "answer", "bench_quality", "hit_ttft", "kl_top", "markdown_table", "plot_quality",
           "run_quality"]
