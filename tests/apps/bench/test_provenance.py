"""Benchmark rows say where they come from: commit, machine, model directory, adapters."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

from span_workflows.apps.bench.provenance import QUIET_FIELDS, commit, machine, provenance
from span_workflows.apps.bench.report import print_table


def test_a_row_names_its_commit_machine_model_and_adapters() -> None:
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", commit())
    assert "torch " in machine() and re.search(r" x\d+", machine())
    engine = SimpleNamespace(model_name="smollm2-135m-instruct",
                             model_dir="/cache/smollm2-135m-instruct-b179c9523d0e6a0f",
                             router=SimpleNamespace(adapters={
                                 "span": SimpleNamespace(digest="ab" * 32)}))
    fields = provenance(engine, reps=3)
    assert fields["reps"] == 3 and fields["model"] == "smollm2-135m-instruct"
    assert fields["model_dir"] == "smollm2-135m-instruct-b179c9523d0e6a0f"
    assert fields["adapters"] == {"span": "ab" * 32}
    assert set(provenance()) == {"commit", "machine"}


def test_a_bench_that_read_every_answer_still_names_its_model(tmp_path) -> None:
    checkpoint = tmp_path / "my-model-0123abcd"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    fields = provenance(reps=3, model=str(checkpoint))
    assert fields["model"] == str(checkpoint)
    assert fields["model_dir"] == "my-model-0123abcd"
    assert "adapters" not in fields
    from span_workflows.apps.bench.provenance import stamp

    [row] = stamp([{"engines": 2, "reps": 3}], model=str(checkpoint))  # engines of Ray actors
    assert row["model_dir"] == "my-model-0123abcd" and row["reps"] == 3


def test_printed_tables_leave_provenance_to_the_json() -> None:
    lines: list[str] = []
    print_table([{"n_docs": 1, **provenance(reps=2)}], lines.append)
    assert "n_docs" in lines[0] and "reps" in lines[0]
    assert not any(field in lines[0] for field in QUIET_FIELDS)


def test_stamp_adds_provenance_and_keeps_a_rows_own_reps() -> None:
    from span_workflows.apps.bench.provenance import stamp

    rows = stamp([{"n_docs": 1}, {"n_docs": 2, "reps": 1}], reps=3)
    assert [r["reps"] for r in rows] == [3, 1]
    assert all(r["commit"] == commit() and r["machine"] == machine() for r in rows)


#: Answer caches, not tables: each entry's key names the model it was answered by.
ANSWER_CACHES = {"lint_checks.json", "quality_answers.json"}


def _rows(data: object) -> list[dict]:
    """A results file's rows: its list, its ``provenance`` record, its lists of rows (one file
    may hold several tables), or the file itself."""
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict)]
    assert isinstance(data, dict)
    if "provenance" in data:
        return [data["provenance"]]
    tables = [v for v in data.values()
              if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
    return [r for table in tables for r in table] or [data]


def test_every_committed_table_names_its_commit_machine_and_the_model_it_timed() -> None:
    """Every row of every committed table: its commit (never a dirty tree's), machine and
    repetitions, and the model it ran; a row whose model is a checkpoint names the checkpoint's
    cached directory (its checksum). Only a simulation runs no model (``model`` is null), and
    the repositioning rows time SmolLM2's KV shapes on random values (no checkpoint read)."""
    from span_workflows.apps.bench.options import RESULTS

    checked = set()
    for path in sorted(RESULTS.glob("*.json")):
        if path.name in ANSWER_CACHES:
            continue
        rows = _rows(json.loads(path.read_text()))
        checked.add(path.name)
        for row in rows:
            where = (path.name, {k: row.get(k) for k in ("commit", "mode", "model")})
            assert {"commit", "machine", "reps", "model"} <= set(row), where
            assert not row["commit"].endswith("+dirty"), where
            if row["model"] is None:
                assert row.get("mode") == "sim", where
            elif "KV shapes" not in row["model"]:
                assert "model_dir" in row, where
    assert checked, f"no results in {RESULTS}"
