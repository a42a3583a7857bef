"""The one progress indicator the command line shows while the engine loads."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def engine_loading(stream: TextIO | None = None,
                   what: str = "starting the engine") -> Iterator[None]:
    """Show that the engine is loading while the ``with`` body runs: on a terminal rich's
    spinner with the seconds elapsed, erased at the end; otherwise one line."""
    out = stream or sys.stderr
    if not out.isatty():
        print(f"span-workflows: {what}...", file=out, flush=True)
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=out), transient=True) as progress:
        progress.add_task(what, total=None)
        yield


__all__ = ["engine_loading"]
