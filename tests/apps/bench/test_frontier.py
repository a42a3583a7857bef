"""The default span options of a model, chosen from its link frontier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from span_workflows.apps.bench.frontier import choose_default, write_default
from span_workflows.compiler.model import span_defaults
from span_workflows.errors import SpanQueryError


def _rows(deltas: dict[str, list[float]], model: str = "m") -> list[dict]:
    cells = [("short", 4), ("short", 8), ("long", 4)]
    rows = [{"model": model, "variant": "stock", "size": s, "n_docs": n, "delta_vs_stock": 0.0}
            for s, n in cells]
    for variant, values in deltas.items():
        rows += [{"model": model, "variant": variant, "size": s, "n_docs": n,
                  "delta_vs_stock": d} for (s, n), d in zip(cells, values, strict=True)]
    return rows


def test_the_fewest_recomputed_tokens_that_keep_every_cell() -> None:
    rows = _rows({"prefix": [0.0, -0.10, 0.01], "prefix/link": [0.0, -0.03, 0.0],
                  "prefix/link2": [0.01, -0.02, 0.0], "prefix/link4": [0.02, 0.0, 0.03]})
    choice = choose_default(rows, "m")
    assert (choice.variant, choice.link_blocks, choice.meets_target) == ("prefix/link2", 2, True)
    assert choice.options == {"attend": "prefix", "link_blocks": 2}
    assert choice.worst_cell == "short/8" and choice.cells == 3
    assert "within 2 points" in choice.describe()
    # a looser tolerance is the one the choice and its line speak of
    loose = choose_default(rows, "m", tolerance=0.05)
    assert (loose.variant, loose.tolerance) == ("prefix/link", 0.05)
    assert "within 5 points" in loose.describe() and "2 points" not in loose.describe()


def test_the_best_reachable_is_said_plainly() -> None:
    rows = _rows({"prefix": [0.0, -0.20, 0.0], "prefix/link2": [-0.05, -0.06, 0.0],
                  "prefix/link4": [-0.05, -0.06, 0.0],
                  "prefix/link": [-0.3, -0.3, 0.0]})  # ties go to the cheaper one
    choice = choose_default(rows, "m")
    assert (choice.variant, choice.meets_target) == ("prefix/link2", False)
    assert "best reachable" in choice.describe()
    # a variant missing a cell does not compete; a model with no frontier is an error
    partial = [r for r in rows if not (r["variant"] == "prefix/link2" and r["n_docs"] == 8)]
    assert choose_default(partial, "m").variant == "prefix/link4"
    with pytest.raises(SpanQueryError, match="no link frontier"):
        choose_default(rows, "other")


def test_the_choice_is_what_an_engine_on_the_model_starts_with(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    choice = choose_default(_rows({"prefix/link2": [0.0, 0.0, 0.0]}), "m")
    path = write_default(tmp_path, choice)
    assert span_defaults(tmp_path) == {"attend": "prefix", "link_blocks": 2}
    assert json.loads(path.read_text())["chosen_by"]["variant"] == "prefix/link2"
    write_default(tmp_path, choice)  # chosen again: replaced
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "config.json").write_text("{}")
    (trained / "span_workflows.json").write_text(json.dumps(
        {"span_ready": True, "span_options": {"attend": "prefix", "link_blocks": 0}}))
    with pytest.raises(SpanQueryError, match="keeps them"):
        write_default(trained, choice)
    with pytest.raises(SpanQueryError, match="not a model directory"):
        write_default(tmp_path / "missing", choice)


def test_the_frontier_is_bench_qualitys_link_variants() -> None:
    from span_workflows.apps.bench.frontier import FRONTIER
    from span_workflows.apps.bench.quality import VARIANTS

    for name, links in FRONTIER.items():
        options = VARIANTS[name].options
        assert options is not None and (options.attend, options.link_blocks) == ("prefix", links)
