"""How a judge reads its drafts (``align``), measured: ``bench nested`` and ``bench needle``.

``bench nested`` (:func:`bench_nested_align`) — a judge over ``n`` greedy drafts (different
prompts, so the drafts differ and every alignment sees the same ones), for each alignment and
for stock (the drafts pasted as chat turns, vLLM's prefix caching): per row

* ``cached_share`` — draft tokens the judge read from the drafts' own KV / draft tokens
  (``Metrics.nested_cached_share``: neither cropped nor computed again), and ``lost_tokens``
  per draft (cropped away);
* ``judge_ttft_s`` — from the end of the last draft to the judge's first token (its prepares
  included), and ``speedup`` = stock's / this; ``judge_steps`` the engine steps of that part;
* ``fill_tokens`` — mean tokens each draft generated after its text to fill its block,
  ``draft_steps`` the engine steps until the last draft ended, ``drafts_s`` the time until
  then (the fill's cost is the difference to ``crop``'s); ``total_ttft_s`` — from the query's
  submission to the judge's first token (drafts and judge);
* for ``bias``, ``same_text`` — the share of drafts whose text equals the unbiased (``pad``)
  draft's, and ``length_change`` — the mean absolute change of their length, in tokens.

``bench needle`` (:func:`bench_needle`) — the paper's needle benchmark: each judge reads
``drafts`` nested drafts; one of them holds the sentence "The secret name is X." at the start,
the middle or the end of about 10, 100 or 1000 characters of hay, and the judge must quote it.
As in the paper, the generators are told what to write: each draft is a copy task whose prompt
holds its text, and whose output is constrained to that text (a one-value JSON schema, so the
copy is exact and the same for every alignment, and its tokens are the model's own: it copies
from its prompt). Crop cuts a needle that sits in a draft's partial last block out of the
copy (``needle_cut``: the share of trials where the needle draft's copy of the needle sentence
is not whole in the judge's prompt); the prompt's own copy stays (a draft's prompt is part of
what the judge reads, and no alignment cuts it). Exact match of the name, with 95 % Wilson
intervals; ``stock`` is the same judge over the same drafts as chat turns (full attention,
nothing cut). ``bias`` equals ``pad`` here by construction (the grammar allows the end token
only after the text), so it is not run.

A needle in a draft's output *only* needs an output the model cannot copy: constrained to a
text it has not seen, SmolLM2-135M writes it in single characters (" s" "ec" "re" "t") and
every span judge then reads it wrong; measured once, 0 of 6 with ``pad`` and ``crop`` against
3 of 6 for stock, which reads the text re-tokenized.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from span_workflows.apps.bench.locality import HAY, NAMES, NEUTRAL, exact_match, needle_sentence
from span_workflows.apps.bench.report import save_figure, wilson
from span_workflows.query.builders import cross, g, plus, system, user
from span_workflows.query.ir import Generate
from span_workflows.query.span_options import ALIGN_CHOICES, SpanOptions

TOPICS = (
    "the sea", "a fox", "a lighthouse", "winter", "a bakery", "a river", "the moon", "a train",
    "a garden", "a violin", "a desert", "a library", "a storm", "a bridge", "a kite", "a forest",
    "a harbour", "a clock", "a market", "a glacier", "a festival", "a mountain", "a candle",
    "an island", "a carpenter", "a comet", "a village", "a waterfall", "a teapot", "a meadow",
    "a castle", "a ferry",
)
JUDGE_SYSTEM = "You judge short drafts."
JUDGE_PROMPT = "Which draft is best? Answer with its number."
NEEDLE_SYSTEM = "You read texts and find the secret name hidden in one of them."
NEEDLE_JUDGE = "Quote the one sentence above that says what the secret name is."
#: Every draft's prompt: the text to copy.
COPY_PROMPT = "Repeat this text exactly:\n\n{text}"
POSITIONS = ("start", "middle", "end")


def nested_query(n: int, rep: int, max_tokens: int, align: str | None = None) -> Generate:
    """A judge over ``n`` greedy drafts on different topics (variant ``rep``)."""
    drafts = [g(user(f"Write two sentences about {TOPICS[i % len(TOPICS)]} "
                     f"(variant {rep}.{i // len(TOPICS)})."),
                max_tokens=max_tokens, temperature=0.0) for i in range(n)]
    return g(cross(system(JUDGE_SYSTEM), plus(*drafts), user(JUDGE_PROMPT)), max_tokens=4,
             temperature=0.0, align=align)


def _drafts(result: Any) -> list[Any]:
    return [result.nested[k] for k in sorted(result.nested)]


def _judge_after_drafts(result: Any) -> float:
    """Seconds from the end of the last draft to the judge's first token."""
    drafts = _drafts(result)
    return result.metrics.ttft_s - max((d.metrics.latency_s for d in drafts), default=0.0)


def bench_nested_align(engine: Any, fanouts: Sequence[int], reps: int,
                       aligns: Sequence[str] = ALIGN_CHOICES, max_tokens: int = 64,
                       progress: bool = True) -> list[dict[str, Any]]:
    """One row per (fan-out, alignment), and one per fan-out for stock; see the module
    docstring. Every run starts from an empty cache."""
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    med = statistics.median
    for n in fanouts:
        runs: dict[str, list[Any]] = {a: [] for a in ("stock", *aligns)}
        for rep in tqdm(range(reps), desc=f"nested n={n}", disable=not progress):
            q = nested_query(n, rep, max_tokens)
            engine.reset_cache()
            runs["stock"].append(engine.stock(q))
            for align in aligns:
                engine.reset_cache()
                runs[align].append(engine.execute(q, span_options=SpanOptions(
                    **{**engine.span_options.as_dict(), "align": align})))
        stock_ttft = med(_judge_after_drafts(r) for r in runs["stock"])
        for name, results in runs.items():
            drafts = [d for r in results for d in _drafts(r)]
            ttft = med(_judge_after_drafts(r) for r in results)
            row: dict[str, Any] = {
                "fanout": n, "align": name, "judge_ttft_s": ttft,
                "speedup": stock_ttft / ttft if ttft else 0.0,
                "judge_steps": int(med(r.metrics.final_steps for r in results)),
                "cached_share": (1.0 if name == "stock" else
                                 med(r.metrics.nested_cached_share for r in results)),
                "lost_tokens": statistics.fmean(r.metrics.nested_lost_tokens / n
                                                for r in results),
                "fill_tokens": statistics.fmean(d.metrics.fill_tokens for d in drafts),
                "draft_steps": int(med(max(d.steps_to_end for d in _drafts(r))
                                       for r in results)),
                "drafts_s": med(max(d.metrics.latency_s for d in _drafts(r)) for r in results),
                "total_ttft_s": med(r.metrics.ttft_s for r in results),
                "draft_tokens": statistics.fmean(len(d.token_ids) for d in drafts),
            }
            if name == "bias" and "pad" in runs:
                pairs = [(b, p) for rb, rp in zip(results, runs["pad"], strict=True)
                         for b, p in zip(_drafts(rb), _drafts(rp), strict=True)]
                row["same_text"] = sum(b.text == p.text for b, p in pairs) / len(pairs)
                row["length_change"] = statistics.fmean(
                    abs(len(b.token_ids) - len(p.token_ids)) for b, p in pairs)
            rows.append(row)
    crop = {r["fanout"]: r for r in rows if r["align"] == "crop"}
    for row in rows:
        base = crop.get(row["fanout"])
        if base is not None:
            row["extra_draft_steps"] = row["draft_steps"] - base["draft_steps"]
            row["extra_drafts_s"] = row["drafts_s"] - base["drafts_s"]
            row["speedup_vs_crop"] = row["speedup"] / base["speedup"] if base["speedup"] else 0
    return rows


def needle_passage(rng: random.Random, hay_chars: int, sentence: str, position: str) -> str:
    """About ``hay_chars`` characters of hay (whole sentences, at least one) with ``sentence``
    at ``position``; empty ``sentence``: the hay alone."""
    hay: list[str] = []
    while not hay or sum(len(s) + 1 for s in hay) < hay_chars:
        hay.append(rng.choice(HAY))
    at = {"start": 0, "middle": len(hay) // 2, "end": len(hay)}[position]
    return " ".join(hay[:at] + ([sentence] if sentence else []) + hay[at:])


def needle_trial(rng: random.Random, hay_chars: int, position: str,
                 drafts: int = 2) -> tuple[Generate, str]:
    """One judge over ``drafts`` copy-task drafts, one of which copies the needle sentence
    (each output is constrained to its prompt's text)."""
    name = rng.choice(NAMES)
    needle_at = rng.randrange(drafts)
    inner = []
    for i in range(drafts):
        sentence = needle_sentence(name) if i == needle_at else NEUTRAL
        text = needle_passage(rng, hay_chars, sentence, position)
        inner.append(g(user(COPY_PROMPT.format(text=text)), max_tokens=len(text) + 16,
                       temperature=0.0, json_schema={"type": "string", "enum": [text]}))
    query = g(cross(system(NEEDLE_SYSTEM), plus(*inner), user(NEEDLE_JUDGE)), max_tokens=12,
              temperature=0.0)
    return query, name


def bench_needle(engine: Any, hay_chars: Sequence[int] = (10, 100, 1000),
                 positions: Sequence[str] = POSITIONS, trials: int = 8,
                 aligns: Sequence[str] = ("crop", "recompute", "pad"), drafts: int = 2,
                 seed: int = 0, progress: bool = True,
                 on_row: Any = None) -> list[dict[str, Any]]:
    """One row per (hay length, needle position, alignment or stock): exact match of the name
    with its Wilson interval, draft tokens lost per draft, the cached share; see the module
    docstring. The trials of a cell run together."""
    from tqdm.auto import tqdm

    rows: list[dict[str, Any]] = []
    cells = [(h, p) for h in hay_chars for p in positions]
    for hay, position in tqdm(cells, desc="needle", disable=not progress):
        rng = random.Random(f"{seed}-{hay}-{position}")
        made = [needle_trial(rng, hay, position, drafts) for _ in range(trials)]
        queries, golds = [q for q, _ in made], [name for _, name in made]
        for name in ("stock", *aligns):
            engine.reset_cache()
            if name == "stock":
                results = engine.execute_many(queries, span_mode=False)
            else:
                options = SpanOptions(**{**engine.span_options.as_dict(), "align": name})
                results = engine.execute_many(queries, span_options=options)
            hits = sum(exact_match(r.text, gold) for r, gold in zip(results, golds, strict=True))
            cut = sum(not _needle_read(engine, r, gold) for r, gold in zip(results, golds,
                                                                            strict=True))
            low, high = wilson(hits, trials)
            row = {"hay_chars": hay, "position": position, "align": name, "trials": trials,
                   "accuracy": hits / trials, "low": low, "high": high,
                   "needle_cut": cut / trials,
                   "lost_tokens": statistics.fmean(r.metrics.nested_lost_tokens / drafts
                                                   for r in results),
                   "cached_share": (1.0 if name == "stock" else statistics.fmean(
                       r.metrics.nested_cached_share for r in results)),
                   "draft_tokens": statistics.fmean(len(d.token_ids) for r in results
                                                    for d in _drafts(r))}
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def nested_markdown(rows: list[dict[str, Any]]) -> str:
    """The ``bench nested`` rows as a Markdown table."""
    head = ["fan-out", "align", "judge TTFT (s)", "speedup vs stock", "speedup / crop's",
            "judge steps", "draft tokens read from cache", "tokens lost / draft",
            "fill tokens / draft", "draft steps (+ vs crop)", "drafts (s) (+ vs crop)",
            "drafts + judge TTFT (s)", "bias: same text, |Δ length|"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bias = (f"{r['same_text']:.2f}, {r['length_change']:.1f}" if "same_text" in r else "")
        lines.append("| " + " | ".join([
            str(r["fanout"]), r["align"], f"{r['judge_ttft_s']:.3f}", f"{r['speedup']:.2f}",
            f"{r.get('speedup_vs_crop', float('nan')):.2f}", str(r["judge_steps"]),
            f"{100 * r['cached_share']:.1f} %", f"{r['lost_tokens']:.1f}",
            f"{r['fill_tokens']:.1f}",
            f"{r['draft_steps']} ({r.get('extra_draft_steps', 0):+d})",
            f"{r['drafts_s']:.1f} ({r.get('extra_drafts_s', 0.0):+.1f})",
            f"{r.get('total_ttft_s', r['drafts_s'] + r['judge_ttft_s']):.1f}", bias]) + " |")
    return "\n".join(lines) + "\n"


def _needle_read(engine: Any, result: Any, name: str) -> bool:
    """Whether the judge's prompt holds the needle draft's copy of the needle sentence whole
    (stock: always, it pastes the draft's text)."""
    if result.query is None or not any(s.kind == "generated" for s in result.query.spans):
        return True
    sentence = needle_sentence(name)
    for span in result.query.spans:
        if span.kind != "generated":
            continue
        draft = result.nested.get(span.label.removeprefix("G@"))
        if draft is None or sentence not in draft.text:
            continue
        prompt = len(draft.query.token_ids)
        kept = result.query.token_ids[span.offset + prompt:span.offset + span.content_tokens]
        return sentence in engine.tokenizer.decode(kept)
    return False


def needle_markdown(rows: list[dict[str, Any]]) -> str:
    """The ``bench needle`` rows as a Markdown table: one line per cell, a column per
    alignment (exact match [95 % interval]; tokens lost per draft)."""
    names = list(dict.fromkeys(r["align"] for r in rows))
    head = ["hay chars", "needle", "trials", *[f"{n} EM" for n in names],
            *[f"{n} lost/draft" for n in names if n != "stock"], "crop: needle cut"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = list(dict.fromkeys((r["hay_chars"], r["position"]) for r in rows))
    for hay, position in cells:
        by = {r["align"]: r for r in rows if (r["hay_chars"], r["position"]) == (hay, position)}
        first = next(iter(by.values()))
        ems = [f"{by[n]['accuracy']:.2f} [{by[n]['low']:.2f}, {by[n]['high']:.2f}]"
               if n in by else "" for n in names]
        lost = [f"{by[n]['lost_tokens']:.1f}" if n in by else "" for n in names if n != "stock"]
        cut = f"{by['crop']['needle_cut']:.2f}" if "crop" in by else ""
        lines.append("| " + " | ".join([str(hay), position, str(first["trials"]), *ems,
                                        *lost, cut]) + " |")
    return "\n".join(lines) + "\n"


def plot_align(nested: list[dict[str, Any]], needle: list[dict[str, Any]], path: Any) -> None:
    """Left: the judge's speedup over stock and the draft tokens read from cache, per
    alignment and fan-out; right: needle exact match (Wilson 95 % bars) per position and hay
    length, per alignment and stock. Saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")

    import matplotlib.pyplot as plt

    positions = list(dict.fromkeys(r["position"] for r in needle)) or list(POSITIONS)
    fig, axes = plt.subplots(1, 2 + len(positions), figsize=(4.0 * (2 + len(positions)), 3.6),
                             squeeze=False)
    colours = {"stock": "#555555", "crop": "#c0392b", "recompute": "#2471a3", "pad": "#229954",
               "bias": "#b7950b"}
    names = list(dict.fromkeys(r["align"] for r in nested))
    fanouts = sorted({r["fanout"] for r in nested})
    width = 0.8 / max(len(names), 1)
    for metric, ax, label in (("speedup", axes[0][0], "judge speedup vs stock"),
                              ("cached_share", axes[0][1], "draft tokens read from cache")):
        for i, name in enumerate(names):
            ys = [next((r[metric] for r in nested if r["fanout"] == f and r["align"] == name),
                       0.0) for f in fanouts]
            ax.bar([j + i * width for j in range(len(fanouts))], ys, width,
                   color=colours.get(name), label=name)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(fanouts))],
                      [f"{f} drafts" for f in fanouts])
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    needle_names = list(dict.fromkeys(r["align"] for r in needle))
    for col, position in enumerate(positions):
        ax = axes[0][2 + col]
        for name in needle_names:
            sub = sorted((r for r in needle if r["position"] == position and r["align"] == name),
                         key=lambda r: r["hay_chars"])
            xs = [r["hay_chars"] for r in sub]
            ys = [r["accuracy"] for r in sub]
            err = [[max(0.0, y - r["low"]) for y, r in zip(ys, sub, strict=True)],
                   [max(0.0, r["high"] - y) for y, r in zip(ys, sub, strict=True)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=colours.get(name),
                        label=name, alpha=0.85)
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"needle at the {position}")
        ax.set_xlabel("hay characters per draft")
        ax.grid(True, alpha=0.3)
    axes[0][2].set_ylabel("exact match")
    axes[0][2].legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def run_needle(args: Any) -> int:
    """``span-workflows bench needle``: run the grid, print and write it (``--json``,
    ``--markdown``, ``--plot``: the plot also shows ``bench nested`` rows from
    ``--nested-json`` when given)."""
    import json

    from span_workflows.apps.bench.report import print_table
    from span_workflows.runtime.engine import Engine

    aligns = args.align or ["crop", "recompute", "pad"]
    engine = Engine(args.model, kv_cache_gib=3, max_num_seqs=128, progress=True)
    try:
        rows = bench_needle(engine, args.hay_chars, args.positions, args.trials or 8, aligns,
                            args.drafts, on_row=lambda r: print(json.dumps(r), flush=True))
    finally:
        engine.close()
    print_table(rows)
    _write(args, rows, needle_markdown(rows), engine, args.trials or 8)
    if args.plot:
        nested = json.loads(args.nested_json.read_text()) if args.nested_json else []
        plot_align(nested, rows, args.plot)
    return 0


def run_nested(args: Any) -> int:
    """``span-workflows bench nested``: per alignment and stock; print and write the rows."""
    from span_workflows.apps.bench.report import print_table
    from span_workflows.runtime.engine import Engine

    engine = Engine(args.model, kv_cache_gib=4, max_num_seqs=128, progress=True)
    try:
        rows = bench_nested_align(engine, args.fanout, args.reps,
                                  args.align or list(ALIGN_CHOICES), args.draft_tokens)
    finally:
        engine.close()
    print_table(rows)
    _write(args, rows, nested_markdown(rows), engine, args.reps)
    if args.plot:
        plot_align(rows, [], args.plot)
    return 0


def _write(args: Any, rows: list[dict[str, Any]], markdown: str, engine: Any,
           reps: int) -> None:
    import json

    from span_workflows.apps.bench.provenance import stamp

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamp(rows, engine, reps=reps), indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)


__all__ = ["bench_nested_align", "bench_needle", "needle_markdown", "needle_passage",
           "needle_trial", "nested_markdown", "nested_query", "plot_align", "run_needle",
           "run_nested"]
