"""Counting what a test run starts: every vLLM engine core (in any process: the in-process
engine, servers, CLI subprocesses, notebook kernels, Ray actors) and the time of each test.

The plugin appends one line to the file named by ``span_vllm.contract.START_LOG_ENV`` when an
engine core starts; ``conftest.py`` points it at a file of this session, attributes each new
line to the test that was running (a session or module fixture's start goes to the first test
that asked for it), prints the count at the end and, with ``SPAN_TEST_REPORT=path``, writes a
JSON report that ``tests/timing_report.py`` turns into the table of ``tests/README.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The most vLLM start-ups a full run should need (the suite prints the count against it).
STARTUP_BUDGET = 8


@dataclass
class StartupCounter:
    """Engine-core starts read from ``log`` (one line each), attributed to tests."""

    log: Path
    by_test: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def count(self) -> int:
        """Engine-core starts so far in this run."""
        try:
            with open(self.log, "rb") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def attribute(self, nodeid: str, before: int) -> None:
        """Give ``nodeid`` the starts since ``before``."""
        grew = self.count() - before
        if grew > 0:
            self.by_test[nodeid] = self.by_test.get(nodeid, 0) + grew

    def add_time(self, nodeid: str, seconds: float) -> None:
        """Add one phase (setup, call, teardown) of ``nodeid`` to its time."""
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + seconds

    def summary_lines(self) -> list[str]:
        """What the terminal summary prints: the count against the budget, then by test."""
        total = self.count()
        lines = [f"{total} vLLM engine start-ups in this run (budget {STARTUP_BUDGET})"]
        lines += [f"  {n}  {nodeid}" for nodeid, n in
                  sorted(self.by_test.items(), key=lambda kv: (-kv[1], kv[0]))]
        return lines

    def report(self) -> dict[str, Any]:
        """The JSON report: total starts, starts by test, seconds by test."""
        return {"startups": self.count(), "budget": STARTUP_BUDGET,
                "startups_by_test": self.by_test, "seconds_by_test": self.seconds}

    def write_report(self, path: Path) -> None:
        """Write :meth:`report` to ``path``."""
        path.write_text(json.dumps(self.report(), indent=1) + "\n")
