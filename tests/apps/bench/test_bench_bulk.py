"""``bench bulk`` without an engine: the trace's shape (topics, Zipf popularity, k documents,
a working set of the asked size), the numbers of a row, the table and the plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from span_workflows.apps.bench.bulk import (
    PER_TOPIC,
    TraceShape,
    make_trace,
    markdown,
    measure,
    plot_rows,
    shape_for,
    working_set_tokens,
)
from span_workflows.runtime.result import BulkAnswer, Metrics, Result


def test_the_trace_reads_k_documents_mostly_from_one_popular_topic() -> None:
    shape = TraceShape(topics=10, queries=400, doc_tokens=100)
    trace = make_trace(shape)
    assert len(trace) == 400 and all(len(set(q)) == len(q) == 5 for q in trace)
    topics = [Counter(d // PER_TOPIC for d in q).most_common(1)[0] for q in trace]
    assert all(count >= shape.topic_docs for _, count in topics)
    popular = Counter(t for t, _ in topics)
    assert popular[0] > popular[9] * 2  # Zipf: the first topic is asked far more often
    assert make_trace(shape) == trace  # reproducible


def test_the_working_set_is_at_least_the_asked_share_of_the_cache() -> None:
    for ratio in (0.5, 4.0):
        shape = shape_for(ratio, 100, 3072, uses_per_doc=3)
        tokens = working_set_tokens(make_trace(shape), 100)
        assert tokens >= ratio * 3072
        assert shape.queries >= 16 and tokens < (ratio + 1.5) * 3072  # not far above


def _answer(i: int, cached: int, prepared: int, latency: float) -> BulkAnswer:
    return BulkAnswer(i, result=Result("x", Metrics(0.1, 100, cached, 2, latency_s=latency,
                                                    prepared_tokens=prepared)))


def test_a_row_counts_tokens_computed_hit_rate_and_latency(tmp_path: Path) -> None:
    answers = [_answer(0, 80, 60, 1.0), _answer(1, 90, 0, 3.0),
               BulkAnswer(2, error=ValueError("bad"))]
    row = measure(answers, wall_s=2.0, cpu_s=1.5)
    assert row["tokens_computed"] == (60 + 20) + (0 + 10)
    assert row["queries_per_cpu_s"] == 2.0
    assert row["hit_rate"] == round((20 + 90) / 200, 4)
    assert row["p50_latency_s"] == 2.0 and row["queries_per_s"] == 1.5 and row["failed"] == 1
    rows = [{"schedule": s, "engines": e, "doc_tokens": 100, "working_set_over_cache": 4.0,
             "queries": 3, "queries_per_s": q, "queries_per_cpu_s": q / 2, "hit_rate": 0.5,
             "tokens_computed": t,
             "p50_latency_s": 1.0, "same_answers": True}
            for s, e, q, t in (("given", 1, 1.0, 900), ("random", 1, 0.9, 950),
                               ("cluster", 1, 1.6, 500), ("cluster", 2, 2.0, 520))]
    table = markdown(rows)
    assert "| cluster | 1 | 3 | 1.600 | 1.60 | 0.800 | 1.60 | 1.00 |" in table
    assert "| cluster | 2 | 3 | 2.000 | 2.00 | 1.000 | 2.00 | 1.25 |" in table
    plot_rows(rows, tmp_path / "bulk.png")
    assert (tmp_path / "bulk.png").stat().st_size > 1000


def test_a_repeated_bulk_keeps_the_run_of_median_wall_time(monkeypatch) -> None:
    """Every bulk runs ``reps`` times, each on an empty cache: the run with the median wall
    time is the row's, the fastest and slowest its spread."""
    from span_workflows.apps.bench import bulk as bench_bulk
    from span_workflows.apps.bench.bulk import Setting, _timed_bulk

    now = [0.0]  # a clock that moves only when a bulk runs
    monkeypatch.setattr(bench_bulk.time, "perf_counter", lambda: now[0])

    class Engine:
        def __init__(self) -> None:
            self.resets, self.calls = 0, 0

        def reset_cache(self) -> None:
            self.resets += 1

        def execute_bulk(self, queries, **options):
            self.calls += 1
            now[0] += {1: 5.0, 2: 25.0, 3: 1.0}[self.calls]
            return [f"run {self.calls}"]

    engine = Engine()
    setting = Setting(100, 96, (0.5,), 3.0, 4, 0)
    run = _timed_bulk(engine, ["q"], "cluster", setting, reps=3)
    assert run.answers == ["run 1"] and run.wall_s == 5.0 and run.cpu_s >= 0
    assert run.walls == (1.0, 5.0, 25.0)
    assert run.spread() == {"queries_per_s_min": 0.04, "queries_per_s_max": 1.0}
    assert engine.resets == engine.calls == 3
