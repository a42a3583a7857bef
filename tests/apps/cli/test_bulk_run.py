"""``run --bulk`` file handling without an engine: answers appended as they come, a resumed run
asks only what is missing, error lines and a line cut short are asked again; the command's
user mistakes are one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from span_workflows.apps.cli.bulk_run import answered_lines, run_bulk_file
from span_workflows.errors import SpanQueryError
from span_workflows.runtime.result import BulkAnswer, Metrics, Result
from span_workflows.serving import wire


class Recorder:
    """A runner answering each line with its own text; remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def __call__(self, lines: list[str]):
        self.asked.append(list(lines))
        for i in reversed(range(len(lines))):  # out of order, as a bulk answers
            if "bad" in lines[i]:
                yield BulkAnswer(i, error=SpanQueryError("", "bad query"))
            else:
                yield BulkAnswer(i, result=Result(lines[i], Metrics(0.0, 10, 6, 1,
                                                                    prepared_tokens=2)))


def write_queries(path: Path, count: int, bad: int | None = None) -> None:
    lines = [("bad" if i == bad else f"q{i}") for i in range(count)]
    path.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")


def read_answers(path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["index"] for r in rows}) == len(rows), "an index answered twice"
    return {r["index"]: r for r in rows}


def test_a_bulk_file_is_answered_with_indices_and_errors(tmp_path: Path) -> None:
    queries, out = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    write_queries(queries, 5, bad=3)
    runner = Recorder()
    report = run_bulk_file(runner, queries, out, progress=False)
    answers = read_answers(out)
    assert sorted(answers) == [0, 1, 2, 3, 4]  # blank lines do not count
    assert answers[2]["text"] == "q2" and answers[3]["error"]["type"] == "invalid_query"
    assert (report.answered, report.failed, report.already) == (4, 1, 0)
    assert report.hit_rate == 0.4  # (6 cached - 2 prepared) / 10 prompt tokens


def test_a_resumed_run_asks_only_what_is_not_answered(tmp_path: Path) -> None:
    queries, out = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    write_queries(queries, 6)
    earlier = [wire.bulk_answer_line(BulkAnswer(1, result=Result("from before",
                                                                 Metrics(0, 1, 0, 1)))),
               wire.bulk_answer_line(BulkAnswer(4, error=SpanQueryError("", "was down"))),
               wire.bulk_answer_line(BulkAnswer(0, result=Result("kept", Metrics(0, 1, 0, 1))))]
    out.write_bytes(b"".join(earlier) + b'{"index": 5, "text": "cut sh')  # interrupted
    assert sorted(answered_lines(out, 6)) == [0, 1]
    runner = Recorder()
    report = run_bulk_file(runner, queries, out, progress=False)
    assert runner.asked == [["q2", "q3", "q4", "q5"]]
    answers = read_answers(out)
    assert sorted(answers) == list(range(6))
    assert answers[1]["text"] == "from before" and answers[0]["text"] == "kept"
    assert answers[4]["text"] == "q4" and answers[5]["text"] == "q5"
    assert (report.already, report.asked) == (2, 4)
    # once everything is answered, nothing is asked
    again = Recorder()
    assert run_bulk_file(again, queries, out, progress=False).asked == 0
    assert again.asked == [] and sorted(read_answers(out)) == list(range(6))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "span_workflows.apps.cli.main", *args],
                          capture_output=True, text=True, timeout=300)


def test_bulk_mistakes_are_one_line_and_status_2(tmp_path: Path) -> None:
    queries = tmp_path / "q.jsonl"
    write_queries(queries, 2)
    for args, words in ((["--bulk", str(tmp_path / "missing.jsonl"), "--out", "x"], "cannot"),
                        (["--bulk", str(queries)], "--out"),
                        (["--bulk", str(queries), "--out", "x", "--max-in-flight", "0"],
                         "max-in-flight"),
                        ([], "no query files")):
        done = _cli("run", *args)
        assert done.returncode == 2, done.stderr
        assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
