"""The table ``span-workflows lint`` prints: one per query file, a row per finding (rich)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from span_workflows.commutativity.lint import LintReport, PlusReport

VERDICT_STYLE = {"flagged": "bold red", "warning": "yellow", "clean": "green"}
SEVERITY_STYLE = {"error": "red", "warning": "yellow", "note": "dim"}


def print_reports(reports: Sequence[tuple[str, LintReport]], console: Any = None) -> None:
    """Print each ``(label, report)`` as a table, then one line of totals."""
    from rich.console import Console

    console = console or Console(width=None if _is_terminal() else 120)
    for label, report in reports:
        console.print(_table(label, report))
    pluses = [p for _, r in reports for p in r.pluses]
    flagged = sum(p.verdict == "flagged" for p in pluses)
    warned = sum(p.verdict == "warning" for p in pluses)
    cleared = sum(p.cleared for p in pluses)
    parts = [f"{len(pluses)} plus{'es' if len(pluses) != 1 else ''}", f"{flagged} flagged"]
    if warned:
        parts.append(f"{warned} with warnings (run with --trials K to confirm or clear them)")
    if cleared:
        parts.append(f"{cleared} cleared by the order check")
    style = "bold red" if flagged else ("yellow" if warned else "green")
    console.print(", ".join(parts), style=style)


def _table(label: str, report: LintReport) -> Any:
    from rich.table import Table

    title = label
    if report.trials:
        title += f"  (order check: {report.trials} orders, {report.model or 'default model'})"
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("plus", overflow="fold")
    table.add_column("verdict")
    table.add_column("check")
    table.add_column("evidence", overflow="fold", ratio=1)
    if not report.pluses:
        table.add_row("–", "[green]clean[/]", "–", "no plus in this query")
    for plus in report.pluses:
        rows = _rows(plus)
        for i, (check, evidence) in enumerate(rows):
            verdict = plus.verdict
            table.add_row(
                f"{plus.path or '(root)'}\n{plus.kind} of {plus.children}" if i == 0 else "",
                f"[{VERDICT_STYLE[verdict]}]{verdict}[/]" if i == 0 else "",
                check, evidence)
    return table


def _rows(plus: PlusReport) -> list[tuple[str, str]]:
    rows = []
    for f in plus.findings:
        if f.rule == "order-sensitive":
            continue  # shown with the order check below
        where = "" if f.path == plus.path else f" [dim]at {f.path}[/]"
        status = " [dim](cleared)[/]" if plus.cleared and f.severity == "warning" else ""
        status = " [dim](confirmed)[/]" if plus.confirmed and f.severity == "warning" else status
        rows.append((f"[{SEVERITY_STYLE[f.severity]}]{f.rule}[/]",
                     f"{_escape(f.evidence)}{where}{status}"))
    if plus.check is not None:
        summary = _escape(plus.check.summary())
        if plus.confirmed:
            what = "the static evidence" if plus.has_static("error") else "the warnings"
            rows.append(("[red]order-sensitive[/]", f"{summary} — confirms {what}"))
        elif plus.check.order_sensitive:
            rows.append(("[yellow]order-sensitive[/]",
                         f"{summary} — no static evidence: the model's answer moves with the "
                         "order (a small model's does for documents that commute, too)"))
        else:
            note = ""
            if plus.cleared:
                note = " — clears the warnings"
            elif plus.has_static("error"):
                note = " — the answer did not move here; the static evidence stands"
            rows.append(("[green]order check[/]", f"{summary}{note}"))
    elif plus.skipped:
        rows.append(("[dim]order check[/]", f"[dim]not run: {plus.skipped}[/]"))
    if not rows:
        rows.append(("–", "no finding"))
    return rows


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty()


__all__ = ["print_reports"]
