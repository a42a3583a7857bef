"""``SpanRetriever`` for LlamaIndex: retrieved nodes that commute.

Wraps any LlamaIndex retriever, or searches nodes/texts itself (all-MiniLM-L6-v2 + faiss,
:class:`span_workflows.runtime.retrieval.VectorIndex`). Each returned node's prompt text (its
content as a
response synthesizer formats it, ``MetadataMode.LLM``) is registered as a commutative fragment
(:func:`span_workflows.query.lift.register`) and its metadata marks it (``span_id``,
``span_commutative``; both kept out of the LLM and embedding text), so
:class:`llama_index.llms.span_workflows.SpanLLM` sends the nodes as one plus span.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import (
    BaseNode,
    MetadataMode,
    NodeWithScore,
    QueryBundle,
    TextNode,
)

from span_workflows.query.lift import register

SPAN_KEYS = ("span_id", "span_commutative")


class SpanRetriever(BaseRetriever):
    """A retriever whose nodes are commutative span fragments.

    ``SpanRetriever(retriever=any_llama_index_retriever)``, or
    :meth:`from_texts` / :meth:`from_nodes` for a vector search of its own. ``k`` is the
    number of nodes (on a wrapped retriever: a cap, when given).
    """

    def __init__(
        self,
        retriever: BaseRetriever | None = None,
        *,
        nodes: Sequence[BaseNode] | None = None,
        k: int | None = None,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
    ) -> None:
        if (retriever is None) == (nodes is None):
            raise ValueError("SpanRetriever needs exactly one of retriever or nodes")
        if nodes is not None and not nodes:
            raise ValueError("SpanRetriever needs at least one node")
        if k is not None and k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        self.retriever = retriever
        self.nodes = list(nodes) if nodes is not None else None
        self.k = k if k is not None or retriever is not None else 4
        self._index: Any = None
        self._lock = threading.Lock()
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    @classmethod
    def from_texts(cls, texts: Sequence[str], k: int = 4,
                   metadatas: Sequence[dict[str, Any]] | None = None,
                   **kwargs: Any) -> SpanRetriever:
        """A retriever over ``texts`` (one ``TextNode`` each, with its metadata)."""
        texts = list(texts)
        if metadatas is not None and len(metadatas) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(metadatas)} metadatas")
        nodes = [
            TextNode(text=t, metadata=dict(metadatas[i]) if metadatas else {},
                     id_=f"span-text-{i}")
            for i, t in enumerate(texts)
        ]
        return cls(nodes=nodes, k=k, **kwargs)

    @classmethod
    def from_nodes(cls, nodes: Sequence[BaseNode], k: int = 4, **kwargs: Any) -> SpanRetriever:
        """A retriever over ``nodes`` (searched by their embedding text)."""
        return cls(nodes=nodes, k=k, **kwargs)

    # -- the span store -------------------------------------------------------------------------
    def index_spans(self, system: str, *, engine: Any = None,
                    nodes: Sequence[BaseNode] | None = None, batch_size: int = 8,
                    progress: bool = True) -> Any:
        """Compute each node's span (its prompt text, ``MetadataMode.LLM``, as retrieval sends
        it) once into the span store of ``engine`` (default: the process's default engine,
        whose store ``SPAN_WORKFLOWS_SPAN_STORE`` names), as a plus span after ``system``:
        queries that put these nodes right after that system prompt then load them from the
        store, after a restart too. ``nodes`` default to this retriever's own (a wrapped
        retriever's must be given). Returns
        :class:`span_workflows.runtime.store_index.IndexReport`."""
        from span_workflows.frameworks import index_spans

        chosen = list(nodes) if nodes is not None else self.nodes
        if chosen is None:
            raise ValueError("a SpanRetriever over another retriever indexes the nodes given "
                             "as nodes=[...]")
        texts = [n.get_content(metadata_mode=MetadataMode.LLM) for n in chosen]
        return index_spans(texts, system, engine=engine, batch_size=batch_size,
                           progress=progress)

    # -- retrieval ------------------------------------------------------------------------------
    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.retriever is not None:
            found = self.retriever.retrieve(query_bundle)
        else:
            found = self._search(query_bundle.query_str)
        return self._mark(found)

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.retriever is not None:
            found = await self.retriever.aretrieve(query_bundle)
        else:
            found = await asyncio.to_thread(self._search, query_bundle.query_str)
        return self._mark(found)

    def _search(self, query: str) -> list[NodeWithScore]:
        index = self._get_index()
        assert self.nodes is not None
        return [
            NodeWithScore(node=self.nodes[int(passage.source)], score=score)
            for passage, score in index.search_scored(query, self.k or 4)
        ]

    def _get_index(self) -> Any:
        with self._lock:
            if self._index is None:
                from span_workflows.runtime.retrieval import VectorIndex

                assert self.nodes is not None
                texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in self.nodes]
                self._index = VectorIndex.from_texts(texts, [str(i) for i in range(len(texts))])
            return self._index

    def _mark(self, found: list[NodeWithScore]) -> list[NodeWithScore]:
        if self.retriever is not None and self.k is not None:
            found = found[: self.k]
        out = []
        for item in found:
            node = item.node.model_copy()
            node.excluded_llm_metadata_keys = _with(node.excluded_llm_metadata_keys, SPAN_KEYS)
            node.excluded_embed_metadata_keys = _with(
                node.excluded_embed_metadata_keys, SPAN_KEYS
            )
            sid = register(node.get_content(metadata_mode=MetadataMode.LLM))
            node.metadata = {**node.metadata, "span_id": sid, "span_commutative": True}
            out.append(NodeWithScore(node=node, score=item.score))
        return out


def _with(keys: list[str] | None, extra: Sequence[str]) -> list[str]:
    keys = list(keys or [])
    return keys + [k for k in extra if k not in keys]


__all__ = ["SpanRetriever"]
