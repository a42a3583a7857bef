"""An LCEL RAG chain written as LangChain's docs write it, with only the retriever and the chat
model swapped for SpanRetriever and SpanChatModel."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from langchain_core.callbacks import UsageMetadataCallbackHandler
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_span_workflows import (
    SpanChatModel,
    SpanRetriever,
    agent_step_runnable,
    commutative_step,
    judge_generator_chain,
)
from span_workflows import Fragment, Plus, commutative, rag
from span_workflows.compiler.model import DEFAULT_MODEL_NAME
from span_workflows.query.lift import is_registered, register, span_id

QUESTION_1 = "Who built the Varnholm lighthouse and when?"
QUESTION_2 = "How far away can the Varnholm lighthouse light be seen?"
SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of "
    "retrieved context to answer the question. If you don't know the answer, just say that "
    "you don't know. Use three sentences maximum and keep the answer concise."
)
MAX_TOKENS = 12


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


prompt = ChatPromptTemplate.from_messages([
    ("system", SYSTEM + "\n\n{context}"),
    ("human", "{question}"),
])


@pytest.fixture(scope="module")
def retriever(corpus: list[str]) -> SpanRetriever:
    return SpanRetriever.from_texts(corpus, k=3)


def test_documents_are_marked_commutative(retriever: SpanRetriever) -> None:
    docs = retriever.invoke(QUESTION_1)
    assert len(docs) == 3
    assert all("Varnholm" in d.page_content for d in docs)
    for doc in docs:
        assert doc.metadata["span_commutative"] is True
        assert doc.metadata["span_id"] == span_id(doc.page_content)
        assert is_registered(doc.page_content)
    assert len(retriever.invoke(QUESTION_1, k=1)) == 1


def test_wraps_any_retriever(corpus: list[str]) -> None:
    store = InMemoryVectorStore.from_texts(corpus, DeterministicFakeEmbedding(size=32))
    wrapped = SpanRetriever(retriever=store.as_retriever(search_kwargs={"k": 3}))
    docs = wrapped.invoke("lighthouse")
    assert len(docs) == 3
    assert all(d.metadata["span_commutative"] and is_registered(d.page_content) for d in docs)
    assert len(asyncio.run(wrapped.ainvoke("lighthouse", k=2))) == 2


@pytest.mark.engine
def test_rag_chain_reuses_documents_in_any_order(engine, retriever: SpanRetriever) -> None:
    llm = SpanChatModel(engine=engine, max_tokens=MAX_TOKENS)
    rag_chain = (
        {"context": retriever | format_docs, "question": RunnablePassthrough()}
        | prompt
        | llm
        | StrOutputParser()
    )
    docs_1 = [d.page_content for d in retriever.invoke(QUESTION_1)]
    docs_2 = [d.page_content for d in retriever.invoke(QUESTION_2)]
    assert set(docs_1) == set(docs_2) and docs_1 != docs_2  # same documents, another order

    engine.reset_cache()
    answer_1 = rag_chain.invoke(QUESTION_1)
    first = llm.last_result
    usage = UsageMetadataCallbackHandler()
    answer_2 = rag_chain.invoke(QUESTION_2, config={"callbacks": [usage]})
    second = llm.last_result

    # The documents went out as plus spans and were all cache hits the second time.
    spans = second.query.spans
    assert [s.kind for s in spans].count("plus") == 3
    reusable = sum(s.length for s in spans if s.kind in ("prefix", "plus"))
    assert second.metrics.cached_tokens >= reusable > 0
    # The first question computed its documents (each alone, in prepare requests); the second,
    # with the same documents in another order, computed none of them.
    assert first.metrics.prepare_requests > 0
    assert second.metrics.prepare_requests == 0
    # The cached tokens reach LangChain's usage metadata (here through a callback).
    # Each answer waited for one engine step (the first one's prepares ran in its answer's
    # step): the figure reaches LangChain's response metadata.
    assert second.metrics.engine_steps == first.metrics.engine_steps == 1
    assert llm.invoke(prompt.invoke({"context": "\n\n".join(docs_1), "question": QUESTION_1})
                      ).response_metadata["engine_steps"] == 1
    seen = usage.usage_metadata[DEFAULT_MODEL_NAME]
    assert seen["input_token_details"]["cache_read"] == second.metrics.cached_tokens
    assert seen["input_tokens"] == second.metrics.prompt_tokens
    assert seen["total_tokens"] == seen["input_tokens"] + seen["output_tokens"]
    print(f"\ncached tokens: 1st {first.metrics.cached_tokens}/{first.metrics.prompt_tokens}, "
          f"2nd {second.metrics.cached_tokens}/{second.metrics.prompt_tokens}")

    # Same tokens as the span query built by hand, hence the same greedy answers.
    for question, docs, answer in ((QUESTION_1, docs_1, answer_1), (QUESTION_2, docs_2, answer_2)):
        by_hand = rag(SYSTEM, docs, question, max_tokens=MAX_TOKENS, temperature=0.0)
        messages = prompt.invoke({"context": "\n\n".join(docs), "question": question})
        assert llm.to_query(messages.to_messages()) == by_hand
        assert engine.execute(by_hand).text == answer


@pytest.mark.engine
def test_plain_chat_without_fragments(engine) -> None:
    llm = SpanChatModel(engine=engine, max_tokens=4)
    message = llm.invoke([HumanMessage("Say hi.")])
    assert [s.kind for s in llm.last_result.query.spans] == ["prefix"]
    assert message.response_metadata["model_name"] == DEFAULT_MODEL_NAME
    assert message.response_metadata["ttft_s"] > 0
    assert message.usage_metadata["output_tokens"] == llm.last_result.metrics.generated_tokens


@pytest.mark.engine
def test_ainvoke_does_not_block_the_event_loop(engine) -> None:
    llm = SpanChatModel(engine=engine, max_tokens=16)

    async def main() -> tuple[int, float, AIMessage]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = time.perf_counter()
        message = await llm.ainvoke("Write a sentence about the sea.")
        elapsed = time.perf_counter() - started
        task.cancel()
        return ticks, elapsed, message

    ticks, elapsed, message = asyncio.run(main())
    assert message.content
    # A blocked loop would not tick at all while the engine generates.
    assert ticks >= 5, (ticks, elapsed)


@pytest.mark.engine
def test_commutative_step_in_a_chain(engine) -> None:
    @commutative
    def search(question: str) -> list[str]:
        return [
            "Tide pools hold anemones, crabs and small fish at low tide.",
            "Kelp forests grow fastest in cold water that is rich in nutrients.",
        ]

    llm = SpanChatModel(engine=engine, max_tokens=4)
    chain = (
        {"context": commutative_step(search) | "\n\n".join, "question": RunnablePassthrough()}
        | prompt
        | llm
        | StrOutputParser()
    )
    assert isinstance(search("q"), Plus)
    assert chain.invoke("What lives in tide pools?")
    spans = llm.last_result.query.spans
    assert [s.kind for s in spans].count("plus") == 2
    texts = [f.text for f in search("q").children]
    messages = prompt.invoke({"context": "\n\n".join(texts), "question": "q"})
    assert llm.to_query(messages.to_messages()).input.children[1] == search("q")


@pytest.mark.engine
def test_judge_generator_and_agent_step_runnables(engine) -> None:
    llm = SpanChatModel(engine=engine, max_tokens=4)
    judge = judge_generator_chain(llm, n=2, generator_prompt="Name a colour of the {thing}.",
                                  judge_prompt="Which colour above is best? Answer in one word.")
    assert isinstance(judge.invoke({"thing": "sky"}), str)
    assert [s.kind for s in llm.last_result.query.spans].count("generated") >= 1

    step = agent_step_runnable(llm, system="You are a weather agent.",
                               instruction="Summarize the observations.")
    text = asyncio.run(step.ainvoke({
        "history": [HumanMessage("What's the weather?")],
        "observations": ["Oslo: 4 degrees and rain.", "Bergen: 7 degrees and wind."],
    }))
    assert isinstance(text, str)
    assert [s.kind for s in llm.last_result.query.spans].count("plus") == 2


def test_server_path_sends_the_lifted_query() -> None:
    import httpx

    from span_workflows.query.json_ir import from_json
    from span_workflows.serving.client import SpanServer

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.read().decode())
        return httpx.Response(200, json={
            "text": "From the server.", "texts": ["From the server."],
            "metrics": {"ttft_s": 0.1, "prompt_tokens": 50, "cached_tokens": 32,
                        "generated_tokens": 4},
        })

    llm = SpanChatModel(server_url="http://span.test", max_tokens=4)
    llm._server = SpanServer("http://span.test", transport=httpx.MockTransport(handler))
    doc = "Server-side document about the Varnholm lighthouse keeper."
    register(doc)  # what a SpanRetriever does with each document it returns
    message = llm.invoke([("system", f"Use this.\n\n{doc}"), ("human", "Who?")])
    assert message.content == "From the server."
    assert message.usage_metadata["input_token_details"]["cache_read"] == 32
    body = json.loads(seen[0])
    query = from_json(json.dumps(body.get("query", body)))
    assert query.input.children[1] == Plus((Fragment(doc),))
