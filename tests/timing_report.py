"""Regenerate the "Where the time goes" table of ``tests/README.md`` from a run's report.

    SPAN_TEST_REPORT=.test-report.json make test     # or: make test-report
    python tests/timing_report.py .test-report.json   # rewrites the table in tests/README.md

The table lies between the two marker comments below; everything else is left as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
START, END = "<!-- timing:start -->", "<!-- timing:end -->"
ROWS = 25


def table(report: dict) -> str:
    """The Markdown block: totals, then the ``ROWS`` slowest tests with their start-ups."""
    seconds: dict[str, float] = report["seconds_by_test"]
    starts: dict[str, int] = report["startups_by_test"]
    total = sum(seconds.values())
    lines = [f"{len(seconds)} tests, {total / 60:.1f} min of test time, "
             f"**{report['startups']} vLLM start-ups** (budget {report['budget']}).", "",
             "| test | seconds | vLLM start-ups |", "|---|---|---|"]
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:ROWS]
    for nodeid, s in slowest:
        lines.append(f"| `{nodeid}` | {s:.1f} | {starts.get(nodeid, 0) or ''} |")
    shown = {nodeid for nodeid, _ in slowest}
    others = {n: k for n, k in starts.items() if n not in shown}
    if others:
        lines += ["", "Other tests that started vLLM: " + ", ".join(
            f"`{n}` ({k})" for n, k in sorted(others.items()))]
    return "\n".join(lines)


def rewrite(readme: Path, report: dict) -> None:
    """Put :func:`table` between the markers of ``readme``."""
    text = readme.read_text()
    head, found, rest = text.partition(START)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"{readme}: the markers {START} and {END} are missing")
    readme.write_text(f"{head}{START}\n{table(report)}\n{END}{tail}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/timing_report.py REPORT.json", file=sys.stderr)
        return 2
    rewrite(README, json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
