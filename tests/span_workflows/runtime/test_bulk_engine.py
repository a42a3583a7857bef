"""Bulk execution on the real engine: answers in input order equal to each query run alone on
an empty cache, whatever the schedule; bad queries fail alone; the queries of a window that
miss the same documents compute them once; a resumed ``run --bulk`` asks only what is
missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from span_workflows.apps.cli.bulk_run import run_bulk_file
from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import rag, user
from span_workflows.query.ir import Plus
from span_workflows.query.json_ir import to_obj

pytestmark = pytest.mark.engine

SYSTEM = "Answer in a few words."
DOCS = [f"Note {i} is about the {t}. " + f"The {t} is described here at length. " * 4
        for i, t in enumerate(["harbor", "orchard", "comet", "violin", "glacier"])]
GOOD = [rag(SYSTEM, [DOCS[a], DOCS[b]], f"Question {i}: what is the first note about?",
            max_tokens=6)
        for i, (a, b) in enumerate([(0, 1), (2, 3), (1, 0), (3, 4)])]


def test_a_bulk_answers_each_query_as_it_runs_alone_and_bad_ones_fail_alone(engine) -> None:
    too_long = rag(SYSTEM, ["word " * 9000], "Too long?", max_tokens=4)
    queries = [GOOD[0], "{not json", GOOD[1], {"g": {"input": [{"user": "x"}],
                                                    "max_tokens": -3}},
               GOOD[2], Plus((user("a message, not a G"),)), too_long, GOOD[3]]
    engine.reset_cache()
    clustered = engine.execute_bulk(queries, schedule="cluster", max_in_flight=3)
    assert [a.index for a in clustered] == list(range(len(queries)))
    assert [a.ok for a in clustered] == [True, False, True, False, True, False, False, True]
    for bad in (1, 3, 5, 6):
        assert isinstance(clustered[bad].error, SpanQueryError)
    assert "max_tokens" in str(clustered[3].error) and "G" in str(clustered[5].error)
    assert "tokens" in str(clustered[6].error)
    texts = [a.result.text for a in clustered if a.ok]
    engine.reset_cache()
    given = engine.execute_bulk(GOOD, schedule="given", max_in_flight=2)
    assert [a.result.text for a in given] == texts
    alone = []
    for query in GOOD:
        engine.reset_cache()
        alone.append(engine.execute(query).text)
    assert texts == alone


def test_the_bulk_reads_the_cache_size_from_the_engine(engine) -> None:
    blocks = engine._engine.vllm_config.cache_config.num_gpu_blocks
    assert engine.cache_tokens == blocks * engine.block_size > 0


def test_queries_of_a_window_missing_the_same_documents_compute_them_once(engine) -> None:
    same = [rag(SYSTEM, [DOCS[4], DOCS[1], DOCS[2]], "Which note is first?", max_tokens=2),
            rag(SYSTEM, [DOCS[2], DOCS[4], DOCS[1]], "Which note is last?", max_tokens=2)]
    engine.reset_cache()
    one = engine.execute(same[0]).metrics.prepared_tokens
    engine.reset_cache()
    both = engine.execute_bulk(same, max_in_flight=2)
    assert one > 0
    assert sum(a.result.metrics.prepared_tokens for a in both) == one


def test_a_resumed_bulk_file_asks_only_the_missing_queries(engine, tmp_path: Path) -> None:
    queries, out = tmp_path / "queries.jsonl", tmp_path / "answers.jsonl"
    queries.write_text("".join(json.dumps(to_obj(q)) + "\n" for q in GOOD))
    asked: list[int] = []

    def runner(lines: list[str]):
        asked.append(len(lines))
        return engine.iter_bulk(lines, max_in_flight=2)

    first = run_bulk_file(runner, queries, out, progress=False)
    assert (first.answered, first.failed) == (4, 0)
    lines = out.read_text().splitlines()
    texts = {json.loads(line)["index"]: json.loads(line)["text"] for line in lines}
    kept = next(line for line in lines if json.loads(line)["index"] == 2)
    # an interrupted run: two answers written, the last one cut short
    out.write_text(kept + "\n" + lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    done_before = {2, json.loads(lines[0])["index"]}
    second = run_bulk_file(runner, queries, out, progress=False)
    assert asked == [4, 2] and second.already == 2
    answers = {json.loads(line)["index"]: line for line in out.read_text().splitlines()}
    assert sorted(answers) == [0, 1, 2, 3] and answers[2] == kept
    for index in set(range(4)) - done_before:  # asked again: the same answers
        assert json.loads(answers[index])["text"] == texts[index]
