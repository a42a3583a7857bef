"""``span-workflows index``: a bad corpus or option is one clear line, before any engine starts
(the indexing itself runs on the real engine in ``tests/span_workflows/test_engine_store.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from span_workflows.apps.cli import main as cli
from span_workflows.span_store import read_corpus


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import span_workflows.engine as engine

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
