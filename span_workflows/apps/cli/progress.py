"""The one progress indicator the command line shows while the engine loads."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

FRAMES = "|/-\\"


@contextmanager
def engine_loading(stream: TextIO | None = None,
                   what: str = "starting the engine") -> Iterator[None]:
    """Show that the engine is loading while the ``with`` body runs: on a terminal a spinner
    with the seconds elapsed, rewritten in place and erased at the end; otherwise one line."""
    out = stream or sys.stderr
    if not out.isatty():
        print(f"span-workflows: {what}...", file=out, flush=True)
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def spin() -> None:
        i = 0
        while not done.wait(0.2):
            out.write(f"\r{FRAMES[i % len(FRAMES)]} {what} ({time.monotonic() - started:.0f} s)")
            out.flush()
            i += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        out.write("\r\033[K")
        out.flush()


__all__ = ["engine_loading"]
