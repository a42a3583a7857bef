"""``SpanTextSplitter``: nodes sized to the engine's KV blocks, for LlamaIndex ingestion.

A retrieved node becomes a plus span that fills whole KV blocks: the compiler pads its end to
the next block boundary, and on a miss those pad tokens are computed like the node's own text.
This splitter (a LlamaIndex ``TextSplitter``, so a node parser and an ingestion-pipeline
transformation) cuts text where a block is (nearly) full instead
(:class:`span_workflows.runtime.chunking.BlockChunker`).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.node_parser.interface import TextSplitter
from pydantic import Field, PrivateAttr

from span_workflows.frameworks import block_chunker
from span_workflows.runtime.chunking import BlockChunker


class SpanTextSplitter(TextSplitter):
    """Splits text at word boundaries into chunks of at most ``blocks`` KV blocks of
    ``engine`` (default: the process's default engine), each as full as the next word allows;
    ``chunker`` (a :class:`~span_workflows.runtime.chunking.BlockChunker`) replaces both."""

    blocks: int = Field(default=4, description="KV blocks per chunk, at most")
    _chunker: BlockChunker = PrivateAttr()

    def __init__(self, engine: Any = None, *, blocks: int = 4,
                 chunker: BlockChunker | None = None, **kwargs: Any) -> None:
        if chunker is None:
            chunker = block_chunker(engine, blocks)
        super().__init__(blocks=chunker.blocks, **kwargs)
        self._chunker = chunker

    @classmethod
    def class_name(cls) -> str:
        return "SpanTextSplitter"

    @property
    def chunker(self) -> BlockChunker:
        """The chunker that measures and cuts."""
        return self._chunker

    def split_text(self, text: str) -> list[str]:
        """``text`` in chunks (whitespace collapsed)."""
        return self._chunker.split(text)
