"""``span-workflows bench locality``: needle in a haystack, flat judge vs tournament.

The paper's attention-locality experiment: 8 inner generations each produce a text; exactly one
of them holds a random name (the needle) at its start, middle or end, surrounded by hay; a judge
reads all 8 and must name the needle. The *flat* judge reads the 8 texts at once,
``G(x(S, +(G1..G8), U))``; the *tournament* (:func:`span_workflows.compiler.locality.tournament`,
fan-in 2)
has 2-way judges in 3 rounds, each quoting what it found, so no judge attends over more than
two texts. Every judge is asked to *quote the sentence that gives the secret name* (quoting the
evidence is what a 135M model does most reliably, and it gives the next round a sentence to
pick rather than a bare word). The *round-1 judge* columns score, inside each tournament, the
first-round judge whose pair holds the needle (:func:`needle_judge`): how well a judge over two
isolated texts finds the needle, before the later rounds have to pick its answer among the
other pairs' answers.

**How the inner texts are made (the honest variant).** SmolLM2-135M cannot reliably *write*
hay of a given length around a given name, so each inner generation is a *copy task*:
``G(U("Repeat this text exactly:\n\n<text>"), temperature=0)``, as in the paper where the
generators are told the name to write. The inner G's are real nested generations under the
judge's plus: the judge reuses each one's prompt and output span, exactly the KV computed while
generating, and the judge's ``align`` (``aligns``, ``--align``) says how it reads each one's
partial last KV block (``crop`` drops it; see :mod:`span_workflows.query.span_options`). Each inner
G writes at most ``copy_tokens`` tokens (default 8; ``--copy-tokens 0`` copies the whole text)
because decoding hundreds of tokens per candidate is too slow on a shared CPU; the text with
the needle is therefore in the inner *prompt*, which cropping never cuts (it
only drops output tokens of a partial block), so crop on/off measures the effect of the cut
output on the judge, not the loss of the needle. With ``--copy-tokens 0`` a needle at the
``end`` sits at the end of the copy, where cropping can cut it (it is still in the prompt; the
needle only in a draft's output is ``bench needle``, :mod:`span_workflows.apps.bench.align`).
``hay_chars=0`` means each text is one sentence: the needle sentence in one text, a neutral
sentence at the same place in the others. The hay is bland English sentences without proper
names, drawn per text and trial; names and placements come from a seeded RNG.

**Scoring.** The answer is normalised (lower case, punctuation and articles dropped) and a
leading restatement of the question ("The secret name is", "The secret name in the texts is")
is dropped (:func:`answer_name`); *exact* means what is left equals the name, *F1* is SQuAD's
token F1 against the name, *contains* means the name is one of the answer's words.
``flat_accuracy``, ``tournament_accuracy`` and ``round1_accuracy`` are exact-match fractions;
``*_f1`` columns are mean token F1; ``±`` are 95 % Wilson intervals (half-widths) of the
exact-match fraction over ``trials``. The alignments use the same engine and the same inner
outputs (temperature 0), so the columns are paired: the first alignment's columns are
unsuffixed, the others' end in ``_<align>``.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from span_workflows.apps.bench.report import save_figure, wilson
from span_workflows.compiler.locality import tournament
from span_workflows.query.builders import cross, g, plus, system, user
from span_workflows.query.ir import Generate
from span_workflows.query.span_options import SpanOptions

NAMES = (
    "Marigold", "Thaddeus", "Ophelia", "Bartholomew", "Zenobia", "Cornelius", "Evangeline",
    "Percival", "Rosalind", "Leopold", "Octavia", "Ignatius", "Wilhelmina", "Ambrose",
    "Seraphina", "Montgomery", "Clementine", "Barnaby", "Philippa", "Horatio", "Lucinda",
    "Fitzgerald", "Gwendolyn", "Archibald",
)
HAY = (
    "The river ran slowly past the old mill.", "Rain fell on the fields for most of the day.",
    "A cart rolled down the road toward the market.", "The bakery opened early in the morning.",
    "Children played near the fence behind the school.", "The wind turned cold after sunset.",
    "Someone left a blue umbrella by the door.", "The bridge was painted again last spring.",
    "Sheep grazed on the hill above the village.", "The clock in the square struck noon.",
    "A small boat drifted along the quiet canal.", "The library closed an hour later than usual.",
    "Fresh bread was stacked on the wooden shelves.", "Leaves gathered in the corners of the yard.",
    "The train was a few minutes late that evening.", "Lanterns were hung along the garden path.",
    "The soup simmered on the stove all afternoon.", "A dog barked twice and then went quiet.",
    "The orchard trees were heavy with apples.", "Clouds moved quickly across the grey sky.",
    "The shopkeeper counted coins behind the counter.", "A kettle whistled in the next room.",
    "The path through the woods was muddy and narrow.", "Snow had melted from the rooftops.",
)
NEUTRAL = "Nothing else happened that day."
SYSTEM = "You read texts and find the secret name hidden in one of them."
JUDGE = "Quote the one sentence above that says what the secret name is."
POSITIONS = ("start", "middle", "end")
#: The prompt of each inner (copy-task) generation.
COPY = "Repeat this text exactly:\n\n{text}"


def passage(rng: random.Random, hay_chars: int, sentence: str, position: str) -> str:
    """About ``hay_chars`` characters of hay (whole sentences) with ``sentence`` at
    ``position`` (start, middle or end)."""
    if position not in POSITIONS:
        raise ValueError(f"position must be one of {POSITIONS}, got {position!r}")
    hay: list[str] = []
    while sum(len(s) + 1 for s in hay) < hay_chars:
        hay.append(rng.choice(HAY))
    at = {"start": 0, "middle": len(hay) // 2, "end": len(hay)}[position]
    return " ".join(hay[:at] + [sentence] + hay[at:])


def needle_sentence(name: str) -> str:
    """The sentence that hides the needle."""
    return f"The secret name is {name}."


def needle_judge(result: Any, name: str, decode: Any) -> Any:
    """The first-round judge in a tournament's result tree whose group holds the needle: the
    result whose nested results are all leaves and one of whose leaves' prompts (decoded with
    ``decode``) holds :func:`needle_sentence`. Raises ``LookupError`` if there is none."""
    stack = [result]
    while stack:
        current = stack.pop()
        leaves = list(current.nested.values())
        if leaves and all(not leaf.nested for leaf in leaves):
            if any(needle_sentence(name) in decode(leaf.query.token_ids) for leaf in leaves):
                return current
        else:
            stack.extend(leaves)
    raise LookupError(f"no first-round judge holds the needle {name!r}")


def make_trial(rng: random.Random, hay_chars: int, position: str, candidates: int = 8,
               max_tokens_of: Any = None, copy_tokens: int = 8) -> tuple[Generate, str]:
    """One flat judge query and its needle: ``candidates`` copy-task G's, one with the name.

    Each inner G may write up to ``copy_tokens`` tokens of its copy (0: the whole text, sized
    with ``max_tokens_of(text)`` tokens when given)."""
    name = rng.choice(NAMES)
    needle_at = rng.randrange(candidates)
    inner = []
    for i in range(candidates):
        sentence = needle_sentence(name) if i == needle_at else NEUTRAL
        text = passage(rng, hay_chars, sentence, position)
        budget = (max_tokens_of(text) if max_tokens_of else len(text) // 3) + 8
        if copy_tokens:
            budget = min(budget, copy_tokens)
        inner.append(g(user(COPY.format(text=text)), max_tokens=budget,
                       temperature=0.0))
    query = g(cross(system(SYSTEM), plus(*inner), user(JUDGE)), max_tokens=12, temperature=0.0)
    return query, name


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


#: A restatement of the question the model often puts before the name ("The secret name in
#: the texts is X"), dropped before scoring, as SQuAD drops articles.
_RESTATEMENT = re.compile(r"^(?:secret )?name(?: in(?: texts| text)(?: above)?)? is ")


def answer_name(answer: str) -> str:
    """The normalised answer without a leading restatement of the question."""
    return _RESTATEMENT.sub("", normalize(answer), count=1)


def exact_match(answer: str, gold: str) -> bool:
    """The answer (normalised, restatement dropped) equals the normalised name."""
    return answer_name(answer) == normalize(gold)


def token_f1(answer: str, gold: str) -> float:
    """SQuAD token F1 of the answer (normalised, restatement dropped) against the name."""
    pred, ref = answer_name(answer).split(), normalize(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or not common:
        return float(pred == ref)
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _pm(successes: int, n: int) -> float:
    low, high = wilson(successes, n)
    return (high - low) / 2


def bench_locality(engine: Any, hay_chars: Sequence[int] = (0, 200, 400, 800),
                   trials: int = 8, positions: Sequence[str] = POSITIONS,
                   aligns: Sequence[str] = ("crop", "recompute"), fanin: int = 2, seed: int = 0,
                   copy_tokens: int = 8, batch: int = 4, progress: bool = True,
                   log: Any = None, on_row: Any = None) -> list[dict[str, Any]]:
    """One row per (hay length, needle position): exact match and F1 of the flat judge and of
    the tournament, for each alignment of the inner outputs: the first alignment's columns are
    unsuffixed (``align`` names it), the others' end in ``_<align>``. See the module docstring.
    Runs ``batch`` trials at a time (their flat and tournament queries together)."""
    from tqdm.auto import tqdm

    def tokens_of(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    rows: list[dict[str, Any]] = []
    cells = [(h, p) for h in hay_chars for p in positions]
    for hay, position in tqdm(cells, desc="locality", disable=not progress):
        rng = random.Random(f"{seed}-{hay}-{position}")
        made = [make_trial(rng, hay, position, max_tokens_of=tokens_of,
                           copy_tokens=copy_tokens) for _ in range(trials)]
        queries = [q for q, _ in made]
        golds = [name for _, name in made]
        local = [tournament(q, fanin) for q in queries]
        row: dict[str, Any] = {"hay_chars": hay, "position": position, "trials": trials,
                               "align": aligns[0]}
        for i, align in enumerate(aligns):
            engine.reset_cache()  # every alignment from an empty cache
            options = SpanOptions(**{**engine.span_options.as_dict(), "align": align})
            flat, tour = [], []
            for at in range(0, trials, batch):  # bounded batches: no KV-cache thrashing
                part = engine.execute_many(queries[at:at + batch] + local[at:at + batch],
                                           span_options=options)
                half = len(part) // 2
                flat += part[:half]
                tour += part[half:]
            suffix = f"_{align}" if i else ""
            _score(row, "flat", flat, golds, suffix)
            _score(row, "tournament", tour, golds, suffix)
            round1 = [needle_judge(r, gold, engine.tokenizer.decode)
                      for r, gold in zip(tour, golds, strict=True)]
            _score(row, "round1", round1, golds, suffix)
            row[f"lost_per_draft{suffix}"] = sum(  # of the flat judge's drafts
                r.metrics.nested_lost_tokens / max(1, len(r.nested)) for r in flat) / len(flat)
            if log is not None:
                log({"hay_chars": hay, "position": position, "align": align,
                     "gold": golds, "flat": [r.text for r in flat],
                     "tournament": [r.text for r in tour],
                     "round1": [r.text for r in round1]})
        rows.append(_ordered_row(row))
        if on_row is not None:
            on_row(rows[-1])
    order = {p: i for i, p in enumerate(POSITIONS)}
    return sorted(rows, key=lambda r: (r["hay_chars"], order[r["position"]]))


def _score(row: dict[str, Any], kind: str, results: list[Any], golds: list[str],
           suffix: str) -> None:
    hits = sum(exact_match(r.text, gold) for r, gold in zip(results, golds, strict=True))
    f1 = sum(token_f1(r.text, gold) for r, gold in zip(results, golds, strict=True))
    n = len(golds)
    row[f"{kind}_accuracy{suffix}"] = hits / n
    row[f"{kind}_pm{suffix}"] = _pm(hits, n)
    row[f"{kind}_f1{suffix}"] = f1 / n
    row[f"{kind}_contains{suffix}"] = sum(
        normalize(gold) in normalize(r.text).split() for r, gold in zip(results, golds, strict=True)
    ) / n
    row[f"{kind}_prompt_tokens{suffix}"] = round(
        sum(r.metrics.prompt_tokens for r in results) / n
    )


def _ordered_row(row: dict[str, Any]) -> dict[str, Any]:
    head = ["hay_chars", "position", "trials", "flat_accuracy", "tournament_accuracy"]
    return {k: row[k] for k in head if k in row} | {k: v for k, v in row.items()
                                                     if k not in head}


def _suffixes(rows: list[dict[str, Any]]) -> list[str]:
    """The column suffixes of the other alignments (``_recompute``; ``_nocrop`` in older
    rows), in order."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return [k[len("flat_accuracy"):] for k in keys if k.startswith("flat_accuracy_")]


def _named(suffix: str) -> str:
    return "no crop" if suffix == "_nocrop" else suffix.removeprefix("_")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: exact match ± Wilson half-width of the flat judge, the
    tournament and its first-round judge over the needle's pair, token F1, with the first
    alignment (and the exact matches with the others, when they were run)."""
    others = _suffixes(rows)
    head = ["hay chars", "needle", "trials", "flat EM", "tournament EM", "Δ EM",
            "round-1 judge EM", "flat F1", "tournament F1", "round-1 F1"]
    for sfx in others:
        head += [f"flat EM {_named(sfx)}", f"tournament EM {_named(sfx)}",
                 f"round-1 EM {_named(sfx)}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def em(r: dict[str, Any], kind: str, sfx: str = "") -> str:
        return f"{r[f'{kind}_accuracy{sfx}']:.2f} ± {r[f'{kind}_pm{sfx}']:.2f}"

    for r in rows:
        cells = [str(r["hay_chars"]), r["position"], str(r["trials"]), em(r, "flat"),
                 em(r, "tournament"),
                 f"{100 * (r['tournament_accuracy'] - r['flat_accuracy']):+.0f}",
                 em(r, "round1"), f"{r['flat_f1']:.2f}", f"{r['tournament_f1']:.2f}",
                 f"{r['round1_f1']:.2f}"]
        for sfx in others:
            cells += [em(r, "flat", sfx), em(r, "tournament", sfx), em(r, "round1", sfx)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_report(rows: list[dict[str, Any]], copy_tokens: int) -> str:
    """A heading saying how the rows were measured, then :func:`markdown_table`."""
    trials = sorted({r["trials"] for r in rows})
    copied = f"{copy_tokens} copied tokens each" if copy_tokens else "whole texts copied"
    return (
        "# Locality benchmark: needle in a haystack, flat judge vs tournament (fan-in 2)\n\n"
        f"{', '.join(map(str, trials))} trials per cell, 8 copy-task inner generations "
        f"({copied}), judge max_tokens=12, temperature 0. EM = exact match (± = 95 % Wilson "
        "half-width), F1 = token F1. *Round-1 judge*: inside each tournament, the first-round "
        "2-way judge whose pair holds the needle. Written by `span-workflows bench locality "
        "--markdown`; the method is in `span_workflows/apps/bench/locality.py`.\n\n"
        + markdown_table(rows)
    )


def plot_locality(rows: list[dict[str, Any]], path: Any, title: str = "") -> None:
    """Exact match (top, Wilson 95 % error bars) and token F1 (bottom) vs hay length, one column
    per needle position: flat (red), tournament (blue) and the tournament's first-round judge
    over the needle's pair (green), crop on (solid) and off (dashed). Saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")

    import matplotlib.pyplot as plt

    positions = list(dict.fromkeys(r["position"] for r in rows))
    metrics = [("accuracy", "exact match"), ("f1", "token F1")]
    fig, axes = plt.subplots(len(metrics), len(positions),
                             figsize=(4.2 * len(positions), 3.2 * len(metrics)),
                             sharey=True, sharex=True, squeeze=False)
    styles = [("flat", "#c0392b"), ("tournament", "#2471a3"), ("round1", "#229954")]
    for col, position in enumerate(positions):
        sub = sorted((r for r in rows if r["position"] == position),
                     key=lambda r: r["hay_chars"])
        xs = [r["hay_chars"] for r in sub]
        for row_i, (metric, ylabel) in enumerate(metrics):
            ax = axes[row_i][col]
            for suffix, ls in zip(["", *_suffixes(sub)], ["-", "--", ":", "-."], strict=False):
                if f"flat_{metric}{suffix}" not in sub[0]:
                    continue
                for kind, colour in styles:
                    ys = [r[f"{kind}_{metric}{suffix}"] for r in sub]
                    err = ([r[f"{kind}_pm{suffix}"] for r in sub] if metric == "accuracy"
                           else None)
                    name = ("round-1 judge" if kind == "round1" else kind) + (
                        f" ({_named(suffix)})" if suffix else "")
                    ax.errorbar(xs, ys, yerr=err, color=colour, linestyle=ls, marker="o",
                                capsize=3, label=name, alpha=0.6 if suffix else 0.95)
            if row_i == 0:
                ax.set_title(f"needle at {position}")
            if row_i == len(metrics) - 1:
                ax.set_xlabel("hay characters per text")
            if col == 0:
                ax.set_ylabel(ylabel)
            ax.set_ylim(-0.05, 1.05)
            ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    save_figure(fig, path, dpi=110)


def run_locality(args: Any) -> int:
    """``span-workflows bench locality`` (``args`` from
    :func:`span_workflows.apps.bench.run.run_bench`): run, print the table, write ``--json`` (one
    row per hay length and needle position), ``--markdown`` and ``--plot``."""
    import json

    from span_workflows.apps.bench.report import print_table
    from span_workflows.runtime.engine import Engine

    for p in args.positions:
        if p not in POSITIONS:
            from span_workflows.errors import SpanQueryError

            raise SpanQueryError("bench", f"unknown position {p!r} (start, middle, end)")
    engine = Engine(args.model, kv_cache_gib=3, max_num_seqs=128, progress=True)
    try:
        partial = args.json.with_suffix(".partial.jsonl") if args.json else None

        def on_row(row: dict[str, Any]) -> None:
            print(json.dumps(row), flush=True)
            if partial is not None:
                with partial.open("a") as f:
                    f.write(json.dumps(row) + "\n")

        rows = bench_locality(engine, args.hay_chars, args.trials or 8, args.positions,
                              aligns=args.align or (("recompute",) if args.no_crop
                                                    else ("crop", "recompute")),
                              copy_tokens=args.copy_tokens, on_row=on_row)
        if partial is not None:
            partial.unlink(missing_ok=True)
    finally:
        engine.close()
    print_table([{k: v for k, v in r.items() if "prompt_tokens" not in k} for r in rows])
    if args.json:
        from span_workflows.apps.bench.provenance import stamp

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(stamp(rows, engine, reps=args.trials or 8), indent=2)
                             + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_report(rows, args.copy_tokens))
    if args.plot:
        plot_locality(rows, args.plot, "needle in a haystack: flat judge vs tournament")
    return 0


__all__ = [
    "NAMES", "POSITIONS", "answer_name", "bench_locality", "exact_match", "make_trial",
    "markdown_report", "markdown_table", "needle_judge", "needle_sentence", "normalize",
    "passage", "plot_locality", "run_locality", "token_f1", "wilson",
]
