"""MkDocs hook: the pages of the site that are made from other files of the repository.

At build time, without importing the project:

* every ``benchmarks/results/NAME.json`` becomes the page ``benchmarks/NAME.md``, its rows as
  Markdown tables (:func:`render_json`), with ``NAME.png`` beside it when the benchmark wrote one;
  ``benchmarks/index.md`` lists them and ``benchmarks/notes.md`` is ``benchmarks/README.md``;
* ``ARCHITECTURE.md`` becomes ``architecture.md`` and ``tests/README.md`` ``testing.md``;
* the notebooks of ``notebooks/`` become ``notebooks/NAME.ipynb``, rendered by mkdocs-jupyter
  (not executed);
* the ``Benchmarks`` and ``Notebooks`` sections of the navigation list those pages.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOKS = ROOT / "notebooks"

#: Repository files shown as pages: source path -> page path.
COPIED = {
    "ARCHITECTURE.md": "architecture.md",
    "tests/README.md": "testing.md",
}

#: A string in a table of rows longer than this is cut (with an ellipsis).
MAX_CELL = 240
#: A list of scalars up to this long is written out in its cell; a longer one is summarized.
MAX_LIST = 8


def results() -> list[Path]:
    """The committed benchmark results, by name."""
    return sorted(RESULTS.glob("*.json"))


def notebooks() -> list[Path]:
    """The notebooks, by name."""
    return sorted(NOTEBOOKS.glob("*.ipynb"))


# JSON -> Markdown


def _escape(text: str, limit: int | None = MAX_CELL) -> str:
    text = " ".join(text.split())
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def cell(value: Any, limit: int | None = MAX_CELL) -> str:
    """One value as the text of a table cell (a string cut at ``limit`` characters)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):  # 4 significant digits, or whole units from 10,000 up
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, str):
        return _escape(value, limit)
    if isinstance(value, list):
        if value and all(isinstance(v, bool) for v in value):
            return f"{sum(value)} of {len(value)} true"
        if all(_is_scalar(v) for v in value) and len(value) <= MAX_LIST:
            return ", ".join(cell(v) for v in value) if value else "–"
        if value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return f"{len(value)} values, mean {sum(value) / len(value):.4g}"
        return f"{len(value)} items"
    if isinstance(value, dict):
        text = ", ".join(f"{_escape(str(k))}: {cell(v)}" for k, v in value.items())
        return text if len(text) <= MAX_CELL else f"{len(value)} keys"
    return _escape(str(value))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_escape(h) for h in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _rows_table(rows: list[dict[str, Any]], first: str | None = None,
                keys: list[str] | None = None) -> list[str]:
    """A list of objects as one table; columns equal in every row are said once above it."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    same = [c for c in columns if len(rows) > 1
            and all(c in r for r in rows)
            and all(json.dumps(r[c], sort_keys=True) == json.dumps(rows[0][c], sort_keys=True)
                    for r in rows)]
    lines: list[str] = []
    if same:
        lines += ["Every row: " + "; ".join(f"{_escape(c)} = {cell(rows[0][c])}" for c in same),
                  ""]
    shown = [c for c in columns if c not in same]
    header = ([first] if first else []) + shown
    body = [([_escape(k)] if keys is not None else []) + [cell(r.get(c)) for c in shown]
            for k, r in zip(keys or [""] * len(rows), rows, strict=True)]
    return lines + _table(header, body)


def render_json(value: Any, level: int = 2) -> list[str]:
    """Markdown for one JSON value: tables for lists of objects and objects of objects, a
    key/value table for an object's scalars, a section for each of its other members."""
    heading = "#" * min(level, 6)
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            return _rows_table(value)
        return _table(["value"], [[cell(v)] for v in value]) if value else ["(empty)", ""]
    if not isinstance(value, dict):
        return [cell(value), ""]
    if value and all(isinstance(v, dict) for v in value.values()):
        return _rows_table(list(value.values()), first="key", keys=list(value))
    lines: list[str] = []
    scalars = {k: v for k, v in value.items() if _is_scalar(v) or isinstance(v, list)
               and not any(isinstance(x, dict) for x in v)}
    if scalars:
        lines += _table(["key", "value"],
                        [[_escape(k), cell(v, limit=None)] for k, v in scalars.items()])
    for key, member in value.items():
        if key not in scalars:
            lines += [f"{heading} {_escape(key)}", ""] + render_json(member, level + 1)
    return lines


def benchmark_page(path: Path) -> str:
    """The page of one results file."""
    name = path.stem
    lines = [f"# {name}", "",
             f"Generated when the site is built from `benchmarks/results/{path.name}` "
             "(numbers to 4 significant digits, whole units from 10,000 up). How the "
             "benchmark runs: [Benchmark notes](notes.md).", ""]
    if (RESULTS / f"{name}.png").exists():
        lines += [f"![{name}]({name}.png)", ""]
    if (RESULTS / f"{name}.md").exists():
        lines += [f"The table the benchmark printed: `benchmarks/results/{name}.md`.", ""]
    lines += render_json(json.loads(path.read_text(encoding="utf-8")))
    return "\n".join(lines)


def benchmarks_index() -> str:
    """The page listing every results file."""
    lines = ["# Benchmarks", "",
             "One page per file of `benchmarks/results/`, generated from its JSON when the site "
             "is built. `span-workflows bench NAME` writes them (`--json PATH`, `--plot PATH`); "
             "what each benchmark measures, its options and the targets: "
             "[Benchmark notes](notes.md).", ""]
    rows = []
    for path in results():
        data = json.loads(path.read_text(encoding="utf-8"))
        size = f"{len(data)} rows" if isinstance(data, list) else f"{len(data)} keys"
        plot = "yes" if (RESULTS / f"{path.stem}.png").exists() else "–"
        rows.append([f"[{path.stem}]({path.stem}.md)", f"`{path.name}`", size, plot])
    return "\n".join(lines + _table(["page", "file", "size", "plot"], rows))


def benchmark_notes() -> str:
    """``benchmarks/README.md``, its links made to point into the site."""
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"\]\(results/([\w.-]+)\.(md|json)\)", r"](\1.md)", text)
    text = re.sub(r"\]\(results/([\w.-]+\.png)\)", r"](\1)", text)
    return re.sub(r"\]\(\.\./docs/", "](../", text)


# MkDocs events


def on_config(config: Any) -> Any:
    """Fill the Benchmarks and Notebooks sections of the navigation."""
    generated = {
        "Benchmarks": ["benchmarks/index.md", {"Notes": "benchmarks/notes.md"}]
        + [{p.stem: f"benchmarks/{p.stem}.md"} for p in results()],
        "Notebooks": [f"notebooks/{p.name}" for p in notebooks()],
    }
    for item in config["nav"] or []:
        if isinstance(item, dict):
            for key in item:
                if key in generated:
                    item[key] = generated[key]
    return config


@event_priority(100)  # before mkdocs-jupyter's, which picks up the notebooks added here
def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages, the plots and the notebooks."""
    def add(uri: str, **source: str) -> None:
        files.append(File.generated(config, uri, **source))

    for path in results():
        add(f"benchmarks/{path.stem}.md", content=benchmark_page(path))
        png = RESULTS / f"{path.stem}.png"
        if png.exists():
            add(f"benchmarks/{png.name}", abs_src_path=str(png))
    add("benchmarks/index.md", content=benchmarks_index())
    add("benchmarks/notes.md", content=benchmark_notes())
    for source, uri in COPIED.items():
        add(uri, content=(ROOT / source).read_text(encoding="utf-8"))
    for path in notebooks():
        # a plain file of the repository (not File.generated): mkdocs-jupyter reads its path
        files.append(File(f"notebooks/{path.name}", src_dir=str(ROOT), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files
