"""Tables and plots of benchmark rows (lists of flat dicts), for every benchmark."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from span_workflows.apps.bench.provenance import QUIET_FIELDS


def print_table(rows: list[dict[str, Any]], console: Callable[[str], None] = print) -> None:
    """A plain aligned table of ``rows``: a column for every key any row has (in the order
    they first appear), ``–`` where a row lacks it (rows of earlier runs may have more);
    the provenance fields (commit, machine, checksums) stay in the JSON only."""
    if not rows:
        return
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in QUIET_FIELDS]
    cells = [[_fmt(r[k]) if k in r else "–" for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    console("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        console("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of ``successes / n`` as ``(low, high)``
    (``(0, 1)`` when ``n`` is 0: nothing is known)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # The interval holds p exactly (at p = 0 or 1, centre ± half misses it by rounding).
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if value < 100 else f"{value:.1f}"
    return str(value)


def plot(rows: list[dict[str, Any]], x: str, ys: Sequence[str], path: Path, title: str,
         ylabel: str, log: bool = True) -> None:
    """A line plot of columns ``ys`` against ``x`` saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for y in ys:
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o", label=y)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def save_figure(fig: Any, path: Path | str, dpi: int = 120) -> None:
    """Lay out ``fig``, write it as a PNG to ``path`` (its folder made if missing) and close
    it (matplotlib keeps open figures alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


__all__ = ["plot", "print_table", "save_figure", "wilson"]
