"""What a process leaves behind: child processes and shared-memory files (``/dev/shm``), for the
tests that check an engine shuts down cleanly."""

from __future__ import annotations

import os
from pathlib import Path

#: Run a command of ``span-workflows`` as a user does (``python -c REPORT_AFTER_CLI REPORT ARGS``),
#: then write to the file REPORT what the process still holds once the command has returned:
#: live child processes and mapped ``/dev/shm`` files (unlinked semaphores, "(deleted)", aside).
REPORT_AFTER_CLI = r"""
import gc, json, sys
import psutil
from span_workflows.apps.cli.main import main
report, argv = sys.argv[1], sys.argv[2:]
code = main(argv)
gc.collect()
me = psutil.Process()
with open("/proc/self/maps") as maps:
    mapped = sorted({line.split(None, 5)[-1] for line in maps.read().splitlines()
                     if "/dev/shm/" in line and not line.endswith("(deleted)")})
with open(report, "w") as out:
    json.dump({"children_after": [c.pid for c in me.children(recursive=True)
                                  if c.status() != psutil.STATUS_ZOMBIE],
               "shm_mapped_after": mapped}, out)
sys.exit(code)
"""


def shm_names() -> set[str]:
    """The files in ``/dev/shm`` now (none where it does not exist)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_by_others(names: set[str]) -> set[str]:
    """Shared-memory names some other live process maps or holds open (concurrent users)."""
    held = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        try:
            text += "\n".join(os.readlink(f"/proc/{pid}/fd/{fd}")
                              for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass  # another user's process, or gone: its maps were read
        held |= {n for n in names if f"/dev/shm/{n}" in text}
    return held


def leaked_since(before: set[str]) -> set[str]:
    """Shared-memory files created since ``before`` that no live process maps or holds."""
    new = shm_names() - before
    return new - mapped_by_others(new)
