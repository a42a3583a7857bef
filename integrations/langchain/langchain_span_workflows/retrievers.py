"""``SpanRetriever``: documents that commute.

Wraps any LangChain retriever, or searches texts itself (all-MiniLM-L6-v2 embeddings in a faiss
index, :class:`span_workflows.runtime.retrieval.VectorIndex`). The documents it returns are ordinary
``Document`` s; each one's ``page_content`` is registered as a commutative fragment
(:func:`span_workflows.query.lift.register`) and its metadata says so (``span_id``: the content
hash, ``span_commutative``: ``True``), so a :class:`~langchain_span_workflows.SpanChatModel`
downstream sends them as a plus span, whatever the prompt template does with them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, PrivateAttr, model_validator

from span_workflows.query.lift import register


class SpanRetriever(BaseRetriever):
    """A retriever whose documents are commutative span fragments.

    Either ``SpanRetriever(retriever=any_langchain_retriever)`` or
    ``SpanRetriever(texts=[...], k=4, metadatas=None)`` /
    :meth:`from_texts` (a vector search over the texts). ``k`` (also accepted per call:
    ``retriever.invoke(q, k=2)``) is the number of documents; on a wrapped retriever it caps
    what that retriever returns, if given.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever | None = None
    texts: list[str] | None = None
    metadatas: list[dict[str, Any]] | None = None
    k: int = 4

    _index: Any = PrivateAttr(default=None)
    _positions: dict[int, int] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_source(self) -> SpanRetriever:
        if (self.retriever is None) == (self.texts is None):
            raise ValueError("SpanRetriever needs exactly one of retriever= or texts=")
        if self.texts is not None:
            if not self.texts:
                raise ValueError("SpanRetriever needs at least one text")
            if self.metadatas is not None and len(self.metadatas) != len(self.texts):
                raise ValueError(
                    f"{len(self.texts)} texts but {len(self.metadatas)} metadatas"
                )
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")
        return self

    @classmethod
    def from_texts(cls, texts: Sequence[str], k: int = 4,
                   metadatas: Sequence[dict[str, Any]] | None = None,
                   **kwargs: Any) -> SpanRetriever:
        """A retriever over ``texts`` (all-MiniLM-L6-v2 + faiss, the index cached on disk)."""
        return cls(texts=list(texts), k=k,
                   metadatas=None if metadatas is None else [dict(m) for m in metadatas],
                   **kwargs)

    # -- the span store -------------------------------------------------------------------------
    def index_spans(self, system: str, *, engine: Any = None,
                    documents: Sequence[str] | None = None, batch_size: int = 8,
                    progress: bool = True) -> Any:
        """Compute each document's span once into the span store of ``engine`` (default: the
        process's default engine, whose store ``SPAN_WORKFLOWS_SPAN_STORE`` names), as a plus
        span after ``system``: queries that put these documents right after that system
        prompt then load them from the store, after a restart too. ``documents`` default to
        this retriever's ``texts`` (a wrapped retriever's documents must be given). Returns
        :class:`span_workflows.runtime.store_index.IndexReport`."""
        from span_workflows.frameworks import index_spans

        texts = list(documents) if documents is not None else self.texts
        if texts is None:
            raise ValueError("a SpanRetriever over another retriever indexes the documents "
                             "given as documents=[...]")
        return index_spans(texts, system, engine=engine, batch_size=batch_size,
                           progress=progress)

    # -- retrieval ------------------------------------------------------------------------------
    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k = kwargs.pop("k", None)
        if self.retriever is not None:
            docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()},
                                         **kwargs)
            return self._mark(self._cap(docs, k))
        return self._mark(self._search(query, k or self.k))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k = kwargs.pop("k", None)
        if self.retriever is not None:
            docs = await self.retriever.ainvoke(
                query, config={"callbacks": run_manager.get_child()}, **kwargs
            )
            return self._mark(self._cap(docs, k))
        return self._mark(await asyncio.to_thread(self._search, query, k or self.k))

    def _cap(self, docs: list[Document], k: int | None) -> list[Document]:
        if k is None and "k" in self.model_fields_set:
            k = self.k
        return list(docs) if k is None else list(docs)[:k]

    def _search(self, query: str, k: int) -> list[Document]:
        index = self._get_index()
        docs = []
        for passage, score in index.search_scored(query, k):
            i = self._positions[id(passage)]
            metadata = dict(self.metadatas[i]) if self.metadatas else {}
            metadata.setdefault("source", passage.source)
            metadata["score"] = score
            docs.append(Document(page_content=passage.text, metadata=metadata))
        return docs

    def _get_index(self) -> Any:
        if self._index is None:
            from span_workflows.runtime.retrieval import VectorIndex

            assert self.texts is not None
            index = VectorIndex.from_texts(self.texts)
            self._positions = {id(p): i for i, p in enumerate(index.passages)}
            self._index = index
        return self._index

    @staticmethod
    def _mark(docs: list[Document]) -> list[Document]:
        out = []
        for doc in docs:
            sid = register(doc.page_content)
            metadata = {**doc.metadata, "span_id": sid, "span_commutative": True}
            out.append(Document(page_content=doc.page_content, metadata=metadata, id=doc.id))
        return out


__all__ = ["SpanRetriever"]
