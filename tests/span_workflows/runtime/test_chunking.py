"""Passages sized to KV blocks: the chunker's windows, and its measure against the compiler."""

from __future__ import annotations

import pytest

from span_workflows import optimize, rag
from span_workflows.compiler.compile import Compiler
from span_workflows.errors import SpanQueryError
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.chunking import BlockChunker

BS = 32


def _chars(text: str) -> list[int]:
    """A toy encoding: one token per character."""
    return [ord(c) for c in text]


def test_windows_are_the_longest_runs_that_fit() -> None:
    chunker = BlockChunker(_chars, overhead=5, block_size=8, blocks=2)  # 16 tokens, 11 of text
    words = ["aaa", "bb", "c", "dddd", "ee", "f", "gggggg", "h"]
    windows = [list(w) for w in chunker.windows(words)]
    assert [w for window in windows for w in window] == words
    for i, window in enumerate(windows):
        assert chunker.span_tokens(" ".join(window)) <= chunker.limit
        if i + 1 < len(windows):  # one more word would not fit
            longer = " ".join([*window, windows[i + 1][0]])
            assert chunker.span_tokens(longer) > chunker.limit
    assert chunker.split(" aaa  bb\nc ") == ["aaa bb c"]


def test_a_word_longer_than_the_blocks_is_a_passage_of_its_own() -> None:
    chunker = BlockChunker(_chars, overhead=2, block_size=4, blocks=1)
    assert chunker.split("ab " + "x" * 9 + " cd") == ["ab", "x" * 9, "cd"]
    assert chunker.split("") == []


def test_padding_is_what_reaches_the_next_block() -> None:
    chunker = BlockChunker(_chars, overhead=3, block_size=8)
    assert [chunker.padding("x" * n) for n in (5, 6, 13, 14)] == [0, 7, 0, 7]


@pytest.mark.parametrize("blocks", [0, -1, 1.5, True])
def test_bad_block_counts_are_refused(blocks) -> None:
    with pytest.raises(SpanQueryError, match="blocks"):
        BlockChunker(_chars, overhead=1, block_size=8, blocks=blocks)


def test_a_template_larger_than_the_blocks_is_refused() -> None:
    with pytest.raises(SpanQueryError, match="no room"):
        BlockChunker(_chars, overhead=8, block_size=8, blocks=1)


@pytest.mark.parametrize("marker", [False, True])
def test_the_chunkers_measure_is_the_compilers_layout(tokenizer, marker) -> None:
    """Every passage the chunker cuts is laid out by the compiler in exactly the span length
    and padding the chunker says: it measures what the engine will compute."""
    options = SpanOptions(marker=marker)
    compiler = Compiler.for_tokenizer(tokenizer, BS, options=options)
    chunker = BlockChunker.for_compiler(compiler, blocks=3)
    text = ("The json module serializes Python objects: json.dumps(obj, *, indent=None) "
            "returns a str, while json.dump writes to a file-like object. Decoding with "
            "json.loads(s) gives dict, list, str, int, float, True, False or None. ") * 6
    passages = chunker.split(text)
    assert len(passages) >= 3 and " ".join(passages) == " ".join(text.split())
    tq = compiler.compile_generate(optimize(rag("Be brief.", passages, "What is dumps?")),
                                   options=options)
    spans = [s for s in tq.spans if s.kind == "plus"]
    assert len(spans) == len(passages)
    by_text = {chunker.span_tokens(p): chunker.padding(p) for p in passages}
    for span in spans:
        assert span.content_tokens in by_text
        assert span.length - span.content_tokens == by_text[span.content_tokens]
        assert span.length <= chunker.limit
    # All but the last passage end within a word of the block boundary.
    assert all(chunker.padding(p) < 8 for p in passages[:-1])
