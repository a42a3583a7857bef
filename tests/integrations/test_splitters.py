"""SpanTextSplitter for LangChain and LlamaIndex: chunks that fill whole KV blocks, metadata
kept, and (on the real engine) a chain over them computing no more tokens than stock."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from llama_index.core import Document as LlamaDocument

from langchain_span_workflows import SpanTextSplitter as LangChainSplitter
from llama_index.retrievers.span_workflows import SpanTextSplitter as LlamaSplitter
from span_workflows.compiler.compile import Compiler
from span_workflows.runtime.chunking import BlockChunker

TEXT = ("The Varnholm lighthouse was built in 1871 by the engineer Ada Lindqvist, who designed "
        "its spiral stone stair of 212 steps; its keeper lit the lamp every night with whale "
        "oil until 1923, when the lamp was converted to electricity. ") * 8


@pytest.fixture(scope="module")
def chunker(tokenizer) -> BlockChunker:
    return BlockChunker.for_compiler(Compiler.for_tokenizer(tokenizer, 32), blocks=2)


def _check_chunks(chunker: BlockChunker, chunks: list[str]) -> None:
    assert len(chunks) > 3 and " ".join(chunks) == " ".join(TEXT.split())
    assert all(chunker.span_tokens(c) <= chunker.limit for c in chunks)
    assert all(chunker.padding(c) < 8 for c in chunks[:-1])


def test_langchain_splitter_cuts_to_blocks_and_keeps_metadata(chunker) -> None:
    splitter = LangChainSplitter(chunker=chunker)
    _check_chunks(chunker, splitter.split_text(TEXT))
    docs = splitter.split_documents([Document(page_content=TEXT, metadata={"source": "a"}),
                                     Document(page_content="short", metadata={"source": "b"})])
    assert [d.metadata for d in docs[-2:]] == [{"source": "a"}, {"source": "b"}]
    assert docs[-1].page_content == "short"
    assert list(splitter.transform_documents(docs[-1:])) == docs[-1:]
    with pytest.raises(ValueError, match="metadatas"):
        splitter.create_documents(["a", "b"], [{}])


def test_llama_index_splitter_is_a_node_parser(chunker) -> None:
    splitter = LlamaSplitter(chunker=chunker)
    _check_chunks(chunker, splitter.split_text(TEXT))
    nodes = splitter.get_nodes_from_documents([LlamaDocument(text=TEXT,
                                                             metadata={"source": "a"})])
    _check_chunks(chunker, [n.get_content() for n in nodes])
    assert all(n.metadata == {"source": "a"} for n in nodes)
    assert splitter.blocks == 2


@pytest.mark.engine
def test_chunks_of_the_engine_compute_no_more_tokens_than_stock_on_a_miss(engine) -> None:
    """On the real engine: three chunks of the engine's own splitter, first retrieved after
    the system prompt was seen, cost no more computed tokens than stock."""
    from span_workflows import fragment, rag

    chunks = LangChainSplitter(engine, blocks=3).split_text(TEXT)
    assert LlamaSplitter(engine, blocks=3).split_text(TEXT) == chunks
    system = "Answer from the documents in one sentence."
    engine.execute(rag(system, [fragment("A warm-up document.")], "Hi", max_tokens=1,
                       temperature=0.0))
    query = rag(system, [fragment(c) for c in chunks[:3]], "Who built the lighthouse?",
                max_tokens=1, temperature=0.0)
    span, stock = engine.execute(query), engine.stock(query)
    assert span.metrics.prepare_requests > 0
    assert span.metrics.computed_tokens <= stock.metrics.computed_tokens
