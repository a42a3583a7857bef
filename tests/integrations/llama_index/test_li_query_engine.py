"""LlamaIndex: SpanRetriever + SpanLLM inside a RetrieverQueryEngine (default response mode)
and inside a Workflow."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.workflow import Event, StartEvent, StopEvent, Workflow, step

from llama_index.llms.span_workflows import SpanLLM, commutative_step
from llama_index.retrievers.span_workflows import SpanRetriever
from span_workflows import commutative
from span_workflows.query.lift import is_registered, span_id

QUESTION_1 = "Who built the Varnholm lighthouse and when?"
QUESTION_2 = "How far away can the Varnholm lighthouse light be seen?"


@pytest.fixture(scope="module")
def retriever(corpus: list[str]) -> SpanRetriever:
    return SpanRetriever.from_texts(corpus, k=3)


@pytest.mark.parametrize("package", ["llama_index.llms.span_workflows",
                                     "llama_index.retrievers.span_workflows"])
def test_each_component_is_a_namespace_distribution_of_its_own(package: str) -> None:
    here = Path(importlib.util.find_spec(package).origin).parent
    assert not (here.parent / "__init__.py").exists()  # llama_index.llms / .retrievers
    assert not (here.parents[1] / "__init__.py").exists()  # llama_index
    import llama_index.core  # the core still imports next to the integration

    assert llama_index.core.__version__
    project = here.parents[2] / "pyproject.toml"
    if not project.is_file():
        pytest.skip("installed from a wheel: no pyproject.toml to read")
    meta = project.read_text()
    assert f'name = "{package.replace("_", "-").replace(".", "-")}"' in meta
    assert f'[tool.llamahub]\ncontains_example = false\nimport_path = "{package}"' in meta
    assert [p.parent.name for p in project.parent.rglob("__init__.py")] == ["span_workflows"]


def test_nodes_are_marked_commutative(retriever: SpanRetriever) -> None:
    found = retriever.retrieve(QUESTION_1)
    assert len(found) == 3 and all("Varnholm" in n.node.get_content() for n in found)
    for item in found:
        text = item.node.get_content()
        assert item.node.metadata["span_id"] == span_id(text)
        assert item.node.metadata["span_commutative"] is True
        assert is_registered(text)
    assert len(asyncio.run(retriever.aretrieve(QUESTION_2))) == 3


def test_wraps_any_retriever() -> None:
    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=TextNode(text=f"Fixed node number {i} of the store.",
                                                metadata={"file": f"f{i}.txt"}), score=1.0)
                    for i in range(3)]

    wrapped = SpanRetriever(Fixed(), k=2)
    found = wrapped.retrieve("anything")
    assert len(found) == 2
    # what the response synthesizer will paste into the prompt (metadata included) is
    # registered, and the span keys stay out of it
    from llama_index.core.schema import MetadataMode

    llm_text = found[0].node.get_content(metadata_mode=MetadataMode.LLM)
    assert "file: f0.txt" in llm_text and "span_id" not in llm_text
    assert is_registered(llm_text)


@pytest.mark.engine
def test_query_engine_reuses_nodes_in_any_order(engine, retriever: SpanRetriever) -> None:
    llm = SpanLLM(engine=engine, max_tokens=12)
    query_engine = RetrieverQueryEngine.from_args(retriever, llm=llm)

    engine.reset_cache()
    response_1 = query_engine.query(QUESTION_1)
    first = llm.last_result
    response_2 = query_engine.query(QUESTION_2)
    second = llm.last_result
    assert str(response_1) and str(response_2)
    assert len(response_2.source_nodes) == 3

    spans = second.query.spans
    assert [s.kind for s in spans].count("plus") == 3
    reusable = sum(s.length for s in spans if s.kind in ("prefix", "plus"))
    assert second.metrics.cached_tokens >= reusable > 0
    assert first.metrics.prepare_requests > 0
    assert second.metrics.prepare_requests == 0
    # one engine step for each answer (the first one's prepares ran in its answer's step);
    # the count reaches the response
    assert second.metrics.engine_steps == first.metrics.engine_steps == 1
    again = llm.complete(str(QUESTION_1))
    assert again.additional_kwargs["engine_steps"] == llm.last_result.metrics.engine_steps >= 1
    print(f"\ncached tokens: 1st {first.metrics.cached_tokens}/{first.metrics.prompt_tokens}, "
          f"2nd {second.metrics.cached_tokens}/{second.metrics.prompt_tokens}")


@pytest.mark.engine
def test_complete_stream_and_chat(engine) -> None:
    llm = SpanLLM(engine=engine, max_tokens=4)
    # the engine's limit less one block of span overhead
    assert llm.metadata.context_window == engine.max_model_len - engine.block_size
    text = llm.complete("Say hello.").text
    assert text
    assert "".join(r.delta for r in llm.stream_complete("Say hello.")) == text
    reply = llm.chat([ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
                      ChatMessage(role=MessageRole.USER, content="Say hello.")])
    assert reply.message.role == MessageRole.ASSISTANT and reply.message.content
    assert reply.raw["usage"]["prompt_tokens"] == llm.last_result.metrics.prompt_tokens


@pytest.mark.engine
def test_acomplete_does_not_block_the_event_loop(engine) -> None:
    llm = SpanLLM(engine=engine, max_tokens=16)

    async def main() -> tuple[int, str]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        response = await llm.acomplete("Write a sentence about the sea.")
        task.cancel()
        return ticks, response.text

    ticks, text = asyncio.run(main())
    assert text and ticks >= 5


class DocsEvent(Event):
    question: str
    docs: list[str]


@commutative
def _search(question: str) -> list[str]:
    return [
        "Glaciers carve U-shaped valleys as they slide downhill over centuries.",
        "Moraines are ridges of rock debris that a glacier leaves behind.",
    ]


search = commutative_step(_search)


class RagFlow(Workflow):
    def __init__(self, llm: SpanLLM, **kwargs) -> None:
        super().__init__(**kwargs)
        self.llm = llm

    @step
    async def retrieve(self, ev: StartEvent) -> DocsEvent:
        return DocsEvent(question=ev.question, docs=search(ev.question))

    @step
    async def answer(self, ev: DocsEvent) -> StopEvent:
        prompt = "Context:\n" + "\n\n".join(ev.docs) + f"\n\nQuestion: {ev.question}\nAnswer:"
        response = await self.llm.acomplete(prompt)
        return StopEvent(result=response.text)


@pytest.mark.engine
def test_commutative_step_in_a_workflow(engine) -> None:
    llm = SpanLLM(engine=engine, max_tokens=4)

    async def main() -> str:
        return await RagFlow(llm, timeout=300).run(question="What do glaciers leave?")

    assert isinstance(asyncio.run(main()), str)
    assert [s.kind for s in llm.last_result.query.spans].count("plus") == 2
