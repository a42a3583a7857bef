"""Tests for span_workflows.runtime.retrieval: the cached vector index."""

from __future__ import annotations

import pytest

from span_workflows.runtime.retrieval import Passage, VectorIndex, index_key

# -- the vector index ----------------------------------------------------------------------------
TEXTS = [
    "The json module serializes Python objects to JSON strings with dumps and parses them "
    "back with loads.",
    "The csv module reads and writes comma separated value files one row at a time.",
    "The datetime module supplies classes for manipulating dates and times, such as now().",
    "The gzip module compresses and decompresses files in the gzip format.",
]
SOURCES = ["json", "csv", "datetime", "gzip"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPAN_WORKFLOWS_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("query, expected", [
    ("convert a dictionary into a JSON text", "json"),
    ("iterate over the lines of a spreadsheet export", "csv"),
    ("what time is it right now", "datetime"),
    ("shrink a file with compression", "gzip"),
])
def test_from_texts_nearest_neighbour(cache, query, expected):
    index = VectorIndex.from_texts(TEXTS, SOURCES)
    hits = index.search(query, k=2)
    assert len(hits) == 2
    assert hits[0].source == expected
    scored = index.search_scored(query, k=4)
    assert [s for _, s in scored] == sorted((s for _, s in scored), reverse=True)


def test_index_is_cached_and_reused(cache):
    first = VectorIndex.from_texts(TEXTS, SOURCES)
    assert not first.loaded_from_cache
    assert first.path.parent == cache / "indexes"
    files = {name: (first.path / name).stat().st_mtime_ns
             for name in ("index.faiss", "passages.json")}
    second = VectorIndex.from_texts(TEXTS, SOURCES)
    assert second.loaded_from_cache
    assert second.path == first.path
    assert {n: (first.path / n).stat().st_mtime_ns for n in files} == files
    assert second.search("parse JSON", k=1)[0].source == "json"
    other = VectorIndex.from_texts(TEXTS[:2], SOURCES[:2])
    assert not other.loaded_from_cache and other.path != first.path


def test_index_key_covers_sources():
    a = [Passage("text", "a")]
    assert index_key(a) == index_key([Passage("text", "a")])
    assert index_key(a) != index_key([Passage("text", "b")])


def test_from_texts_defaults_and_errors(cache):
    index = VectorIndex.from_texts(TEXTS[:2])
    assert [p.source for p in index.passages] == ["text[0]", "text[1]"]
    assert len(index.search("csv rows", k=10)) == 2
    with pytest.raises(ValueError):
        VectorIndex.from_texts(TEXTS, SOURCES[:1])
    with pytest.raises(ValueError):
        VectorIndex.from_texts([])
