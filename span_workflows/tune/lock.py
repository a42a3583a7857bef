"""A training run announces itself, and benchmarks wait for it.

On a CPU a tuning run takes every core, and its threads wait on each other: one more process
computing beside it slows it several times over, and the run makes that process's timings
meaningless. While a segment trains, :func:`holding` keeps a small lock file in the cache
directory (``$SPAN_WORKFLOWS_CACHE/tune.lock``: the process id, the run's directory, when it
started; ``$SPAN_WORKFLOWS_TUNE_LOCK`` names another file); ``span-workflows bench`` calls
:func:`wait_for_training` first and waits until no live run holds it. A lock left by a
process that died is ignored and removed.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK_NAME = "tune.lock"
#: the environment variable naming the lock file instead (a test suite keeps its own)
LOCK_ENV = "SPAN_WORKFLOWS_TUNE_LOCK"


def lock_path() -> Path:
    """Where a training run's lock lives: ``$SPAN_WORKFLOWS_TUNE_LOCK``, else
    ``$SPAN_WORKFLOWS_CACHE/tune.lock``."""
    from span_workflows.compiler.model import cache_dir

    explicit = os.environ.get(LOCK_ENV)
    return Path(explicit) if explicit else cache_dir() / LOCK_NAME


@contextmanager
def holding(out: Path) -> Iterator[None]:
    """While entered, this process holds the lock as the run training into ``out``; the
    lock is removed on exit unless another run has taken it since."""
    path = lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "out": str(Path(out).resolve()),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    tmp = path.with_name(f"{LOCK_NAME}.{os.getpid()}")
    tmp.write_text(json.dumps(mine))
    tmp.replace(path)
    try:
        yield
    finally:
        if _read(path) == mine:
            path.unlink(missing_ok=True)


def running() -> dict[str, Any] | None:
    """The lock of a live training run in another process (``pid``, ``out``, ``started``),
    or ``None``. A lock whose process has died is removed."""
    path = lock_path()
    held = _read(path)
    if held is None or held.get("pid") == os.getpid():
        return None
    if not _alive(int(held.get("pid", 0))):
        path.unlink(missing_ok=True)
        return None
    return held


def wait_for_training(say: Callable[[str], None] = print, poll: float = 30.0,
                      timeout: float | None = None) -> float:
    """Wait until no live training run holds the lock (at most ``timeout`` seconds), saying
    once what it waits for; the seconds waited."""
    started = time.monotonic()
    told = False
    while (held := running()) is not None:
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            break
        if not told:
            say(f"waiting for the training run in {held['out']} (process {held['pid']}, "
                f"since {held['started']}) to end its segment: benchmarks beside it measure "
                f"neither (--no-wait to run anyway)")
            told = True
        time.sleep(poll if timeout is None else min(poll, max(timeout - waited, 0.0)))
    return time.monotonic() - started


def _read(path: Path) -> dict[str, Any] | None:
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is a training run (its command line says
    ``tune``; a recycled id belongs to something else)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return b"tune" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc here: a live process is taken at its word


__all__ = ["LOCK_NAME", "holding", "lock_path", "running", "wait_for_training"]
