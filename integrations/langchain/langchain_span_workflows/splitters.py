"""``SpanTextSplitter``: passages sized to the engine's KV blocks, for LangChain pipelines.

A document becomes a plus span that fills whole KV blocks: the compiler pads its end to the
next block boundary, and on a miss those pad tokens are computed like the document's own. This
splitter cuts text where a block is (nearly) full instead
(:class:`span_workflows.runtime.chunking.BlockChunker`), so the chunks a ``SpanRetriever`` returns
cost almost no padding. It is a LangChain document transformer: ``split_documents``,
``transform_documents``, ``create_documents`` and ``split_text``, like LangChain's own text
splitters, with no other package needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document

from span_workflows.frameworks import block_chunker
from span_workflows.runtime.chunking import BlockChunker


class SpanTextSplitter(BaseDocumentTransformer):
    """Splits text at word boundaries into chunks of at most ``blocks`` KV blocks of
    ``engine`` (default: the process's default engine), each as full as the next word allows.

    ``chunker`` (a :class:`~span_workflows.runtime.chunking.BlockChunker`) replaces ``engine`` and
    ``blocks``. Each chunk keeps its document's metadata.
    """

    def __init__(self, engine: Any = None, *, blocks: int = 4,
                 chunker: BlockChunker | None = None) -> None:
        if chunker is None:
            chunker = block_chunker(engine, blocks)
        self.chunker = chunker

    def split_text(self, text: str) -> list[str]:
        """``text`` in chunks (whitespace collapsed)."""
        return self.chunker.split(text)

    def create_documents(self, texts: Sequence[str],
                         metadatas: Sequence[dict[str, Any]] | None = None) -> list[Document]:
        """The chunks of ``texts`` as documents, each with its text's metadata."""
        if metadatas is not None and len(metadatas) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(metadatas)} metadatas")
        return [Document(page_content=chunk, metadata=dict(metadatas[i]) if metadatas else {})
                for i, text in enumerate(texts) for chunk in self.split_text(text)]

    def split_documents(self, documents: Iterable[Document]) -> list[Document]:
        """Each document's chunks, with its metadata."""
        documents = list(documents)
        return self.create_documents([d.page_content for d in documents],
                                     [d.metadata for d in documents])

    def transform_documents(self, documents: Sequence[Document],
                            **kwargs: Any) -> Sequence[Document]:
        """:meth:`split_documents` (LangChain's document-transformer interface)."""
        return self.split_documents(documents)
