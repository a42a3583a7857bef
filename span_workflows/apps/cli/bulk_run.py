"""``span-workflows run --bulk queries.jsonl --out answers.jsonl``: a bulk from a file, resumable.

The input holds one span query per non-blank line (bare, or wrapped with its own options as the
HTTP API takes it); query ``i`` is the ``i``-th non-blank line. Every answer is appended to
``--out`` as soon as it is ready, as the HTTP bulk route writes it (``{"index": i, "text", ...}``
or ``{"index": i, "error": {...}}``, :mod:`span_workflows.serving.wire`). Run again with the same
``--out``, a bulk asks only what is not answered yet: the answers there are kept as they are
(and not asked again); error lines and a last line cut short by an interruption are dropped and
their queries asked again. A progress bar shows queries per second and the cache hit rate (the
share of the answered prompts' tokens read from the cache that their own query did not compute).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from span_workflows.errors import SpanQueryError
from span_workflows.runtime.result import BulkAnswer
from span_workflows.serving import wire

#: Runs a bulk of JSON lines; yields answers indexed within those lines, as they are ready.
BulkRunner = Callable[[list[str]], Iterator[BulkAnswer]]


@dataclass(frozen=True)
class BulkReport:
    """What one ``run --bulk`` did: queries in the input, answered before this run, asked
    now, answered now, failed now; the hit rate of this run's answers."""

    total: int
    already: int
    asked: int
    answered: int
    failed: int
    hit_rate: float


def read_queries(path: Path) -> list[str]:
    """The query lines of ``path`` (non-blank lines, stripped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpanQueryError(str(path), f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SpanQueryError(str(path), f"not UTF-8 text ({exc.reason})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def answered_lines(path: Path, total: int) -> dict[int, str]:
    """The answer lines of an earlier run in ``path``, by index (answers only: no errors, no
    line cut short, no index outside ``range(total)``; the last of a repeated index)."""
    if not path.exists():
        return {}
    done: dict[int, str] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        index = data.get("index") if isinstance(data, dict) else None
        if (isinstance(index, int) and not isinstance(index, bool) and 0 <= index < total
                and "error" not in data and "text" in data):
            done[index] = line
    return done


def run_bulk_file(runner: BulkRunner, queries_path: Path, out_path: Path, *,
                  progress: bool = True, stream: TextIO | None = None) -> BulkReport:
    """Answer the queries of ``queries_path`` not yet answered in ``out_path`` with
    ``runner``, appending each answer as it is ready (see the module docstring)."""
    from tqdm.auto import tqdm

    lines = read_queries(queries_path)
    done = answered_lines(out_path, len(lines))
    _rewrite(out_path, [done[i] for i in sorted(done)])
    todo = [i for i in range(len(lines)) if i not in done]
    answered = failed = 0
    reused = prompt = 0
    bar = tqdm(total=len(lines), initial=len(done), unit="q", desc="bulk", disable=not progress,
               file=stream or sys.stderr, dynamic_ncols=True)
    try:
        with out_path.open("a", encoding="utf-8") as out:
            if todo:
                for local in runner([lines[i] for i in todo]):
                    answer = BulkAnswer(todo[local.index], local.result, local.error)
                    out.write(wire.bulk_answer_line(answer).decode())
                    out.flush()
                    if answer.result is not None:
                        answered += 1
                        reused += answer.result.metrics.reused_tokens
                        prompt += answer.result.metrics.prompt_tokens
                    else:
                        failed += 1
                    bar.update(1)
                    bar.set_postfix(hit=f"{reused / prompt:.2f}" if prompt else "-",
                                    failed=failed, refresh=False)
    finally:
        bar.close()
    return BulkReport(len(lines), len(done), len(todo), answered, failed,
                      reused / prompt if prompt else 0.0)


def _rewrite(path: Path, lines: Sequence[str]) -> None:
    """``path`` holding exactly ``lines`` (written beside it, then moved into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    os.replace(partial, path)


def summary(report: BulkReport, out_path: Path) -> str:
    """The line the command prints at the end."""
    return (f"{report.total} queries: {report.already} answered before, {report.asked} asked "
            f"now ({report.answered} answered, {report.failed} failed), hit rate "
            f"{report.hit_rate:.2f}; answers in {out_path}")


__all__ = ["BulkReport", "BulkRunner", "answered_lines", "read_queries", "run_bulk_file",
           "summary"]
