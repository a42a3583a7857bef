"""``span-workflows bench lint``: how well ``lint`` tells commuting pluses from ordered ones.

On the labelled set (:mod:`span_workflows.apps.bench.lint_set`), every case is linted twice in one
run, on one engine: the static checks alone, then static + the order check
(:func:`span_workflows.commutativity.lint.lint` with the engine, ``--trials`` orders and controls,
greedy).
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

from span_workflows.apps.bench.lint_set import LabelledPlus, labelled_set
from span_workflows.apps.bench.report import save_figure, wilson
from span_workflows.commutativity.lint import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_MARGIN,
    KL_FACTOR,
    KL_MIN,
    OrderCheck,
    PlusReport,
    lint,
)


def _plus(case: LabelledPlus, pluses: Sequence[PlusReport]) -> PlusReport:
    for plus in pluses:
        if plus.path == case.path:
            return plus
    raise AssertionError(f"{case.name}: no plus at {case.path}")


class CheckStore:
    """The order checks of finished cases in a JSON file, so that a run that stops resumes
    where it stopped (and a change of the static rules or of the verdict's thresholds is
    measured again without the engine). Checks are keyed by case, settings and model."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.checks: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            try:
                self.checks = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                from span_workflows.errors import SpanQueryError

                raise SpanQueryError("--answers", f"{path} is not a file of order checks "
                                                  f"({exc})") from None

    @staticmethod
    def key(case: str, trials: int, seed: int, answer_tokens: int, model: str) -> str:
        """The entry of one case's order check."""
        return f"{case}|trials={trials}|seed={seed}|tokens={answer_tokens}|model={model}"

    def get(self, key: str, margin: float) -> OrderCheck | None:
        """The stored check of ``key`` (its verdict at ``margin``), if any."""
        data = self.checks.get(key)
        return None if data is None else OrderCheck.from_dict(data, margin)

    def put(self, key: str, check: OrderCheck) -> None:
        """Keep (and, with a path, save) a check."""
        self.checks[key] = check.to_dict()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.checks, ensure_ascii=False, indent=1) + "\n")


def bench_lint(engine: Any, cases: Sequence[LabelledPlus], *, trials: int = 3,
               answer_tokens: int = DEFAULT_ANSWER_TOKENS, margin: float = DEFAULT_MARGIN,
               seed: int = 0, progress: bool = True, store: CheckStore | None = None,
               model: str | None = None) -> list[dict[str, Any]]:
    """One row per case: its label, the static verdict, the verdict with the order check and
    the order check's figures. Checks found in ``store`` (under ``model``, by default the
    engine's) are not run again; ``engine`` may be ``None`` when all are there."""
    from tqdm.auto import tqdm

    store = store or CheckStore(None)
    model = model or str(getattr(engine, "model_name", "model"))
    rows = []
    for case in tqdm(cases, desc="lint", unit="plus", disable=not progress):
        started = time.perf_counter()
        static = _plus(case, lint(case.query).pluses)
        static_s = time.perf_counter() - started
        key = store.key(case.name, trials, seed, answer_tokens, model)
        check = store.get(key, margin)
        if check is None:
            if engine is None:
                raise ValueError(f"no stored order check for {key!r} and no engine")
            ran = _plus(case, lint(case.query, engine, trials=trials,
                                   answer_tokens=answer_tokens, margin=margin,
                                   seed=seed).pluses)
            assert ran.check is not None, case.name
            check = ran.check
            store.put(key, check)
        full = PlusReport(static.path, static.kind, static.children, list(static.findings))
        full.attach(check)
        rows.append({
            "name": case.name, "kind": case.kind, "commutes": case.commutes,
            "held_out": case.held_out, "path": case.path,
            "static_verdict": static.verdict, "verdict": full.verdict,
            "flagged_static": static.verdict == "flagged",
            "flagged": full.verdict == "flagged",
            "rules": sorted({f"{f.severity}:{f.rule}" for f in static.findings}),
            "orders": check.orders, "agreement": check.agreement,
            "control_agreement": check.control_agreement, "drop": check.drop,
            "kl": check.to_dict()["kl"], "control_kl": check.to_dict()["control_kl"],
            "order_sensitive": check.order_sensitive,
            "answers": list(check.answers), "control_answers": list(check.control_answers),
            "check_s": check.seconds, "static_s": static_s,
        })
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flag rates by label, then by kind, then by label on the held-out cases: static alone
    and static + order check, with 95 % Wilson intervals, and the time per plus."""
    main = [r for r in rows if not r.get("held_out")]
    held = [r for r in rows if r.get("held_out")]
    groups: list[tuple[str, str, list[dict[str, Any]]]] = []
    for label, commutes in (("commuting", True), ("order-dependent", False)):
        groups.append((label, "all", [r for r in main if r["commutes"] is commutes]))
    for kind in dict.fromkeys(r["kind"] for r in main):
        picked = [r for r in main if r["kind"] == kind]
        groups.append(("commuting" if picked[0]["commutes"] else "order-dependent", kind,
                       picked))
    for label, commutes in (("commuting", True), ("order-dependent", False)):
        groups.append((f"{label} (held out)", "all",
                       [r for r in held if r["commutes"] is commutes]))
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
            "cleared": sum(r["static_verdict"] == "warning" and r["verdict"] == "clean"
                           for r in picked),
            "order_sensitive": sum(bool(r["order_sensitive"]) for r in picked) / n,
            "sensitive_without_evidence": sum(bool(r["order_sensitive"])
                                              and r["static_verdict"] == "clean"
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
        "95 % CI | confirmed by the order check | warnings cleared | order-sensitive on the "
        "model | of them without static evidence | order check s / plus | static ms / plus |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        lines.append(
            f"| {r['label']} | {r['kind']} | {r['pluses']} | {pct(r['flagged_static'])} | "
            f"**{pct(r['flagged'])}** | {pct(r['ci_low'])}–{pct(r['ci_high'])} | "
            f"{r['by_order_check']} | {r['cleared']} | {pct(r['order_sensitive'])} | "
            f"{r['sensitive_without_evidence']} | {r['check_s_per_plus']:.2f} | "
            f"{r['static_ms_per_plus']:.2f} |")
    lines += ["", "| case | kind | label | static | with order check | rules | agreement "
                  "(orders / control) | first-token KL (orders / control) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        agree = ("–" if r["agreement"] is None
                 else f"{num(r['agreement'])} / {num(r['control_agreement'])}")
        kl = "–" if r["agreement"] is None else f"{num(r['kl'], 3)} / {num(r['control_kl'], 3)}"
        held = " (held out)" if r.get("held_out") else ""
        lines.append(
            f"| {r['name']} | {r['kind']} | {'commutes' if r['commutes'] else 'ordered'}{held} | "
            f"{r['static_verdict']} | {r['verdict']} | {', '.join(r['rules']) or '–'} | "
            f"{agree} | {kl} |")
    return "\n".join(lines) + "\n"


def plot_lint(summary_rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Per kind: the share of pluses flagged by the static checks, by static + order check,
    and the share the order check alone finds order-sensitive on the model (PNG)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [r for r in summary_rows if r["kind"] != "all" or "held out" in r["label"]]
    labels = ["\n".join(textwrap.wrap(r["kind"] if r["kind"] != "all" else "held out", 12))
              + f"\n({r['label'].replace(' (held out)', '').replace('order-dependent', 'ordered')}"
              f", {r['pluses']})" for r in kinds]
    xs = list(range(len(kinds)))
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.27
    bars = (("flagged_static", "flagged: static checks"),
            ("flagged", "flagged: static + order check"),
            ("order_sensitive", "order-sensitive on the model (order check alone)"))
    for k, (key, label) in enumerate(bars):
        ax.bar([x + (k - 1) * width for x in xs], [100 * r[key] for r in kinds], width,
               label=label)
    ax.axhline(90, color="grey", ls="--", lw=0.8)
    ax.axhline(10, color="grey", ls=":", lw=0.8)
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel("pluses (%)")
    ax.set_ylim(0, 105)
    ax.set_title("span-workflows lint on the labelled set (targets: flag ≥ 90 % of ordered, "
                 "≤ 10 % of commuting pluses)")
    ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path)


def run_lint_bench(args: Any) -> int:
    """``span-workflows bench lint``: run, print the summary, write what was asked for."""
    from span_workflows.apps.bench.report import print_table
    from span_workflows.runtime.engine import Engine

    trials = args.trials or 3
    if trials < 2:
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("--trials", "must be at least 2")
    from span_workflows.compiler.model import DEFAULT_MODEL_NAME

    cases = labelled_set(held_out=True)
    store = CheckStore(args.answers)
    model = DEFAULT_MODEL_NAME if args.model is None else str(args.model)
    missing = [c for c in cases if store.get(
        store.key(c.name, trials, args.seed, DEFAULT_ANSWER_TOKENS, model), 0.5) is None]
    engine = Engine(args.model, progress=True) if missing else None  # else all are stored
    try:
        rows = bench_lint(engine, cases, trials=trials, seed=args.seed, store=store,
                          model=model)
    finally:
        if engine is not None:
            engine.close()
    command = f"span-workflows bench lint --trials {trials}"
    if args.answers:
        command += f" --answers {args.answers}"
    from span_workflows.apps.bench.provenance import provenance

    result = {"provenance": {**provenance(engine, reps=trials, model=model),
                             "order_checks_run": len(missing),
                             "order_checks_read": len(cases) - len(missing)},
              "settings": {"command": command, "model": model, "trials": trials,
                           "answer_tokens": DEFAULT_ANSWER_TOKENS, "margin": DEFAULT_MARGIN,
                           "kl_factor": KL_FACTOR, "kl_min": KL_MIN, "seed": args.seed},
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


__all__ = ["CheckStore", "bench_lint", "markdown", "plot_lint", "run_lint_bench", "summary"]
