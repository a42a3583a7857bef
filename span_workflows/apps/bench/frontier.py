"""A model's default span options, chosen from its link frontier in ``bench quality``.

For a model that records no options of its own, the default is the fewest recomputed tokens
whose answers stay within ``tolerance`` (2 points) of the model's own stock answers in every
measured cell (document size × count): the cheapest ``prefix/link…`` variant that keeps every
cell, or, when none does, the one whose worst cell is best (``meets_target`` false, said as
such). Recomputed tokens per document are ``link_blocks`` × the block size; the variants are
ranked by :data:`FRONTIER`'s order (``link-all``, every block but the last, is the costliest).
:func:`write_default` records
the choice in a model directory's ``span_workflows.json``, which engines and servers started on
that model read as its defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from span_workflows.errors import SpanQueryError

#: The variants of the link frontier, cheapest first, with their link blocks per span
#: (``bench quality``'s names; -1: every block but the last).
FRONTIER: dict[str, int] = {"prefix": 0, "prefix/link": 1, "prefix/link2": 2,
                            "prefix/link4": 4, "prefix/link-all": -1}
#: Points of accuracy a default may lose against the model's own stock answers, per cell.
TOLERANCE = 0.02


@dataclass(frozen=True)
class DefaultChoice:
    """The chosen variant, its span options, what it costs and keeps: ``worst_delta`` (the
    lowest accuracy difference to stock over the cells, with its cell), ``meets_target``
    (every cell within the tolerance), and every candidate's worst delta by name."""

    model: str
    variant: str
    options: dict[str, Any]
    worst_delta: float
    worst_cell: str
    meets_target: bool
    cells: int
    candidates: dict[str, float] = field(default_factory=dict)
    tolerance: float = TOLERANCE

    @property
    def link_blocks(self) -> int:
        """Link blocks per span of the chosen options."""
        return int(self.options["link_blocks"])

    def describe(self) -> str:
        """One line for people."""
        within = f"within {100 * self.tolerance:g} points of stock"
        verdict = (f"every cell {within}" if self.meets_target else
                   f"no variant keeps every cell {within}: the best reachable")
        return (f"{self.model}: {self.variant} ({verdict}; worst cell {self.worst_cell} "
                f"{100 * self.worst_delta:+.1f} points over {self.cells} cells)")


def choose_default(rows: list[dict[str, Any]], model: str,
                   tolerance: float = TOLERANCE) -> DefaultChoice:
    """The default of ``model`` from its ``bench quality`` rows (see the module docstring).
    Only variants measured in every cell that has a stock row compete. Raises
    :class:`~span_workflows.errors.SpanQueryError` if the rows hold no frontier of ``model``."""
    own = [r for r in rows if r.get("model") == model]
    cells = sorted({_cell(r) for r in own if r["variant"] == "stock"})
    worst: dict[str, tuple[float, str]] = {}
    for name in FRONTIER:
        found = {_cell(r): r for r in own if r["variant"] == name}
        if cells and all(c in found for c in cells):
            worst[name] = min((found[c]["delta_vs_stock"], c) for c in cells)
    if not worst:
        raise SpanQueryError("--choose-default", f"no link frontier of {model!r} measured in "
                                                 "every cell (run the prefix/link… variants)")
    keeping = [n for n in FRONTIER if n in worst and worst[n][0] >= -tolerance - 1e-9]
    order = list(FRONTIER)
    name = keeping[0] if keeping else max(worst, key=lambda n: (worst[n][0], -order.index(n)))
    links = FRONTIER[name]
    return DefaultChoice(model, name, {"attend": "prefix", "link_blocks": links},
                         worst[name][0], worst[name][1], bool(keeping), len(cells),
                         {n: w for n, (w, _) in worst.items()}, tolerance)


def write_default(model_dir: Path, choice: DefaultChoice) -> Path:
    """Record ``choice`` as the defaults of the model in ``model_dir`` (its
    ``span_workflows.json``, keeping what else that file holds). Refuses a directory that
    records span options of its own training (a span-ready model keeps them)."""
    from span_workflows.compiler.model import SPAN_DEFAULTS_FILE

    path = Path(model_dir) / SPAN_DEFAULTS_FILE
    if not (Path(model_dir) / "config.json").is_file():
        raise SpanQueryError("--write-default", f"{model_dir} is not a model directory (no "
                                                "config.json; a LoRA adapter records the "
                                                "options it was trained for instead)")
    record: dict[str, Any] = {}
    if path.is_file():
        record = json.loads(path.read_text())
        if record.get("span_ready") and "chosen_by" not in record:
            raise SpanQueryError("--write-default", f"{path} records the options the model "
                                                    "was trained for: it keeps them")
    record.update({"span_options": choice.options, "chosen_by": asdict(choice)})
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _cell(row: dict[str, Any]) -> str:
    return f"{row.get('size', 'short')}/{row['n_docs']}"


__all__ = ["FRONTIER", "TOLERANCE", "DefaultChoice", "choose_default", "write_default"]
