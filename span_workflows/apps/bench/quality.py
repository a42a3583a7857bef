"""``span-workflows bench quality``: answer quality of every span mode next to stock vLLM.

One run, one engine, one model, the same questions: invented-fact RAG questions
(:mod:`span_workflows.apps.bench.qa_set`), each over ``n_docs`` documents in random order of which
exactly one holds the answer, answered greedily, at two document sizes (``short``: one
paragraph, 65–85 tokens; ``long``: 256–512 tokens, what a RAG chunker returns). For each
*variant*, document size and document count a row:

* ``accuracy`` — normalized exact match of the answer in the first 40 generated tokens, with
  its 95 % Wilson interval (``ci_low``, ``ci_high``), per fact kind (``acc_who`` …) and by
  where the answering document stands (``acc_first``, ``acc_middle``, ``acc_last``);
  ``delta_vs_stock`` — accuracy minus stock's on the same questions, with its paired 95 %
  interval (``delta_low``, ``delta_high``);
* ``kl_first_token`` — mean KL divergence of the first generated token's distribution from
  stock's (top-20 log-probabilities; tokens missing from a top-20 get its smallest value);
  ``kl_vs_layout`` — the same against full attention over the variant's own token layout;
* ``perplexity`` (with ``--perplexity N``) — the model's perplexity on N held-out passages of
  standard-library documentation (:mod:`span_workflows.apps.bench.perplexity`), the same for every
  row of one model: what fine-tuning cost outside RAG;
* ``ttft_hit_s`` / ``speedup_hit`` / ``steps_hit`` — TTFT and engine steps of a span-cache hit
  at 16 documents × 440 tokens of a *new combination* of cached documents (each cached by an
  earlier query, never this set: what a retriever asks), and stock's TTFT on the same prompt
  over it; ``…_own`` the same at 16 documents of the row's size.

Variants: ``stock`` (the plain chat prompt, vLLM's prefix caching), the span modes of
:class:`~span_workflows.query.span_options.SpanOptions` (what spans attend to × link blocks × where
the padding goes × marker) — the ``prefix/link…`` family is the *link frontier*, accuracy against
speed — and ``full@<layout>``: the span layout's tokens with ordinary full attention, which
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

from span_workflows.apps.bench.qa_set import (
    DOC_SIZES,
    QUESTION_KINDS,
    Question,
    is_correct,
    make_questions,
)
from span_workflows.apps.bench.report import save_figure, wilson
from span_workflows.logprobs import kl_top, mean_kl
from span_workflows.query.builders import rag
from span_workflows.query.span_options import SpanOptions

SYSTEM = "Answer the question using only the documents. Be brief."
MAX_TOKENS = 40
TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Variant:
    """One way of answering: ``stock``, span mode ``options``, (``layout_only``) the span
    layout of ``options`` with full attention, or (``routed``) what the default engine does:
    span mode on the weights its router picks, with their own recorded options."""

    name: str
    options: SpanOptions | None = None
    layout_only: bool = False
    routed: bool = False

    @property
    def is_span(self) -> bool:
        """Whether this variant reuses span KV (and so has a hit TTFT)."""
        return (self.options is not None and not self.layout_only) or self.routed


def _span(name: str, **fields: Any) -> Variant:
    """A span variant: no link blocks unless ``fields`` ask for them (whatever the default)."""
    return Variant(name, SpanOptions(**{"link_blocks": 0, **fields}))


def _layout(name: str, **fields: Any) -> Variant:
    """The tokens of span variant ``fields``, read with full attention."""
    return Variant(name, _span(name, **fields).options, layout_only=True)


#: Every variant the benchmark knows, by name.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("stock"),
    Variant("routed", routed=True),
    _span("prefix"),
    _span("prefix/link", link_blocks=1),
    _span("prefix/link2", link_blocks=2),
    _span("prefix/link4", link_blocks=4),
    _span("prefix/link-all", link_blocks=-1),
    _span("prefix/pad-inside", pad="inside"),
    _span("prefix/pad-before", pad="before"),
    _span("prefix/marker", marker=True),
    _span("prefix/pad-space", pad_text=" "),
    _span("self", attend="self"),
    _span("self/link", attend="self", link_blocks=1),
    _span("self/marker", attend="self", marker=True),
    _layout("full@pad-after"),
    _layout("full@pad-inside", pad="inside"),
    _layout("full@pad-before", pad="before"),
    _layout("full@marker", marker=True),
    _layout("full@pad-space", pad_text=" "),
)}


@dataclass
class _Answers:
    correct: list[bool]
    facts: list[str]
    first: list[dict[int, float]]

    def __add__(self, other: _Answers) -> _Answers:
        """The answers of two question sets, one after the other."""
        return _Answers(self.correct + other.correct, self.facts + other.facts,
                        self.first + other.first)


#: The modules whose change can change a stock answer: the questions, how a query is built,
#: compiled and rendered by the model's chat template.
_STOCK_CODE = ("span_workflows.apps.bench.qa_set", "span_workflows.query.builders",
               "span_workflows.compiler.compile", "span_workflows.compiler.render")
#: ... and a span answer besides: the optimizer, the span options, the plan of engine steps,
#: the routing of the default engine and the patched vLLM (the plugin's package).
_SPAN_CODE = ("span_workflows.compiler.optimize", "span_workflows.query.span_options",
              "span_workflows.runtime.plan", "span_workflows.runtime.routing", "span_vllm")


def code_version(span: bool) -> str:
    """12 hex digits that change whenever the code that makes an answer of this benchmark can
    change: the sources of :data:`_STOCK_CODE` (and :data:`_SPAN_CODE` for a span answer), the
    prompt, the answer length and vLLM's version. Stored answers are keyed by it, so a change
    there is answered again and nothing else is."""
    import hashlib
    import importlib

    from span_workflows import build_info

    digest = hashlib.sha256(repr((SYSTEM, MAX_TOKENS, TOP_LOGPROBS,
                                  build_info.package_versions(("vllm",)))).encode())
    for name in (*_STOCK_CODE, *(_SPAN_CODE if span else ())):
        module = importlib.import_module(name)
        origin = Path(str(module.__file__))
        files = sorted(origin.parent.glob("*.py")) if origin.name == "__init__.py" else [origin]
        for path in files:
            digest.update(f"{name}/{path.name}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def answer(engine: Any, variant: Variant, questions: Sequence[Question], batch: int = 16,
           progress: Callable[[int], None] | None = None) -> _Answers:
    """Answer every question with ``variant``; greedy, :data:`MAX_TOKENS` tokens; on the
    engine's own model (:func:`own_weights`), never an adapter it routes span queries to,
    except for the ``routed`` variant, which is the engine's routing."""
    weights = own_weights(engine)
    texts: list[str] = []
    first: list[dict[int, float]] = []
    for chunk in _chunks(questions, batch):
        queries = [rag(SYSTEM, q.documents, q.question, max_tokens=MAX_TOKENS, temperature=0.0)
                   for q in chunk]
        if variant.layout_only:
            prompts = [engine.compile(q, span_options=variant.options).token_ids
                       for q in queries]
            outs = engine.complete_many(prompts, max_tokens=MAX_TOKENS,
                                        logprobs=TOP_LOGPROBS)
            texts += [o.texts[0] for o in outs]
            first += [o.first_logprobs for o in outs]
        else:
            if variant.routed:  # the router picks the weights and their options
                run: dict[str, Any] = {}
            elif variant.options is None:
                run = {"span_mode": False, "weights": weights}
            else:
                run = {"span_options": variant.options, "weights": weights}
            results = engine.execute_many(queries, logprobs=TOP_LOGPROBS, **run)
            texts += [r.text for r in results]
            first += [r.first_logprobs for r in results]
        if progress is not None:
            progress(len(chunk))
    return _Answers([is_correct(q.answer, t) for q, t in zip(questions, texts, strict=True)],
                    [q.fact for q in questions], first)


def own_weights(engine: Any) -> str | None:
    """The name of the model ``engine`` loaded (what a row's ``model`` says): the quality of
    one set of weights is measured, so span queries are not routed to an adapter."""
    return getattr(engine, "model_name", None)


def new_combinations(pool: Sequence[str], k: int, count: int, seed: int = 1
                     ) -> tuple[list[list[str]], list[list[str]]]:
    """``pool`` cut into the sets of ``k`` documents that cache it, and ``count`` new
    combinations of ``k`` of its documents, each set never asked before."""
    seen = [list(pool[i:i + k]) for i in range(0, len(pool) - k + 1, k)]
    known = {frozenset(s) for s in seen}
    rng = random.Random(seed)
    fresh: list[list[str]] = []
    while len(fresh) < count:
        pick = rng.sample(list(pool), k)
        if frozenset(pick) not in known:
            known.add(frozenset(pick))
            fresh.append(pick)
    return seen, fresh


def hit_ttft(engine: Any, options: SpanOptions | None, pool: Sequence[str], k: int,
             question: str, reps: int = 3, routed: bool = False) -> tuple[float, int]:
    """Median TTFT and engine steps of ``question`` over a new combination of ``k``
    documents of ``pool``, all cached by earlier queries (``pool`` asked ``k`` at a time);
    with ``options=None``, stock's on a fresh cache; on the engine's own model (``routed``:
    span mode on the weights and options the engine's router picks)."""
    weights = None if routed else own_weights(engine)
    times, steps = [], []
    seen, fresh = new_combinations(pool, k, reps)
    for combination in fresh:
        engine.reset_cache()
        if options is None and not routed:
            m = engine.stock(rag(SYSTEM, combination, question, max_tokens=1),
                             weights=weights).metrics
        else:
            for docs in seen:
                engine.execute(rag(SYSTEM, docs, question, max_tokens=1), span_options=options,
                               weights=weights)
            m = engine.execute(rag(SYSTEM, combination, question, max_tokens=1),
                               span_options=options, weights=weights).metrics
        times.append(m.ttft_s)
        steps.append(m.engine_steps)
    return statistics.median(times), int(statistics.median(steps))


class AnswerStore:
    """Answers of finished (variant, document count) runs in a JSON file, so a long run that
    stops (or one variant added later) resumes without answering anything twice. Entries are
    keyed by variant, document count, question count, seed and model; the span-hit TTFTs too
    (by variant, pool, document count, repetitions and model: the 16 × 440-token pool is the
    same for every document size, so a run of another size reuses it). ``read`` and
    ``measured`` count the entries this run found stored and the ones it computed."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.read = 0
        self.measured_count = 0
        if path is not None and path.exists():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                from span_workflows.errors import SpanQueryError

                raise SpanQueryError("--answers", f"{path} is not an answers file ({exc})"
                                     ) from None

    @staticmethod
    def key(variant: str, n_docs: int, count: int, seed: int, model: str,
            size: str = "short", code: str = "") -> str:
        """The entry name of one run (a linked variant's names its link semantics: links
        that read the earlier spans as cached, ``batched``; ``code``: the
        :func:`code_version` that answered it)."""
        key = f"{variant}|docs={n_docs}|questions={count}|seed={seed}|model={model}"
        options = VARIANTS[variant].options if variant in VARIANTS else None
        if options is not None and options.link_blocks and not VARIANTS[variant].layout_only:
            key += "|links=batched"
        key = key if size == "short" else f"{key}|size={size}"
        return f"{key}|code={code}" if code else key

    def get(self, key: str) -> _Answers | None:
        """The stored answers of ``key``, if any."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.read += 1
        first = [{int(t): float(lp) for t, lp in d.items()} for d in entry["first"]]
        return _Answers(list(entry["correct"]), list(entry["facts"]), first)

    def put(self, key: str, answers: _Answers) -> None:
        """Store (and, with a path, save) the answers of ``key``."""
        self.measured_count += 1
        self._save(key, {"correct": answers.correct, "facts": answers.facts,
                         "first": [{str(t): lp for t, lp in d.items()}
                                   for d in answers.first]})

    @staticmethod
    def ttft_key(variant: str, pool: str, k: int, reps: int, model: str,
                 code: str = "") -> str:
        """The entry name of one span-hit TTFT measurement (``code``: the
        :func:`code_version` that timed it: a change of the plan, e.g. links moved into the
        answer's step, is timed again)."""
        key = f"ttft|{variant}|pool={pool}|docs={k}|reps={reps}|model={model}"
        return f"{key}|code={code}" if code else key

    @staticmethod
    def perplexity_key(passages: int, model: str) -> str:
        """The entry name of one model's held-out perplexity (``model``: its directory's
        name, checksum included)."""
        return f"perplexity|passages={passages}|model={model}"

    def timed(self, key: str, measure: Callable[[], tuple[float, int]]) -> tuple[float, int]:
        """The stored (TTFT, engine steps) of ``key``, or ``measure()``'s, then stored."""
        entry = self._stored_or_measured(
            key, lambda: dict(zip(("ttft_s", "steps"), measure(), strict=True)))
        return float(entry["ttft_s"]), int(entry["steps"])

    def measured(self, key: str, measure: Callable[[], float]) -> float:
        """The stored value of ``key`` (a measurement of one model, such as its held-out
        perplexity), or ``measure()``'s, then stored."""
        return float(self._stored_or_measured(key, lambda: {"value": measure()})["value"])

    def _stored_or_measured(self, key: str, measure: Callable[[], dict[str, Any]]
                            ) -> dict[str, Any]:
        entry = self.entries.get(key)
        if entry is None:
            entry = measure()
            self.measured_count += 1
            self._save(key, entry)
        else:
            self.read += 1
        return entry

    def _save(self, key: str, entry: dict[str, Any]) -> None:
        self.entries[key] = entry
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.entries))


def bench_quality(engine: Any, variant_names: Sequence[str], docs_counts: Sequence[int],
                  count: int, *, seed: int = 0, ttft_docs: int = 16, ttft_doc_tokens: int = 440,
                  reps: int = 3, progress: bool = True, store: AnswerStore | None = None,
                  sizes: Sequence[str] = ("short",), ttft_own: bool = True,
                  seeds: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One row per (document size, document count, variant); see the module docstring.
    ``seeds`` (default: ``seed`` alone) are question seeds: a row pools ``count`` questions
    of each, the same questions for every variant, so its paired interval is over all of
    them.
    ``stock`` is always run (the reference of ``kl_first_token``, ``delta_vs_stock`` and
    ``speedup_hit``), and so is the ``full@`` variant of each span variant's layout (the
    reference of ``kl_vs_layout``) when ``variant_names`` lists it. Answers found in ``store``
    are not computed again; ``ttft_docs=0`` skips the TTFT columns (``None``), ``ttft_own=False``
    the ``…_own`` ones (the hit at 16 × 440 tokens only)."""
    from tqdm.auto import tqdm

    from span_workflows.apps.demo.corpus import documents

    for size in sizes:
        if size not in DOC_SIZES:
            from span_workflows.errors import SpanQueryError

            raise SpanQueryError("--sizes", f"unknown size {size!r} (known: "
                                            f"{', '.join(DOC_SIZES)})")
    store = store or AnswerStore(None)
    seeds = list(seeds) if seeds else [seed]
    model = Path(str(getattr(engine, "model_dir", "model"))).name
    codes = {span: code_version(span) for span in (False, True)}
    names = ["stock", *dict.fromkeys(n for n in variant_names if n != "stock")]
    variants = [_variant(n) for n in names]

    def keyed(variant: Variant) -> str:
        """The model part of a stored entry's name: the routed variant's also names the
        adapters the engine routes to, by content digest."""
        if not variant.routed:
            return model
        adapters = getattr(getattr(engine, "router", None), "adapters", {})
        return "+".join([model, *(f"{name}-{a.digest[:16]}" for name, a in adapters.items())])
    bar = tqdm(total=len(variants) * len(docs_counts) * len(sizes) * len(seeds) * count,
               desc="quality", unit="q", disable=not progress)

    def count_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    rows: list[dict[str, Any]] = []
    for size in sizes:
        for n_docs in docs_counts:
            answers: dict[str, _Answers] = {}
            targets: list[int] = []  # where each question's answer stands, seeds in turn
            for question_seed in seeds:
                questions = make_questions(count, n_docs, question_seed, size=size,
                                           count_tokens=count_tokens)
                targets += [q.target for q in questions]
                for variant in variants:
                    key = store.key(variant.name, n_docs, count, question_seed, keyed(variant),
                                    size, code=codes[variant.options is not None
                                                     or variant.routed])
                    found = store.get(key)
                    if found is None:
                        bar.set_postfix_str(f"{variant.name}, {size}, {n_docs} docs, "
                                            f"seed {question_seed}")
                        engine.reset_cache()
                        found = answer(engine, variant, questions, progress=bar.update)
                        store.put(key, found)
                    else:
                        bar.update(count)
                    earlier = answers.get(variant.name)
                    answers[variant.name] = found if earlier is None else earlier + found
            for variant in variants:
                layout = (answers.get(_layout_name(variant.options)) if variant.is_span
                          else None)
                row = _row(variant, n_docs, answers[variant.name], answers["stock"], layout)
                row.update(by_position(answers[variant.name].correct, targets, n_docs))
                rows.append({"model": _model_label(model), "size": size, "seeds": seeds,
                             **row})
    bar.close()
    if ttft_docs < 1:  # answers only
        for row in rows:
            for name in HIT_COLUMNS:
                row[name] = None
        return rows
    # Span-hit TTFT of a new combination of cached documents: 16 × 440 tokens (the headline,
    # as in bench rag) and 16 documents of each size of this run's questions.
    pools = {"440": documents(engine.tokenizer, 3 * ttft_docs, ttft_doc_tokens)}
    for size in sizes if ttft_own else ():
        pools[size] = [q.documents[0] for q in make_questions(
            3 * ttft_docs, 1, seeds[0], size=size, count_tokens=count_tokens)]
    question = "Which module do the documents describe first?"
    timed: dict[tuple[str, str], tuple[float, int]] = {}
    for pool_name, pool in pools.items():
        for v in variants:
            if v.is_span or v.name == "stock":
                key = store.ttft_key(v.name, pool_name if pool_name == "440" else
                                     f"{pool_name}-seed{seeds[0]}", ttft_docs, reps, keyed(v),
                                     code=codes[v.options is not None or v.routed])
                timed[(v.name, pool_name)] = store.timed(key, lambda v=v, pool=pool: hit_ttft(
                    engine, v.options, pool, ttft_docs, question, reps, routed=v.routed))
    for row in rows:
        for suffix, pool_name in (("", "440"), ("_own", row["size"])):
            if ("stock", pool_name) not in timed:  # not measured (ttft_own=False)
                for name in (f"ttft_hit{suffix}_s", f"speedup_hit{suffix}",
                             f"steps_hit{suffix}"):
                    row[name] = None
                continue
            hit = timed.get((row["variant"], pool_name))
            stock_ttft = timed[("stock", pool_name)][0]
            row[f"ttft_hit{suffix}_s"] = hit[0] if hit else None
            row[f"speedup_hit{suffix}"] = stock_ttft / hit[0] if hit else None
            row[f"steps_hit{suffix}"] = hit[1] if hit else None
    return rows


#: The span-hit columns of a row: at 16 × 440 tokens, and at 16 documents of the row's size.
HIT_COLUMNS = ("ttft_hit_s", "speedup_hit", "steps_hit", "ttft_hit_own_s", "speedup_hit_own",
               "steps_hit_own")


def _model_label(model_dir_name: str) -> str:
    """A model's name without the checksum suffix of its cache directory."""
    head, _, tail = model_dir_name.rpartition("-")
    return head if head and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail) \
        else model_dir_name


#: What ``bench quality`` runs unless ``--variants`` says otherwise: the link frontier.
DEFAULT_VARIANTS = ("stock", "prefix", "prefix/link", "prefix/link2", "prefix/link4",
                    "prefix/link-all", "full@pad-after")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (accuracy with its interval, per fact kind, KL, TTFT)."""
    def pct(value: float | None) -> str:
        return "–" if value is None or math.isnan(value) else f"{100 * value:.1f}"

    def num(value: float | None, digits: int = 3) -> str:
        return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"

    def signed(value: float | None) -> str:
        return "–" if value is None or math.isnan(value) else f"{100 * value:+.1f}"

    kinds = list(QUESTION_KINDS)
    head = ["model", "size", "variant", "docs", "questions", "accuracy %", "95 % CI",
            "Δ vs stock", "Δ 95 % CI", *[f"{k} %" for k in kinds],
            "first / middle / last %", "KL vs stock",
            "KL vs layout", "hit TTFT (s)", "hit steps", "speedup"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        speed = r.get("speedup_hit")
        steps = r.get("steps_hit")
        cells = [r.get("model", ""), r.get("size", "short"), r["variant"], str(r["n_docs"]),
                 str(r["questions"]), pct(r["accuracy"]),
                 f"{pct(r['ci_low'])}–{pct(r['ci_high'])}", signed(r.get("delta_vs_stock")),
                 f"{signed(r.get('delta_low'))}…{signed(r.get('delta_high'))}",
                 *[pct(r[f"acc_{k}"]) for k in kinds],
                 " / ".join(pct(r.get(f"acc_{p}")) for p in ("first", "middle", "last")),
                 num(r["kl_first_token"]),
                 num(r["kl_vs_layout"]), num(r.get("ttft_hit_s"), 4),
                 "–" if steps is None else str(steps),
                 "–" if speed is None else f"{speed:.1f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_quality(rows: list[dict[str, Any]], path: Path) -> None:
    """The link frontier: accuracy (95 % intervals) against the span-hit speedup over stock,
    one panel per document size, a point per variant, document count and model, stock at 1×;
    saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r.get("size", "short") for r in rows))
    models = list(dict.fromkeys(r.get("model", "") for r in rows))
    counts = sorted({r["n_docs"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.2 * len(sizes), 4.8), squeeze=False)
    markers = "osD^v"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, size in zip(axes[0], sizes, strict=True):
        for m, model in enumerate(models):
            for c, n_docs in enumerate(counts):
                picked = [r for r in rows if r.get("size", "short") == size
                          and r.get("model", "") == model and r["n_docs"] == n_docs
                          and r.get("speedup_hit")]
                if not picked:
                    continue
                xs = [r["speedup_hit"] for r in picked]
                ys = [100 * r["accuracy"] for r in picked]
                err = [[100 * (r["accuracy"] - r["ci_low"]) for r in picked],
                       [100 * (r["ci_high"] - r["accuracy"]) for r in picked]]
                ax.errorbar(xs, ys, yerr=err, fmt=markers[c % len(markers)], capsize=3,
                            color=colors[m % len(colors)],
                            label=f"{model or 'model'}, {n_docs} docs")
                family = sorted((r for r in picked if r["variant"].startswith("prefix")),
                                key=lambda r: r["speedup_hit"])
                ax.plot([r["speedup_hit"] for r in family],
                        [100 * r["accuracy"] for r in family], "-", alpha=0.4,
                        color=colors[m % len(colors)])
                for r in picked:
                    ax.annotate(r["variant"].replace("prefix/", ""),
                                (r["speedup_hit"], 100 * r["accuracy"]), fontsize=7,
                                xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("span-hit speedup over stock (16 × 440 tokens, new combination)")
        ax.set_ylabel("answers correct (%)")
        ax.set_title(f"{size} documents")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("the link frontier: accuracy vs span-hit speed (invented-fact RAG, greedy)")
    save_figure(fig, path)


def run_quality(args: Any) -> int:
    """``span-workflows bench quality``: run, print the table, write what was asked for."""
    from span_workflows.apps.bench.report import print_table
    from span_workflows.runtime.engine import Engine

    names = list(args.variants or DEFAULT_VARIANTS)
    for name in names:
        _variant(name)  # unknown names fail before the engine starts
    if args.questions < 1:
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("--questions", "must be at least 1")
    store = AnswerStore(args.answers)
    engine = Engine(args.model, kv_cache_gib=4, progress=True)
    engine_dir = engine.model_dir
    try:
        rows = bench_quality(engine, names, args.docs or [4, 8], args.questions,
                             seed=args.seed, seeds=args.seeds, reps=args.reps, store=store,
                             sizes=args.sizes or ["short", "long"],
                             ttft_docs=0 if args.no_ttft else 16,
                             ttft_own=not args.no_ttft_own)
    finally:
        engine.close()
    if args.perplexity > 0:  # did tuning make the model forget plain text?
        from span_workflows.apps.bench.perplexity import heldout_passages, perplexity

        value = store.measured(
            store.perplexity_key(args.perplexity, Path(str(engine_dir)).name),
            lambda: perplexity(engine_dir, heldout_passages(args.perplexity)))
        for row in rows:
            row["perplexity"] = value
    from span_workflows.apps.bench.provenance import stamp

    rows = stamp(rows, engine, reps=args.reps)  # this run's rows; merged ones keep theirs
    for row in rows:  # how much of the run came from the answers file
        row["entries_read"], row["entries_measured"] = store.read, store.measured_count
    if args.merge_json and args.merge_json.exists():  # rows of other runs, kept
        rows = merge_rows(json.loads(args.merge_json.read_text()), rows)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(rows))
    if args.plot:
        plot_quality(rows, args.plot)
    if args.choose_default or args.write_default:
        from span_workflows.apps.bench.frontier import choose_default, write_default

        choice = choose_default(rows, _model_label(Path(str(engine_dir)).name))
        print(choice.describe())
        if args.write_default:
            print(f"written to {write_default(args.write_default, choice)}")
    return 0


def merge_rows(previous: list[dict[str, Any]], rows: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """``previous`` rows (an earlier run's JSON) with this run's ``rows`` in place of those
    of the same model, document size, document count and variant, which come last. A
    previous row of a model this run measured on other weights (another checkpoint; for
    ``routed`` rows, other adapters too) is dropped: one table, one set of weights a model."""
    def ident(row: dict[str, Any]) -> tuple[Any, ...]:
        return row.get("model"), row.get("size", "short"), row["n_docs"], row["variant"]

    def weights(row: dict[str, Any]) -> tuple[Any, ...]:
        adapters = row.get("adapters") if row["variant"] == "routed" else None
        return row.get("model_dir"), json.dumps(adapters, sort_keys=True)

    ours = {ident(r) for r in rows}
    measured = {(r.get("model"), r["variant"] == "routed"): weights(r) for r in rows}

    def current(row: dict[str, Any]) -> bool:
        now = measured.get((row.get("model"), row["variant"] == "routed"))
        return now is None or now == weights(row)

    return [r for r in previous if ident(r) not in ours and current(r)] + rows


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
    if options.pad_text == " ":
        return "full@pad-space"
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
    row["delta_vs_stock"], row["delta_low"], row["delta_high"] = paired_delta(
        own.correct, stock.correct)
    for fact in QUESTION_KINDS:
        picked = [c for c, f in zip(own.correct, own.facts, strict=True) if f == fact]
        row[f"acc_{fact}"] = sum(picked) / len(picked) if picked else float("nan")
    row["kl_first_token"] = _mean_kl(stock.first, own.first)
    row["kl_vs_layout"] = _mean_kl(layout.first, own.first) if layout is not None else None
    return row


def by_position(correct: Sequence[bool], targets: Sequence[int], n_docs: int
                ) -> dict[str, float | None]:
    """Accuracy by where the answering document stands in the prompt: ``acc_first``,
    ``acc_middle`` (any other place) and ``acc_last``, with the number of questions of each
    (``n_first``...). Stock prompts favour the first and the last document; a span mode that
    loses answers may lose them there. ``None`` where no question falls."""
    places = {"first": lambda t: t == 0, "last": lambda t: t == n_docs - 1,
              "middle": lambda t: 0 < t < n_docs - 1}
    out: dict[str, float | None] = {}
    for name, holds in places.items():
        picked = [c for c, t in zip(correct, targets, strict=True) if holds(t)]
        out[f"acc_{name}"] = sum(picked) / len(picked) if picked else None
        out[f"n_{name}"] = len(picked)
    return out


def paired_delta(own: Sequence[bool], reference: Sequence[bool], z: float = 1.96
                 ) -> tuple[float, float, float]:
    """Accuracy of ``own`` minus ``reference`` on the same questions, with the 95 % interval
    of a paired difference (normal approximation over the per-question differences)."""
    diffs = [int(a) - int(b) for a, b in zip(own, reference, strict=True)]
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, -1.0, 1.0
    half = z * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, max(-1.0, mean - half), min(1.0, mean + half)


def _mean_kl(ref: list[dict[int, float]], other: list[dict[int, float]]) -> float:
    return mean_kl(zip(ref, other, strict=True))


__all__ = ["DEFAULT_VARIANTS", "MAX_TOKENS", "SYSTEM", "VARIANTS", "AnswerStore", "Variant",
           "answer", "bench_quality", "by_position", "code_version", "hit_ttft", "kl_top",
           "markdown_table", "merge_rows", "new_combinations", "paired_delta", "plot_quality",
           "run_quality"]
