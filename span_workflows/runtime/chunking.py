"""Passages sized to KV blocks: chunk text so that, as a plus span, it fills its last block.

A plus span starts a KV block and fills whole blocks (:mod:`span_workflows.query.span_options`), so
the compiler pads every document to the next block boundary. Those pad tokens are computed on a
miss and kept in the cache like the document's own: a retriever whose passages end anywhere
pays half a block per passage on average (16 tokens at vLLM's CPU block of 32), which on
passages of ~150 tokens is about a tenth of what stock computes for the same prompt.

:class:`BlockChunker` measures a text the way the compiler lays it out (the chat template's
tokens around it included) and cuts text at word boundaries into passages of at most
``blocks`` blocks, each as full as the next word allows: padding of a few tokens instead of
half a block. Get one for an engine with :meth:`span_workflows.runtime.engine.Engine.chunker`, or
for a tokenizer with :meth:`BlockChunker.for_compiler`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from span_workflows.compiler.compile import Compiler
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import User
from span_workflows.query.span_options import SpanOptions


@dataclass(frozen=True, slots=True)
class BlockChunker:
    """Cuts text into passages of at most ``blocks`` KV blocks of ``block_size`` tokens.

    ``encode`` gives a text's content tokens as the compiler encodes them; ``overhead`` is the
    number of tokens the layout adds around a document's text (template, marker).
    """

    encode: Callable[[str], Sequence[int]]
    overhead: int
    block_size: int
    blocks: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, int) or isinstance(self.blocks, bool) or self.blocks < 1:
            raise SpanQueryError("blocks", f"must be a positive integer, not {self.blocks!r}")
        if self.block_size < 1 or self.overhead < 0:
            raise SpanQueryError("block_size", "must be positive (and the overhead >= 0)")
        if self.overhead >= self.limit:
            raise SpanQueryError("blocks", f"{self.blocks} block(s) of {self.block_size} "
                                           f"tokens leave no room for text after the "
                                           f"{self.overhead} tokens of the span's template")

    @classmethod
    def for_compiler(cls, compiler: Compiler, blocks: int = 4,
                     options: SpanOptions | None = None) -> BlockChunker:
        """The chunker of ``compiler``'s tokenizer, chat template and block size, for spans
        laid out with ``options`` (default: the compiler's)."""
        options = options or compiler.options
        renderer = compiler.renderer
        probe = "x"
        chunk, _ = renderer.span_chunk_parts([User(probe)])
        overhead = len(chunk) - len(renderer.encode_text(probe)) + (1 if options.marker else 0)
        return cls(renderer.encode_text, overhead, compiler.block_size, blocks)

    @property
    def limit(self) -> int:
        """The most tokens a passage's span may take: ``blocks`` whole blocks."""
        return self.blocks * self.block_size

    def span_tokens(self, text: str) -> int:
        """Tokens of ``text`` laid out as a plus span, before padding."""
        return self.overhead + len(self.encode(text))

    def padding(self, text: str) -> int:
        """Pad tokens the compiler adds after ``text`` to end its span on a block boundary."""
        return -self.span_tokens(text) % self.block_size

    def split(self, text: str) -> list[str]:
        """``text`` (whitespace collapsed) cut at word boundaries into passages whose spans
        take at most :attr:`limit` tokens, each holding as many words as fit; a single word
        longer than that is a passage of its own."""
        return [" ".join(words) for words in self.windows(text.split())]

    def windows(self, words: Sequence[str]) -> Iterable[Sequence[str]]:
        """``words`` in consecutive runs, each the longest whose text fits :attr:`limit`."""
        at = 0
        while at < len(words):
            size = self._fitting(words, at)
            yield words[at:at + size]
            at += size

    def _fitting(self, words: Sequence[str], at: int) -> int:
        """How many words from ``at`` on fit (at least one): a binary search on the count."""
        fits = lambda n: self.span_tokens(" ".join(words[at:at + n])) <= self.limit  # noqa: E731
        low, high = 1, min(len(words) - at, self.limit)
        if fits(high):
            return high
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        return low


__all__ = ["BlockChunker"]
