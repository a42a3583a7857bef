"""``span-workflows run --span-store``: the embedded engine of ``run`` (one query after another,
or a bulk) opens the span store it is given; the engine itself is stood in for (only the
arguments it is built with are checked; the store on the real engine is
``tests/span_workflows/runtime/test_engine_store.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from span_workflows import rag, to_json
from span_workflows.apps.cli import main as cli
from span_workflows.errors import SpanQueryError


@pytest.fixture()
def built(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The keyword arguments the command builds its engine with (the build then stops the
    command: exit status 2)."""
    import span_workflows.apps.cli.precheck as precheck
    import span_workflows.runtime.engine as engine_module

    got: dict = {}

    def engine(model=None, **kwargs):
        got.update(model=model, **kwargs)
        raise SpanQueryError("engine", "not started in this test")

    monkeypatch.setattr(engine_module, "Engine", engine)
    monkeypatch.setattr(precheck, "check_queries", lambda *args, **kwargs: None)
    return got


def _query(tmp_path: Path) -> Path:
    path = tmp_path / "q.json"
    path.write_text(to_json(rag("Answer.", ["A document."], "Which?", max_tokens=4)))
    return path


def test_run_opens_the_span_store(tmp_path: Path, built: dict) -> None:
    store = tmp_path / "spans"
    assert cli.main(["run", str(_query(tmp_path)), "--span-store", str(store),
                     "--span-store-gib", "1.5"]) == 2
    assert built["span_store"] == store and built["span_store_gib"] == 1.5
    built.clear()
    assert cli.main(["run", str(_query(tmp_path))]) == 2
    assert built["span_store"] is None and built["span_store_gib"] is None


def test_a_bulk_run_opens_the_span_store(tmp_path: Path, built: dict) -> None:
    queries = tmp_path / "q.jsonl"
    queries.write_text(_query(tmp_path).read_text().replace("\n", " ") + "\n")
    store = tmp_path / "spans"
    assert cli.main(["run", "--bulk", str(queries), "--out", str(tmp_path / "a.jsonl"),
                     "--span-store", str(store)]) == 2
    assert built["span_store"] == store and built["span_store_gib"] is None


@pytest.mark.parametrize(("extra", "message"), [
    (["--server", "http://127.0.0.1:9"], "--span-store: "),
    (["--span-store-gib", "2"], "--span-store-gib: needs --span-store"),
])
def test_span_store_options_that_cannot_apply_are_errors(tmp_path: Path, built: dict, capsys,
                                                         extra: list[str], message: str
                                                         ) -> None:
    args = ["run", str(_query(tmp_path)), *extra]
    if "--server" in extra:
        args += ["--span-store", str(tmp_path / "spans")]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not built  # before any engine
