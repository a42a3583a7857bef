"""The README's swaps answer their questions: a LangChain RAG chain and a LlamaIndex query
engine, with the span retriever and the span model on the default model, answer
both lighthouse questions with the facts of the retrieved documents, in span mode, the second
time from cached documents in another order."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core.query_engine import RetrieverQueryEngine

from langchain_span_workflows import SpanChatModel
from langchain_span_workflows import SpanRetriever as LangChainRetriever
from llama_index.llms.span_workflows import SpanLLM
from llama_index.retrievers.span_workflows import SpanRetriever as LlamaIndexRetriever

pytestmark = pytest.mark.engine

#: (question, a word every correct answer names) over the shared lighthouse corpus
ASKED = [("Who built the Varnholm lighthouse?", "lindqvist"),
         ("How far away can the Varnholm lighthouse light be seen?", "40")]
MAX_TOKENS = 32


def _format(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def test_the_langchain_swap_answers_from_its_documents(engine, corpus: list[str]) -> None:
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the documents. Be brief.\n\n{context}"),
        ("human", "{question}"),
    ])
    llm = SpanChatModel(engine=engine, max_tokens=MAX_TOKENS)
    chain = ({"context": LangChainRetriever.from_texts(corpus, k=3) | _format,
              "question": RunnablePassthrough()} | prompt | llm | StrOutputParser())
    engine.reset_cache()
    for i, (question, fact) in enumerate(ASKED):
        answer = chain.invoke(question)
        assert fact in answer.lower(), (question, answer)
        assert [s.kind for s in llm.last_result.query.spans].count("plus") == 3
        if i:  # the same documents, retrieved in another order: read from the cache
            assert llm.last_result.metrics.prepare_requests == 0


def test_the_llamaindex_swap_answers_from_its_nodes(engine, corpus: list[str]) -> None:
    llm = SpanLLM(engine=engine, max_tokens=MAX_TOKENS)
    query_engine = RetrieverQueryEngine.from_args(LlamaIndexRetriever.from_texts(corpus, k=3),
                                                  llm=llm)
    engine.reset_cache()
    for i, (question, fact) in enumerate(ASKED):
        answer = str(query_engine.query(question))
        assert fact in answer.lower(), (question, answer)
        assert [s.kind for s in llm.last_result.query.spans].count("plus") == 3
        if i:
            assert llm.last_result.metrics.prepare_requests == 0
