"""Tables and plots of benchmark rows (lists of flat dicts), for every benchmark."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def print_table(rows: list[dict[str, Any]], console: Callable[[str], None] = print) -> None:
    """A plain aligned table of ``rows``."""
    if not rows:
        return
    keys = list(rows[0])
    cells = [[_fmt(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    console("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for c in cells:
        console("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["plot", "print_table"]
