"""README's generated tables hold what their generators make of the committed results, and the
generator rewrites a block in place, leaving the rest of the file as it was."""

from __future__ import annotations

import json
from pathlib import Path

from span_workflows.apps.bench import readme_tables


def test_the_readme_holds_the_tables_of_the_committed_results() -> None:
    readme = (readme_tables.REPOSITORY / "README.md").read_text(encoding="utf-8")
    for name, content in readme_tables.blocks().items():
        assert readme_tables.read_block(readme, name) == content, (
            f"README's {name} table differs from benchmarks/results: run "
            f"python -m span_workflows.apps.bench.readme_tables")


def test_the_quality_table_pairs_each_default_engine_row_with_base_stock(tmp_path: Path) -> None:
    def row(variant: str, size: str, docs: int, accuracy: float, **more: float) -> dict:
        return {"model": "smollm2-135m-instruct", "variant": variant, "size": size,
                "n_docs": docs, "questions": 200, "accuracy": accuracy, **more}

    rows = [row("stock", "long", 8, 0.5), row("stock", "short", 4, 0.75),
            row("routed", "long", 8, 0.45, delta_vs_stock=-0.05, delta_low=-0.1,
                delta_high=0.0),
            row("routed", "short", 4, 0.76, delta_vs_stock=0.01, delta_low=-0.02,
                delta_high=0.04),
            {**row("routed", "short", 4, 0.1), "model": "other"}]
    table = readme_tables.quality_block(rows).splitlines()
    assert table[2:] == ["| short, 4 | 200 | 75.0 % | 76.0 % | +1.0 [−2.0, +4.0] |",
                         "| long, 8 | 200 | 50.0 % | 45.0 % | −5.0 [−10.0, +0.0] |"]

    results = tmp_path / "results"
    results.mkdir()
    (results / "quality.json").write_text(json.dumps(rows))
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\n<!-- generated: quality -->\nold\n<!-- end: quality -->\n\n"
                      "after\n")
    assert readme_tables.update_readme(readme, results) == ["quality"]
    text = readme.read_text()
    assert text.startswith("# Title\n\n<!-- generated: quality -->\n| documents")
    assert text.endswith("|\n<!-- end: quality -->\n\nafter\n") and "old" not in text
    assert readme_tables.update_readme(readme, results) == []  # already current


def test_the_quality_table_shows_only_the_shipped_adapters_rows() -> None:
    """A routed row answered by an earlier adapter is not the price of the one shipped."""
    def row(variant: str, accuracy: float, digest: str) -> dict:
        return {"model": "smollm2-135m-instruct", "variant": variant, "size": "short",
                "n_docs": 4, "questions": 200, "accuracy": accuracy,
                "adapters": {"smollm2-135m-instruct-span": digest},
                "delta_vs_stock": 0.0, "delta_low": -0.1, "delta_high": 0.1}

    rows = [row("stock", 0.5, "old"), row("routed", 0.2, "old")]
    shipped = readme_tables.shipped_adapter_digest()
    assert shipped is not None and len(shipped) == 64
    table = readme_tables.quality_block(rows, shipped)
    assert "20.0 %" not in table and "not measured on this adapter yet" in table
    assert f"adapter {shipped[:8]}" in table
    assert "20.0 %" in readme_tables.quality_block(rows, "old")
