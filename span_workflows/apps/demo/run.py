"""``span-workflows demo``: RAG over the Python stdlib docs, span queries vs stock vLLM.

The span queries run on the span-ready adapter, served as LoRA beside the base; stock runs
on the base (:mod:`span_workflows.runtime.routing`); the table says which weights answered.

For each question the demo retrieves ``k`` passages from the built-in stdlib index, answers with
a span query ``rag(SYSTEM, docs, question)`` and, for comparison, with the same query as a plain
chat prompt (stock mode). It then asks the question again with the passages in reversed order:
the span run finds every document's KV cache wherever it now sits (position-independent reuse),
while stock prefix caching only matches up to the first document that moved.

The index cuts the documentation into passages of ``PASSAGE_BLOCKS`` of the engine's KV blocks
(:mod:`span_workflows.runtime.chunking`), so the span queries compute almost no padding, and both
modes first answer two warm-up questions over filler passages with the demo's system prompt,
as a running service has: the first retrieval of each question is then every document a miss,
the system prompt seen.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from span_workflows.apps.demo.corpus import stdlib_index
from span_workflows.query.builders import fragment, rag
from span_workflows.runtime.retrieval import Passage, VectorIndex

DEFAULT_QUESTIONS: tuple[str, ...] = (
    "How do I serialize a Python object to a JSON string?",
    "How can I read a CSV file row by row?",
    "How do I get the current date and time?",
)

SYSTEM = (
    "You are a helpful Python assistant. Answer the question in one or two sentences, "
    "using the documentation excerpts."
)

MAX_TOKENS = 48
#: KV blocks per passage of the demo's index: passages cut to end near a block boundary, so
#: the span queries compute almost no padding (:mod:`span_workflows.runtime.chunking`).
PASSAGE_BLOCKS = 5
ORDERS = ("retrieved", "reversed")


def run_demo(
    engine: Any = None,
    questions: Sequence[str] = DEFAULT_QUESTIONS,
    k: int = 3,
    console: Callable[[str], Any] | Any = print,
    *,
    index: VectorIndex | None = None,
    max_tokens: int = MAX_TOKENS,
) -> list[dict[str, Any]]:
    """Run the demo and print its report; return one row per (question, document order).

    ``engine``: an :class:`~span_workflows.runtime.engine.Engine` (one is started, and closed at the
    end, when ``None``). ``console``: a print-like callable, or a ``rich`` Console.
    ``index``: the retriever (default: :func:`stdlib_index` in passages of ``PASSAGE_BLOCKS``
    KV blocks of the engine, built once and cached).

    Each row holds ``question``, ``order`` (``"retrieved"`` or ``"reversed"``), ``answer`` (span),
    ``stock_answer``, ``sources``, ``span`` and ``stock`` (metrics dicts) and the flat keys
    ``{span,stock}_{ttft_s,prompt_tokens,cached_tokens,generated_tokens,computed_tokens}``
    (computed: prompt tokens not read from the cache, prepares included), ``weights`` and
    ``stock_weights`` (which weights answered: the span-ready adapter or the base) and
    ``ttft_ratio`` (span TTFT / stock TTFT).
    """
    say = _sayer(console)
    questions = list(questions)
    own = engine is None
    if own:
        import os

        from span_workflows.runtime.engine import Engine

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        say("Starting the embedded engine (SmolLM2-135M-Instruct on vLLM)…")
        engine = Engine(progress=True)
    try:
        if index is None:
            say("Loading the stdlib documentation index (built once, then cached)…")
            index = stdlib_index(progress=True, chunker=engine.chunker(PASSAGE_BLOCKS))
        retrieved = [(q, index.search(q, k)) for q in questions]
        _warm_up(engine, k)
        rows = []
        for question, passages in retrieved:
            for order in ORDERS:
                docs = passages if order == "retrieved" else list(reversed(passages))
                rows.append(_ask(engine, question, docs, order, max_tokens))
    finally:
        if own:
            engine.close()
    _report(rows, say, console)
    return rows


def _warm_up(engine: Any, k: int) -> None:
    """Two questions over ``k`` passages of filler text (not from the corpus) in each mode, as
    a running service has answered before: the one-time costs of an engine's first large
    prompts are paid here, not by the first measured run, and the system prompt is seen;
    every retrieved passage is still a miss the first time it is asked for."""
    for round_ in range(2):
        filler = "The quick brown fox jumps over the lazy dog. " * 12
        docs = [fragment(f"Warm-up passage {round_}.{i}: {filler}") for i in range(k)]
        query = rag(SYSTEM, docs, "Hi", max_tokens=1, temperature=0.0)
        engine.execute(query)
        engine.stock(query)


def _ask(engine: Any, question: str, docs: Sequence[Passage], order: str,
         max_tokens: int) -> dict[str, Any]:
    query = rag(
        SYSTEM, [fragment(p.text, source=p.source) for p in docs], question,
        max_tokens=max_tokens, temperature=0.0,
    )
    span = engine.execute(query)
    stock = engine.stock(query)
    row: dict[str, Any] = {
        "question": question,
        "order": order,
        "answer": span.text.strip(),
        "stock_answer": stock.text.strip(),
        "sources": [p.source for p in docs],
        "span": span.metrics.to_dict(),
        "stock": stock.metrics.to_dict(),
    }
    for mode, result in (("span", span), ("stock", stock)):
        m = result.metrics
        row[f"{mode}_ttft_s"] = m.ttft_s
        row[f"{mode}_prompt_tokens"] = m.prompt_tokens
        row[f"{mode}_cached_tokens"] = m.cached_tokens
        row[f"{mode}_generated_tokens"] = m.generated_tokens
        row[f"{mode}_computed_tokens"] = m.computed_tokens
    row["weights"] = span.metrics.weights
    row["stock_weights"] = stock.metrics.weights
    row["same_as_stock"] = row["answer"] == row["stock_answer"]
    row["ttft_ratio"] = span.metrics.ttft_s / stock.metrics.ttft_s if stock.metrics.ttft_s else 0.0
    return row


# -- the report ----------------------------------------------------------------------------------
def summary(rows: Sequence[dict[str, Any]]) -> str:
    """The closing line: total cached tokens, median TTFT ratios and how many span answers
    are word for word stock's."""
    span_cached = sum(r["span_cached_tokens"] for r in rows)
    stock_cached = sum(r["stock_cached_tokens"] for r in rows)
    span_prompt = sum(r["span_prompt_tokens"] for r in rows)
    stock_prompt = sum(r["stock_prompt_tokens"] for r in rows)
    ratios = [r["ttft_ratio"] for r in rows if r["ttft_ratio"] > 0]
    reordered = [r["ttft_ratio"] for r in rows if r["order"] == "reversed" and r["ttft_ratio"] > 0]
    median = statistics.median(ratios) if ratios else float("nan")
    median_re = statistics.median(reordered) if reordered else float("nan")
    same = sum(bool(r["same_as_stock"]) for r in rows)
    return (
        f"Cached tokens: span {span_cached}/{span_prompt} vs stock {stock_cached}/{stock_prompt}."
        f" Median TTFT span/stock: {median:.2f} (reordered runs: {median_re:.2f})."
        f" Span answers equal to stock's: {same} of {len(rows)}."
    )


def _sayer(console: Any) -> Callable[[str], Any]:
    if callable(console):
        return console
    return console.print


def _report(rows: Sequence[dict[str, Any]], say: Callable[[str], Any], console: Any) -> None:
    try:
        import rich  # noqa: F401
    except ImportError:
        say(_plain_table(rows))
        say(summary(rows))
        return
    from rich.console import Console

    table = _rich_table(rows)
    if console is print:
        screen = Console()
        if not screen.is_terminal:
            screen = Console(width=140)
        screen.print(table)
    elif not callable(console) and hasattr(console, "print"):
        console.print(table)
    else:
        import io

        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None).print(table)
        say(buffer.getvalue().rstrip("\n"))
    say(summary(rows))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _rich_table(rows: Sequence[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="RAG over the Python stdlib docs: span queries vs stock vLLM",
                  caption="reversed = the same question, retrieved passages in reverse order; "
                          "span TTFT includes its prepare requests",
                  show_lines=True)
    table.add_column("Question", ratio=2)
    table.add_column("Docs")
    table.add_column("Answer (span query)", ratio=4)
    table.add_column("Sources", ratio=2)
    table.add_column("Same as\nstock", no_wrap=True)
    table.add_column("Weights\nspan / stock", ratio=2)
    table.add_column("TTFT ms\nspan / stock", justify="right", no_wrap=True)
    table.add_column("Cached tokens\nspan / stock", justify="right", no_wrap=True)
    table.add_column("Computed\ntokens", justify="right", no_wrap=True)
    previous = None
    for r in rows:
        table.add_row(
            "" if r["question"] == previous else r["question"], r["order"],
            _clip(r["answer"], 180) or "(empty)",
            "\n".join(_clip(src, 36) for src in r["sources"]),
            _same(r),
            f"{_short_weights(r['weights'])} / {_short_weights(r['stock_weights'])}",
            f"{_ms(r['span_ttft_s'])} / {_ms(r['stock_ttft_s'])}",
            f"{r['span_cached_tokens']} / {r['stock_cached_tokens']}",
            f"{r['span_computed_tokens']} / {r['stock_computed_tokens']}",
        )
        previous = r["question"]
    return table


def _same(row: dict[str, Any]) -> str:
    """Whether the span answer is word for word the stock answer (on their own weights)."""
    return "yes" if row["same_as_stock"] else "no"


def _short_weights(name: str) -> str:
    """A weights name as the table shows it: the span-ready adapter as "adapter"."""
    from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME

    return {SPAN_MODEL_NAME: "adapter", BASE_MODEL_NAME: "base"}.get(name, name or "?")


def _plain_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ("question", "order", "same as stock", "TTFT ms span/stock", "cached span/stock",
              "weights span/stock")
    body = [
        (r["question"], r["order"], _same(r), f"{_ms(r['span_ttft_s'])} / {_ms(r['stock_ttft_s'])}",
         f"{r['span_cached_tokens']} / {r['stock_cached_tokens']}",
         f"{_short_weights(r['weights'])} / {_short_weights(r['stock_weights'])}")
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(header, widths, strict=True))]
    for r, cells in zip(rows, body, strict=True):
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(cells, widths, strict=True)))
        lines.append(f"    answer:  {_clip(r['answer'], 180) or '(empty)'}")
        lines.append(f"    sources: {', '.join(r['sources'])}")
    return "\n".join(lines)


__all__ = ["DEFAULT_QUESTIONS", "SYSTEM", "run_demo", "summary"]
