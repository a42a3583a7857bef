"""``span-workflows bench lint``: how well ``lint`` tells commuting pluses from ordered ones.

On the labelled set (:mod:`span_workflows.apps.lint_set`), every case is linted twice in one
run, on one engine: the static checks alone, then static + the order check
(:func:`span_workflows.lint.lint` with the engine, ``--trials`` orders and controls, greedy).
For each label (commuting / order-dependent) and each kind of case the table gives the share
of pluses *flagged* — for the order-dependent ones the recall, for the commuting ones the
false-positive rate — by static checks alone and by static + order check, and the time per
plus (the order check's wall time, and the static checks').
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from span_workflows.apps.lint_set import LabelledPlus, labelled_set
from span_workflows.apps.report import wilson
from span_workflows.lint import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_MARGIN,
    KL_FACTOR,
    KL_MIN,
    PlusReport,
    lint,
)


def _plus(case: LabelledPlus, pluses: Sequence[PlusReport]) -> PlusReport:
    for plus in pluses:
        if plus.path == case.path:
            return plus
    raise AssertionError(f"{case.name}: no plus at {case.path}")


class RowStore:
    """Finished rows in a JSON file, so that a run that stops resumes where it stopped. Rows
    are keyed by case, settings, the verdict rule and the model."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            try:
                self.rows = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                from span_workflows.errors import SpanQueryError

                raise SpanQueryError("--answers", f"{path} is not a lint rows file ({exc})"
                                     ) from None

    @staticmethod
    def key(case: str, trials: int, seed: int, answer_tokens: int, margin: float,
            model: str) -> str:
        """The entry of one case's row."""
        return (f"{case}|trials={trials}|seed={seed}|tokens={answer_tokens}|margin={margin}|"
                f"kl={KL_FACTOR},{KL_MIN}|model={model}")

    def put(self, key: str, row: dict[str, Any]) -> None:
        """Keep (and, with a path, save) a row."""
        self.rows[key] = row
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.rows, ensure_ascii=False))


def bench_lint(engine: Any, cases: Sequence[LabelledPlus], *, trials: int = 3,
               answer_tokens: int = DEFAULT_ANSWER_TOKENS, margin: float = DEFAULT_MARGIN,
               seed: int = 0, progress: bool = True, store: RowStore | None = None
               ) -> list[dict[str, Any]]:
    """One row per case: its label, the static verdict, the verdict with the order check and
    the order check's figures. Rows found in ``store`` are not run again."""
    from tqdm.auto import tqdm

    store = store or RowStore(None)
    model = str(getattr(engine, "model_name", "model"))
    rows = []
    for case in tqdm(cases, desc="lint", unit="plus", disable=not progress):
        key = store.key(case.name, trials, seed, answer_tokens, margin, model)
        if key in store.rows:
            rows.append(store.rows[key])
            continue
        started = time.perf_counter()
        static = _plus(case, lint(case.query).pluses)
        static_s = time.perf_counter() - started
        full = _plus(case, lint(case.query, engine, trials=trials, answer_tokens=answer_tokens,
                                margin=margin, seed=seed).pluses)
        check = full.check
        rows.append({
            "name": case.name, "kind": case.kind, "commutes": case.commutes,
            "path": case.path, "static_verdict": static.verdict, "verdict": full.verdict,
            "flagged_static": static.verdict == "flagged",
            "flagged": full.verdict == "flagged",
            "rules": sorted({f"{f.severity}:{f.rule}" for f in static.findings}),
            "orders": check.orders if check else 0,
            "agreement": check.agreement if check else None,
            "control_agreement": check.control_agreement if check else None,
            "drop": check.drop if check else None,
            "kl": check.to_dict()["kl"] if check else None,
            "control_kl": check.to_dict()["control_kl"] if check else None,
            "order_sensitive": check.order_sensitive if check else None,
            "answers": list(check.answers) if check else [],
            "control_answers": list(check.control_answers) if check else [],
            "check_s": check.seconds if check else 0.0, "static_s": static_s,
        })
        store.put(key, rows[-1])
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flag rates by label, then by kind: static alone and static + order check, with 95 %
    Wilson intervals, and the time per plus."""
    groups: list[tuple[str, str, list[dict[str, Any]]]] = []
    for label, commutes in (("commuting", True), ("order-dependent", False)):
        groups.append((label, "all", [r for r in rows if r["commutes"] is commutes]))
    for kind in dict.fromkeys(r["kind"] for r in rows):
        picked = [r for r in rows if r["kind"] == kind]
        groups.append(("commuting" if picked[0]["commutes"] else "order-dependent", kind,
                       picked))
    out = []
    for label, kind, picked in groups:
        if not picked:
            continue
        n = len(picked)
        static, both = sum(r["flagged_static"] for r in picked), sum(r["flagged"] for r in picked)
        low, high = wilson(both, n)
        out.append({
            "label": label, "kind": kind, "pluses": n,
            "flagged_static": static / n, "flagged": both / n, "ci_low": low, "ci_high": high,
            "by_order_check": sum(r["flagged"] and not r["flagged_static"] for r in picked),
            "cleared": sum(r["static_verdict"] == "warning" and not r["flagged"]
                           for r in picked),
            "check_s_per_plus": statistics.fmean(r["check_s"] for r in picked),
            "static_ms_per_plus": 1000 * statistics.fmean(r["static_s"] for r in picked),
        })
    return out


def markdown(result: dict[str, Any]) -> str:
    """The summary and the cases as Markdown tables."""
    def pct(x: float) -> str:
        return f"{100 * x:.0f} %"

    def num(x: float | None, digits: int = 2) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    s = result["settings"]
    lines = [
        f"`{s['command']}` — {s['model']}, {s['trials']} orders and {s['trials']} whitespace "
        f"controls per plus, greedy, {s['answer_tokens']} answer tokens, margin "
        f"{s['margin']}.", "",
        "| label | kind | pluses | flagged (static) | flagged (static + order check) | "
        "95 % CI | by the order check | warnings cleared | order check s / plus | "
        "static ms / plus |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        lines.append(
            f"| {r['label']} | {r['kind']} | {r['pluses']} | {pct(r['flagged_static'])} | "
            f"**{pct(r['flagged'])}** | {pct(r['ci_low'])}–{pct(r['ci_high'])} | "
            f"{r['by_order_check']} | {r['cleared']} | {r['check_s_per_plus']:.2f} | "
            f"{r['static_ms_per_plus']:.2f} |")
    lines += ["", "| case | kind | label | static | with order check | rules | agreement "
                  "(orders / control) | first-token KL (orders / control) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        agree = ("–" if r["agreement"] is None
                 else f"{num(r['agreement'])} / {num(r['control_agreement'])}")
        kl = "–" if r["agreement"] is None else f"{num(r['kl'], 3)} / {num(r['control_kl'], 3)}"
        lines.append(
            f"| {r['name']} | {r['kind']} | {'commutes' if r['commutes'] else 'ordered'} | "
            f"{r['static_verdict']} | {r['verdict']} | {', '.join(r['rules']) or '–'} | "
            f"{agree} | {kl} |")
    return "\n".join(lines) + "\n"


def plot_lint(summary_rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Share of pluses flagged per kind, static alone vs static + order check (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [r for r in summary_rows if r["kind"] != "all"]
    labels = [f"{r['kind']}\n({r['label']}, {r['pluses']})" for r in kinds]
    xs = range(len(kinds))
    fig, ax = plt.subplots(figsize=(9.6, 4.4))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [100 * r["flagged_static"] for r in kinds], width,
           label="static checks")
    ax.bar([x + width / 2 for x in xs], [100 * r["flagged"] for r in kinds], width,
           label="static + order check")
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.axhline(10, color="grey", ls=":", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("pluses flagged (%)")
    ax.set_ylim(0, 105)
    ax.set_title("span-workflows lint on the labelled set (targets: ≥ 90 % of ordered, "
                 "≤ 10 % of commuting)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_lint_bench(args: Any) -> int:
    """``span-workflows bench lint``: run, print the summary, write what was asked for."""
    from span_workflows.apps.report import print_table
    from span_workflows.engine import Engine

    trials = args.trials or 3
    if trials < 2:
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("--trials", "must be at least 2")
    cases = labelled_set()
    store = RowStore(args.answers)
    engine = Engine(args.model, progress=True)
    try:
        rows = bench_lint(engine, cases, trials=trials, seed=args.seed, store=store)
        model = getattr(engine, "model_name", "model")
    finally:
        engine.close()
    command = f"span-workflows bench lint --trials {trials}"
    result = {"settings": {"command": command, "model": model, "trials": trials,
                           "answer_tokens": DEFAULT_ANSWER_TOKENS, "margin": DEFAULT_MARGIN,
                           "seed": args.seed},
              "summary": summary(rows), "cases": rows}
    print_table([{k: v for k, v in r.items()} for r in result["summary"]])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(result))
    if args.plot:
        plot_lint(result["summary"], args.plot)
    return 0


__all__ = ["RowStore", "bench_lint", "markdown", "plot_lint", "run_lint_bench", "summary"]
