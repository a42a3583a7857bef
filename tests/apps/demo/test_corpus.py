"""Tests for span_workflows.apps.demo.corpus: chunking and the stdlib corpus."""

from __future__ import annotations

import pytest

from span_workflows.apps.demo.corpus import (
    MAX_WORDS,
    MIN_WORDS,
    STDLIB_MODULES,
    block_documents,
    chunk_documents,
    chunk_words,
    stdlib_passages,
    word_count,
)
from span_workflows.compiler.compile import Compiler
from span_workflows.runtime.chunking import BlockChunker
from span_workflows.runtime.retrieval import Passage


def _words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


# -- chunking ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 59, 60, 120, 121, 239, 240, 241, 1000])
def test_chunk_words_bounds_and_coverage(n):
    text = _words(n)
    pieces = chunk_words(text)
    assert all(word_count(p) <= MAX_WORDS for p in pieces)
    assert " ".join(pieces) == text
    if n > MAX_WORDS:
        assert all(word_count(p) >= MIN_WORDS for p in pieces)
    else:
        assert pieces == [text]


def test_chunk_words_collapses_whitespace():
    assert chunk_words("a\n\n  b\tc ") == ["a b c"]
    assert chunk_words("   ") == []


def test_chunk_documents_long_docs_keep_their_source():
    docs = [("m.long", _words(250, "x")), ("m.mid", _words(80, "y"))]
    out = chunk_documents(docs, group="m")
    assert [p.source for p in out] == ["m.long", "m.long", "m.long", "m.mid"]
    assert all(MIN_WORDS <= word_count(p.text) <= MAX_WORDS for p in out)


def test_chunk_documents_packs_short_docs():
    docs = [(f"m.f{i}", _words(25, f"f{i}_")) for i in range(5)]
    out = chunk_documents(docs, group="m")
    # 25+25+25 reaches 60 → one packed passage; 25+25 left over merges into it (125 > 120: no).
    assert out[0].source == "m: f0, f1, f2"
    assert word_count(out[0].text) == 75
    assert out[1].source == "m: f3, f4"
    assert word_count(out[1].text) == 50
    assert all(word_count(p.text) <= MAX_WORDS for p in out)


def test_chunk_documents_merges_small_remainder():
    docs = [(f"m.f{i}", _words(30, f"f{i}_")) for i in range(2)] + [("m.tail", "one two")]
    out = chunk_documents(docs, group="m")
    assert len(out) == 1
    assert out[0].source == "m: f0, f1, tail"
    assert out[0].text.endswith("one two")


def test_chunk_documents_single_short_doc_keeps_plain_source():
    assert chunk_documents([("m.only", "short doc")], group="m") == [Passage("short doc", "m.only")]


# -- the stdlib corpus ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus() -> list[Passage]:
    return stdlib_passages()


def test_stdlib_corpus_size_and_determinism(corpus):
    assert len(corpus) >= 200
    assert stdlib_passages() == corpus
    assert len(set(corpus)) > 0.95 * len(corpus)


def test_stdlib_passage_lengths(corpus):
    assert all(0 < word_count(p.text) <= MAX_WORDS for p in corpus)
    short = [i for i, p in enumerate(corpus) if word_count(p.text) < MIN_WORDS]
    # Only a module's last passage may fall short of MIN_WORDS.
    for i in short:
        module = corpus[i].source.split(":")[0]
        if i + 1 < len(corpus):
            assert corpus[i + 1].source.split(":")[0] != module
    assert len(short) < 0.1 * len(corpus)


def test_stdlib_sources(corpus):
    sources = {p.source for p in corpus}
    assert {"json", "json.dumps", "csv.reader"} <= sources
    prefixes = tuple(STDLIB_MODULES)
    assert all(p.source.startswith(prefixes) for p in corpus)
    modules = {m for m in STDLIB_MODULES if any(p.source.startswith(m) for p in corpus)}
    assert len(modules) >= 55
    assert not any(" at 0x" in p.text for p in corpus)


# -- passages sized to KV blocks -----------------------------------------------------------------
def test_block_documents_keep_every_word_in_order_and_name_their_sources():
    chunker = BlockChunker(lambda text: text.split(), overhead=2, block_size=4, blocks=3)
    docs = [("m.a", _words(4, "a")), ("m.b", _words(25, "b")), ("m.c", "c0")]
    out = block_documents(docs, chunker, group="m")
    assert " ".join(p.text for p in out) == " ".join(text for _, text in docs)
    assert all(len(p.text.split()) == 10 for p in out[:-1])  # 12-token blocks, 2 of template
    assert out[0].source == "m: a, b"
    assert out[1].source == "m.b"
    assert out[-1].source == "m: b, c"


def test_stdlib_passages_to_blocks_pad_a_fraction_of_word_chunks(tokenizer):
    """The demo's index: passages cut to 5 blocks of 32 tokens pad about 3 tokens each where
    the word chunks pad half a block; same text, about as many passages."""
    chunker = BlockChunker.for_compiler(Compiler.for_tokenizer(tokenizer, 32), blocks=5)
    blocks, corpus = stdlib_passages(chunker=chunker), stdlib_passages()
    assert stdlib_passages(chunker=chunker) == blocks
    mean = lambda ps: sum(chunker.padding(p.text) for p in ps) / len(ps)  # noqa: E731
    assert mean(blocks) < 4 < 12 < mean(corpus)
    assert 0.8 < len(blocks) / len(corpus) < 1.25
    assert all(chunker.span_tokens(p.text) <= chunker.limit for p in blocks)
    assert sum(map(word_count, (p.text for p in blocks))) == sum(
        map(word_count, (p.text for p in corpus)))
    assert {"json", "csv: field_size_limit, reader, writer"} <= {p.source for p in blocks}
