"""``span-workflows index``: a bad corpus or option is one clear line, before any engine starts
(the indexing itself runs on the real engine in
``tests/span_workflows/runtime/test_engine_store.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from span_workflows.apps.cli import main as cli
from span_workflows.runtime.store_index import read_corpus


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import span_workflows.runtime.engine as engine

    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started for a bad command")

    monkeypatch.setattr(engine, "Engine", refuse)


@pytest.mark.parametrize(("lines", "message"), [
    (['"a doc"', "{not json"], "corpus.jsonl:2: not JSON"),
    (['{"text": ""}'], "corpus.jsonl:1: expected a non-empty string"),
    (['{"text": "x", "source": 3}'], 'corpus.jsonl:1: "source" must be a string'),
    (["", "  "], "the corpus holds no document"),
])
def test_a_bad_corpus_names_its_line(tmp_path: Path, capsys, lines, message) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    assert cli.main(["index", str(corpus), "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_missing_corpus_and_bad_options_are_errors(tmp_path: Path, capsys) -> None:
    store = str(tmp_path / "s")
    assert cli.main(["index", str(tmp_path / "nope.jsonl"), "--store", store]) == 2
    assert "cannot read the corpus" in capsys.readouterr().err
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"one document"\n')
    assert cli.main(["index", str(corpus), "--store", store, "--batch-size", "0"]) == 2
    assert "--batch-size: must be at least 1" in capsys.readouterr().err
    assert cli.main(["index", str(corpus), "--store", store, "--store-gib", "-1"]) == 2
    assert "--store-gib: must be > 0" in capsys.readouterr().err


def test_corpus_lines_are_strings_or_objects_with_a_source(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"plain text"\n\n{"text": "with a source", "source": "a.md"}\n')
    docs = read_corpus(corpus)
    assert [d.text for d in docs] == ["plain text", "with a source"]
    assert [d.source for d in docs] == ["", "a.md"]


class _Metrics:
    prompt_tokens, cached_tokens = 10, 4


class _FakeEngine:
    """What ``index_documents`` uses of an engine: its router and ``execute_many``."""

    router = type("Router", (), {"span_adapter": None})()

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def execute_many(self, queries, **kwargs):
        self.calls.append({"queries": len(queries), **kwargs})
        return [type("Result", (), {"metrics": _Metrics()})() for _ in queries]


def test_index_documents_runs_under_the_tenants_cache_salt() -> None:
    """A tenant with a ``cache_salt`` indexes its own spans: its queries' blocks are keyed by
    the salt, so the indexing queries carry it too."""
    from span_workflows.runtime.store_index import index_documents

    engine = _FakeEngine()
    report = index_documents(engine, ["a", "b", "c"], "sys", batch_size=2, progress=False,
                             cache_salt="tenant-a")
    assert [c["cache_salt"] for c in engine.calls] == ["tenant-a", "tenant-a"]
    assert report.documents == 3 and report.computed_tokens == 18
    index_documents(engine, ["a"], "sys", progress=False)
    assert engine.calls[-1]["cache_salt"] is None


def test_index_takes_a_cache_salt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys) -> None:
    import span_workflows.runtime.engine as engine_module
    import span_workflows.runtime.store_index as span_store

    built: dict = {}
    indexed: dict = {}

    class Recorder:
        def __init__(self, model=None, **kwargs) -> None:
            built.update(model=model, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    def index_documents(engine, docs, system, **kwargs):
        indexed.update(engine=engine, docs=len(docs), system=system, **kwargs)
        return span_store.IndexReport(len(docs), 1, 1, 0.0)

    monkeypatch.setattr(engine_module, "Engine", Recorder)
    monkeypatch.setattr(span_store, "index_documents", index_documents)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"one"\n"two"\n')
    store = tmp_path / "s"
    assert cli.main(["index", str(corpus), "--store", str(store), "--cache-salt", "tenant-a"]) == 0
    assert indexed["cache_salt"] == "tenant-a" and indexed["docs"] == 2
    assert built["span_store"] == store
    assert cli.main(["index", str(corpus), "--store", str(store)]) == 0
    assert indexed["cache_salt"] is None
    assert cli.main(["index", str(corpus), "--store", str(store), "--cache-salt", ""]) == 2
    assert "--cache-salt: must be a non-empty string" in capsys.readouterr().err
