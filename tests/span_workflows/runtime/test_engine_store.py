"""The span store on the real default engine (SmolLM2-135M, the span-ready adapter as LoRA).

One engine with a store: spans it computes are written; with the KV cache emptied (what a
restart leaves) a query loads them instead of computing them, in one engine step, and answers
exactly as from the cache; a new combination of stored documents too; damaged files are
recomputed (never read) and rewritten; ``index_documents`` fills a store ahead of the queries.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import span_vllm
from span_workflows.query import builders as b
from span_workflows.runtime.store_index import index_documents

pytestmark = pytest.mark.engine

SYSTEM = "Answer from the documents in one short sentence."
PEOPLE = [("red", "Elm", "Anna", 31), ("blue", "Oak", "Bram", 44), ("green", "Pine", "Cleo", 29),
          ("yellow", "Ash", "Dirk", 52), ("white", "Birch", "Edda", 67),
          ("black", "Cedar", "Finn", 38)]
DOCS = [f"The {c} house on {s} Street belongs to {n}, who is {a} years old, keeps bees and "
        f"paints the fence every spring. Nobody else on {s} Street keeps bees."
        for c, s, n, a in PEOPLE]


@pytest.fixture(scope="module")
def store_engine(tmp_path_factory: pytest.TempPathFactory, engine):
    """An engine (its own: the suite's shared one has no store) with a span store.

    vLLM keeps one KV connector per process: the shared engine is started first (it has none)
    and runs no step until this one is closed, so the connector is only ever this engine's."""
    from span_workflows.runtime.engine import Engine

    directory = tmp_path_factory.mktemp("span-store")
    eng = Engine(kv_cache_gib=1, span_store=directory)
    eng.store_directory = directory
    yield eng
    eng.close()


def stats() -> dict[str, int]:
    return span_vllm.span_stats()


def delta(before: dict[str, int]) -> dict[str, int]:
    after = stats()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


def ask(engine, docs, question="Who is 44 years old?"):
    return engine.execute(b.rag(SYSTEM, docs, question, max_tokens=12), logprobs=3)


def test_spans_are_written_and_loaded_once_the_cache_is_empty(store_engine) -> None:
    before = stats()
    fresh = ask(store_engine, DOCS[:4])
    span_vllm.span_store_flush()
    written = delta(before).get("store_written_blocks", 0)
    assert written > 0 and len(files(store_engine.store_directory)) >= written

    store_engine.reset_cache()
    before = stats()
    loaded = ask(store_engine, DOCS[:4])
    moved = delta(before)
    assert moved.get("store_hit_blocks", 0) > 0 and not moved.get("store_bad_blocks")
    assert moved.get("miss_blocks", 0) == 0  # no span computed again
    assert loaded.metrics.prepare_requests == 0 and loaded.metrics.final_steps == 1
    assert loaded.metrics.cached_tokens == fresh.metrics.cached_tokens
    assert loaded.text == fresh.text
    first, again = fresh.first_logprobs, loaded.first_logprobs
    assert first.keys() == again.keys()
    assert max(abs(first[t] - again[t]) for t in first) < 1e-3


def test_a_new_combination_of_stored_documents_answers_as_from_the_cache(store_engine) -> None:
    for pair in (DOCS[:2], DOCS[2:4], DOCS[4:]):
        ask(store_engine, pair)
    span_vllm.span_store_flush()
    combination = [DOCS[5], DOCS[1], DOCS[3], DOCS[4]]  # never asked together
    store_engine.reset_cache()
    before = stats()
    from_store = ask(store_engine, combination)
    assert delta(before).get("store_hit_blocks", 0) > 0
    assert from_store.metrics.final_steps == 1
    before = stats()
    from_cache = ask(store_engine, combination)
    assert not delta(before).get("store_hit_blocks") and delta(before).get("hit_blocks", 0) > 0
    assert from_cache.text == from_store.text


def test_damaged_files_are_recomputed_and_rewritten_never_read(store_engine) -> None:
    docs = DOCS[1:5]
    reference = ask(store_engine, docs, "Who keeps bees on Ash Street?")
    span_vllm.span_store_flush()
    stored = files(store_engine.store_directory)
    for n, path in enumerate(stored):
        data = bytearray(path.read_bytes())
        if n % 2:
            data[-3] ^= 0x20  # a flipped bit
        else:
            data = data[: len(data) // 2]  # truncated
        path.write_bytes(bytes(data))
    store_engine.reset_cache()
    before = stats()
    again = ask(store_engine, docs, "Who keeps bees on Ash Street?")
    span_vllm.span_store_flush()
    moved = delta(before)
    assert moved.get("store_bad_blocks", 0) > 0
    assert again.text == reference.text
    assert max(abs(reference.first_logprobs[t] - again.first_logprobs[t])
               for t in reference.first_logprobs) < 1e-3
    assert moved.get("store_written_blocks", 0) > 0  # computed anew, written anew
    store_engine.reset_cache()
    before = stats()
    assert ask(store_engine, docs, "Who keeps bees on Ash Street?").text == reference.text
    assert not delta(before).get("store_bad_blocks")


def test_indexed_documents_are_hits_on_the_first_query(store_engine) -> None:
    corpus = [f"Ticket {n}: the parcel for {name} left the depot in {city} on day {n}."
              for n, (name, city) in enumerate([("Ada", "Lyon"), ("Ben", "Graz"),
                                                ("Cai", "Bern"), ("Dov", "Oslo"),
                                                ("Eli", "Riga")])]
    report = index_documents(store_engine, corpus, SYSTEM, batch_size=3, progress=False)
    assert report.documents == 5 and report.computed_tokens > 0
    span_vllm.span_store_flush()
    store_engine.reset_cache()
    before = stats()
    result = ask(store_engine, [corpus[3], corpus[0], corpus[4]], "Where did Dov's parcel leave?")
    moved = delta(before)
    assert moved.get("store_hit_blocks", 0) > 0 and moved.get("miss_blocks", 0) == 0
    assert result.metrics.prepare_requests == 0 and result.metrics.final_steps == 1
    again = index_documents(store_engine, corpus, SYSTEM, batch_size=3, progress=False)
    assert again.computed_tokens < report.computed_tokens / 2  # cached now: only the tails
    for path in files(store_engine.store_directory):  # no store, no cache: computed afresh
        path.unlink()
    store_engine.reset_cache()
    before = stats()
    fresh = ask(store_engine, [corpus[3], corpus[0], corpus[4]], "Where did Dov's parcel leave?")
    assert not delta(before).get("store_hit_blocks") and fresh.metrics.prepare_requests > 0
    assert fresh.text == result.text
    assert max(abs(fresh.first_logprobs[t] - result.first_logprobs[t])
               for t in fresh.first_logprobs) < 1e-3


def test_the_retrievers_index_their_documents_into_the_store(store_engine) -> None:
    from llama_index.core.schema import MetadataMode

    from langchain_span_workflows import SpanRetriever as LangChainRetriever
    from llama_index.retrievers.span_workflows import SpanRetriever as LlamaIndexRetriever

    texts = [f"Order {n}: {item} shipped to {town} by {carrier}." for n, (item, town, carrier)
             in enumerate([("a lamp", "Gent", "rail"), ("two chairs", "Turku", "sea"),
                           ("a kettle", "Porto", "air"), ("a rug", "Brno", "road")])]
    report = LangChainRetriever(texts=texts).index_spans(SYSTEM, engine=store_engine,
                                                         progress=False)
    assert report.documents == 4 and report.computed_tokens > 0
    llama = LlamaIndexRetriever.from_texts(texts[:2], metadatas=[{"shop": "north"}] * 2)
    assert llama.index_spans(SYSTEM, engine=store_engine, progress=False).documents == 2
    llama_texts = [n.get_content(metadata_mode=MetadataMode.LLM) for n in llama.nodes]
    with pytest.raises(ValueError, match="documents="):
        LangChainRetriever(retriever=LangChainRetriever(texts=texts)).index_spans(
            SYSTEM, engine=store_engine)
    span_vllm.span_store_flush()
    for docs in ([texts[2], texts[0], texts[3]], llama_texts):
        store_engine.reset_cache()
        before = stats()
        result = ask(store_engine, docs, "What went to Porto?")
        moved = delta(before)
        assert moved.get("store_hit_blocks", 0) > 0 and moved.get("miss_blocks", 0) == 0
        assert result.metrics.prepare_requests == 0 and result.metrics.final_steps == 1


def test_bench_store_rows_on_a_tiny_corpus(store_engine, tmp_path: Path) -> None:
    from span_workflows.apps.bench.store import (
        bench_corpus,
        bench_load,
        bench_ways,
        markdown,
        plot_store,
    )
    from span_workflows.apps.demo.corpus import documents

    docs = documents(store_engine.tokenizer, 6, 64)
    ways, _ = bench_ways(store_engine, docs, 2, 1, progress=False)
    by_way = {row["way"]: row for row in ways}
    assert set(by_way) == {"in cache", "store", "store, disk", "stock"}
    assert by_way["store"]["store_blocks"] > 0 and by_way["in cache"]["store_blocks"] == 0
    assert by_way["store, disk"]["store_blocks"] == by_way["store"]["store_blocks"]
    assert by_way["store"]["final_steps"] == 1 and by_way["store"]["same_output"]
    # one set of weights every way: the span query's, stock included
    assert len({row["weights"] for row in ways}) == 1
    load = bench_load(store_engine, by_way["stock"], max_blocks=8)
    assert load["blocks_read"] == 8 and load["store_gb_per_s_disk"] > 0
    assert load["kv_bytes_per_token"] <= load["disk_bytes_per_token"] < 1.01 * load[
        "kv_bytes_per_token"]
    corpus = bench_corpus(store_engine, docs, 6, 2, seed=0, progress=False)
    assert corpus["first_query_miss_blocks"] == 0 and corpus["served_share"] == 1.0
    # every source from its own counter: together they are every span token asked
    assert corpus["span_tokens"] == corpus["span_tokens_of_queries"]
    rows = [*ways, load, corpus]
    assert "| store |" in markdown(rows) and "| store, disk |" in markdown(rows)
    plot_store(rows, tmp_path / "store.png")
    assert (tmp_path / "store.png").stat().st_size > 0


def test_closing_this_engine_leaves_the_shared_engine_running(store_engine, engine) -> None:
    """Two in-process engines share the process's parallel groups: closing one (this module's,
    last test) must not tear them down under the other."""
    from span_workflows.runtime import engine_lifetime

    assert engine_lifetime.open_engines() >= 2
    open_before = engine_lifetime.open_engines()
    store_engine.close()
    store_engine.close()  # idempotent: counted once
    assert engine_lifetime.open_engines() == open_before - 1
    answer = engine.execute(b.g("Say hello.", max_tokens=4, temperature=0.0))
    assert answer.text.strip()
