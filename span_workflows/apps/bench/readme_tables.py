"""README tables made from committed benchmark results, never copied by hand.

README.md holds blocks between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``;
:func:`update_readme` rewrites each from its results file, and the docs tests check that the
README holds exactly what :func:`blocks` makes of the committed results. Run
``python -m span_workflows.apps.bench.readme_tables`` after a benchmark run that changed them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from span_workflows.build_info import REPOSITORY

RESULTS = REPOSITORY / "benchmarks" / "results"
#: The base model's name in result rows, and the span-ready adapter the default engine routes
#: span queries to.
BASE = "smollm2-135m-instruct"
SPAN_READY = "smollm2-135m-instruct-span"


def _pct(value: float) -> str:
    return f"{100 * value:.1f} %"


def _points(value: float) -> str:
    return f"{100 * value:+.1f}".replace("-", "−")


@cache
def shipped_adapter_digest() -> str | None:
    """The SHA-256 of the span-ready adapter committed under ``span_workflows/adapters/``
    (what an engine on the base routes span queries to), ``None`` if it is missing. Hashed
    once per process: the adapter is installed by ``make adapter``, not while a table is made."""
    from span_vllm.contract import adapter_digest
    from span_workflows.compiler.model import bundled_adapters

    path = bundled_adapters().get(SPAN_READY)
    return adapter_digest(path) if path is not None else None


def routed_rows(rows: list[dict[str, Any]], adapter: str | None = None) -> list[dict[str, Any]]:
    """The ``routed`` rows of the base (the default ``Engine()``: span queries on the
    span-ready adapter), with ``adapter`` (a digest) only those that adapter answered."""
    return [r for r in rows if r.get("model") == BASE and r["variant"] == "routed"
            and (adapter is None or r.get("adapters", {}).get(SPAN_READY) == adapter)]


def quality_block(rows: list[dict[str, Any]], adapter: str | None = None) -> str:
    """What span mode costs in answers on the default engine: for every cell of
    ``quality.json`` with a ``routed`` row (the default ``Engine()``), its span accuracy beside
    the base's stock accuracy on the same questions, and the paired difference with its 95 %
    interval. With ``adapter`` (a digest), only the rows that span-ready adapter answered:
    rows of an earlier adapter are not the price of the one shipped."""
    routed = routed_rows(rows, adapter)
    stock = {(r.get("size", "short"), r["n_docs"], r["questions"]): r for r in rows
             if r.get("model") == BASE and r["variant"] == "stock"}
    named = f" {adapter[:8]}" if adapter else ""
    lines = ["| documents | questions | stock (base weights) "
             f"| span queries (adapter{named}) | difference, 95 % interval |",
             "|---|---|---|---|---|"]
    for r in sorted(routed, key=lambda r: (r.get("size", "short") != "short", r["n_docs"])):
        size = r.get("size", "short")
        base = stock[(size, r["n_docs"], r["questions"])]
        lines.append(
            f"| {size}, {r['n_docs']} | {r['questions']} | {_pct(base['accuracy'])} "
            f"| {_pct(r['accuracy'])} | {_points(r['delta_vs_stock'])} "
            f"[{_points(r['delta_low'])}, {_points(r['delta_high'])}] |")
    if not routed:
        lines.append("| – | – | – | not measured on this adapter yet | – |")
    return "\n".join(lines)


#: Each generated block: its name, its results file and what makes the block from it.
GENERATORS: dict[str, tuple[str, Callable[[list[dict[str, Any]]], str]]] = {
    "quality": ("quality.json", lambda rows: quality_block(rows, shipped_adapter_digest())),
}


def blocks(results: Path = RESULTS) -> dict[str, str]:
    """Every generated block's text, from the results in ``results``."""
    return {name: make(json.loads((results / file).read_text()))
            for name, (file, make) in GENERATORS.items()}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- generated: {name} -->\n(.*?)\n?<!-- end: {name} -->", re.DOTALL)


def read_block(text: str, name: str) -> str | None:
    """The current content of block ``name`` in ``text`` (``None``: no such block)."""
    found = _pattern(name).search(text)
    return found.group(1) if found else None


def update_readme(path: Path = REPOSITORY / "README.md", results: Path = RESULTS) -> list[str]:
    """Rewrite every generated block of ``path`` from ``results``; the names of the blocks
    that changed."""
    text = path.read_text(encoding="utf-8")
    changed = []
    for name, content in blocks(results).items():
        if read_block(text, name) is None:
            raise ValueError(f"{path} has no block '<!-- generated: {name} -->'")
        if read_block(text, name) != content:
            block = f"<!-- generated: {name} -->\n{content}\n<!-- end: {name} -->"
            text = _pattern(name).sub(lambda _, b=block: b, text)
            changed.append(name)
    path.write_text(text, encoding="utf-8")
    return changed


if __name__ == "__main__":
    print("updated:", ", ".join(update_readme()) or "nothing")
