"""``span-workflows bench lint``: the summary, the tables and the plot from rows; on the real
engine, the benchmark's rows of two cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from span_workflows.apps.bench import lint as bl
from span_workflows.apps.bench.lint_set import labelled_set


def _row(name: str, kind: str, commutes: bool, static: str, verdict: str) -> dict:
    return {"name": name, "kind": kind, "commutes": commutes, "path": "input.cross[1]",
            "static_verdict": static, "verdict": verdict,
            "flagged_static": static == "flagged", "flagged": verdict == "flagged",
            "rules": [], "orders": 3, "agreement": 1.0, "control_agreement": 1.0, "drop": 0.0,
            "kl": 0.01, "control_kl": 0.01, "order_sensitive": verdict == "flagged",
            "answers": [], "control_answers": [], "check_s": 2.0, "static_s": 0.001}


ROWS = [
    _row("a", "retrieved documents", True, "clean", "clean"),
    _row("b", "retrieved documents", True, "warning", "flagged"),
    _row("c", "numbered steps", False, "flagged", "flagged"),
    _row("d", "numbered steps", False, "clean", "flagged"),
    _row("e", "story in parts", False, "warning", "clean"),
]


def test_summary_counts_rates_by_label_and_kind() -> None:
    rows = {(r["label"], r["kind"]): r for r in bl.summary(ROWS)}
    commuting, ordered = rows[("commuting", "all")], rows[("order-dependent", "all")]
    assert (commuting["pluses"], commuting["flagged_static"], commuting["flagged"]) == (
        2, 0.0, 0.5)
    assert ordered["flagged"] == pytest.approx(2 / 3) and ordered["by_order_check"] == 1
    assert ordered["cleared"] == 1 and rows[("order-dependent", "numbered steps")]["flagged"] == 1
    assert commuting["ci_low"] < 0.5 < commuting["ci_high"]
    assert commuting["check_s_per_plus"] == 2.0 and commuting["static_ms_per_plus"] == 1.0


def test_order_checks_are_kept_and_read_back_at_any_margin(tmp_path: Path) -> None:
    from span_workflows.commutativity.lint import OrderCheck

    check = OrderCheck(3, 3, 0.4, 1.0, 0.01, 0.01, 0.5, ("a", "b", "c"), ("a",) * 3, 2.5)
    store = bl.CheckStore(tmp_path / "checks.json")
    key = store.key("a", 3, 0, 24, "m")
    store.put(key, check)
    again = bl.CheckStore(tmp_path / "checks.json")
    assert again.get(key, 0.5) == check and again.get(key, 0.5).order_sensitive
    assert not again.get(key, 0.7).order_sensitive  # the verdict is computed again
    assert again.get(store.key("a", 4, 0, 24, "m"), 0.5) is None


def test_markdown_and_plot(tmp_path: Path) -> None:
    result = {"settings": {"command": "span-workflows bench lint --trials 3", "model": "m",
                           "trials": 3, "answer_tokens": 24, "margin": 0.5, "seed": 0},
              "summary": bl.summary(ROWS), "cases": ROWS}
    text = bl.markdown(result)
    assert "| order-dependent | all | 3 | 33 % | **67 %** |" in text
    assert "| d | numbered steps | ordered | clean | flagged |" in text
    bl.plot_lint(result["summary"], tmp_path / "lint.png")
    assert (tmp_path / "lint.png").stat().st_size > 1000


@pytest.mark.engine
def test_bench_lint_rows_on_the_engine(engine) -> None:
    cases = {c.name: c for c in labelled_set()}
    rows = bl.bench_lint(engine, [cases["table booking"], cases["translations"]], trials=3,
                         progress=False)
    booking, translations = rows
    assert booking["flagged_static"] and booking["flagged"]
    assert "error:dialogue-turns" in booking["rules"]
    assert booking["orders"] == 3 and len(booking["answers"]) == 3
    assert len(booking["control_answers"]) == 3 and booking["check_s"] > 0
    assert not translations["flagged"], translations
    assert translations["static_verdict"] == "clean" and translations["orders"] == 3
