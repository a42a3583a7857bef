"""``span-workflows bench store``: the span store against the KV cache and against computing.

Three parts, in one run, on engines with a span store in one directory (``--store``, default a
temporary one, removed after):

* **TTFT, four ways** (``rows`` ``way``): ``--docs`` documents (default 16) of ``--doc-tokens``
  tokens (default 440), a new combination each repetition (every document indexed, never this
  set asked), answered *in the cache* (its spans cached by earlier queries), *from the store*
  (the KV cache emptied first: what a restart leaves) with its files in the page cache
  (``store``) and read from the disk (``store, disk``: every file's pages dropped first), and
  *stock* (vLLM's prefix caching, cache emptied: nothing anywhere). Every way runs on the same
  weights (those the engine's router picks for the span query: the adapter on the default
  engine). Per way: the median TTFT, engine steps and blocks loaded from the store, the ratio
  to stock and to the in-cache hit; every answer is checked against the in-cache one
  (``same_output``).
* **Load throughput** (``way`` = ``load``): the store's KV blocks read back directly
  (:meth:`span_vllm.store.SpanStore.read_into`, checksum included), from the page cache and
  from the disk (each file's pages synced and dropped first, ``posix_fadvise``; a virtual
  disk may still be cached by its host), as GB/s, against the KV
  bytes a stock prefill produces per second; and the store's bytes on disk per token.
* **A corpus over 10x the KV cache** (``way`` = ``corpus``): a second engine (a fresh start on
  the same store: its first query is what a restart gives) with a KV cache of ``--cache-blocks``
  blocks, a corpus of ``--corpus-factor`` (10) times that many tokens of new documents indexed
  beside the ``3 x --docs`` the first part indexed (``corpus_over_cache``: 15.1 in the committed
  run), then ``--queries`` queries of 4 random documents: the share of their span tokens served
  from the cache and from the store and computed, each from its own counter (``hit_blocks``,
  ``store_hit_blocks``, ``miss_blocks``), and the first query's engine steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from span_workflows.apps.bench.options import add_results_dir, new_parser

SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
QUESTION = "Which module do the documents describe first, in one short sentence?"
#: the TTFT part's ways, in the order of the tables
WAYS = ("in cache", "store", "store, disk", "stock")
#: documents per query of the large-corpus part
CORPUS_QUERY_DOCS = 4


def _stats() -> dict[str, int]:
    import span_vllm

    return dict(span_vllm.span_stats())


def _moved(before: dict[str, int]) -> dict[str, int]:
    after = _stats()
    return {k: after[k] - before.get(k, 0) for k in after}


def bench_ways(engine: Any, docs: list[str], k: int, reps: int,
               progress: bool = True) -> tuple[list[dict[str, Any]], list[float]]:
    """The three ways of the module doc on ``engine`` (its store filled with ``docs``); also
    returns the stock TTFTs (for the load part)."""
    from tqdm.auto import tqdm

    from span_vllm import span_store_flush
    from span_workflows.apps.bench.quality import new_combinations
    from span_workflows.query.builders import rag
    from span_workflows.runtime.store_index import index_documents

    report = index_documents(engine, docs, SYSTEM, batch_size=8, progress=progress)
    span_store_flush()
    seen, fresh = new_combinations(docs, k, reps, seed=k)
    runs: dict[str, list[tuple[Any, dict[str, int]]]] = {
        "in cache": [], "store": [], "store, disk": [], "stock": []}
    same = []
    # the weights span queries run on (the router's pick); every way runs on them
    weights = engine.execute(rag(SYSTEM, seen[0], QUESTION, max_tokens=1)).metrics.weights
    for combination in tqdm(fresh, desc="store: ways", disable=not progress):
        query = rag(SYSTEM, combination, QUESTION, max_tokens=8)
        for way in ("store, disk", "store"):  # cache cold, store full: what a restart leaves
            engine.reset_cache()
            if way == "store, disk":
                _drop_store_pages()
            before = _stats()
            runs[way].append((engine.execute(query, weights=weights), _moved(before)))
        engine.reset_cache()
        for earlier in seen:  # every document in the cache, never this set
            engine.execute(rag(SYSTEM, earlier, QUESTION, max_tokens=1), weights=weights)
        before = _stats()
        cached = engine.execute(query, weights=weights)
        runs["in cache"].append((cached, _moved(before)))
        engine.reset_cache()
        before = _stats()
        stock = engine.stock(query, weights=weights)
        runs["stock"].append((stock, _moved(before)))
        same += [runs[way][-1][0].text == cached.text for way in ("store", "store, disk")]
    med = statistics.median
    ttft = {way: med(r.metrics.ttft_s for r, _ in v) for way, v in runs.items()}
    rows = []
    for way, results in runs.items():
        rows.append({
            "way": way, "n_docs": k, "doc_tokens": len(engine.tokenizer.encode(docs[0])),
            "ttft_s": ttft[way],
            "vs_stock": ttft[way] / ttft["stock"], "vs_in_cache": ttft[way] / ttft["in cache"],
            "final_steps": int(med(r.metrics.final_steps for r, _ in results)),
            "prepare_requests": int(med(r.metrics.prepare_requests for r, _ in results)),
            "cached_tokens": int(med(r.metrics.cached_tokens for r, _ in results)),
            "prompt_tokens": int(med(r.metrics.prompt_tokens for r, _ in results)),
            "store_blocks": int(med(m.get("store_hit_blocks", 0) for _, m in results)),
            "bad_blocks": sum(m.get("store_bad_blocks", 0) for _, m in results),
            "same_output": all(same), "weights": results[-1][0].metrics.weights,
            "index_s": report.seconds, "indexed_docs": report.documents,
        })
    return rows, [r.metrics.ttft_s for r, _ in runs["stock"]]


def bench_load(engine: Any, stock_rows: dict[str, Any], max_blocks: int = 512
               ) -> dict[str, Any]:
    """The load-throughput row of the module doc (reads the engine's store directly)."""
    import torch

    import span_vllm

    local = span_vllm.span_store_local()
    if local is None:
        raise RuntimeError("the engine in this process has no span store")
    store, shape, dtype = local
    entries = list(store.files())[:max_blocks]
    layers = [torch.empty(shape[1:], dtype=dtype) for _ in range(shape[0])]
    block_bytes = sum(t.numel() * t.element_size() for t in layers)

    def read_all(cold: bool) -> float:
        spent = 0.0
        for entry in entries:
            if cold:
                _drop_pages(entry.path)
            start = time.perf_counter()
            if store.read_into(bytes.fromhex(entry.name[: -len(".kv")]), layers) is None:
                raise RuntimeError(f"bench store: {entry.path} did not load")
            spent += time.perf_counter() - start
        return spent

    read_all(False)  # into the page cache
    warm = min(read_all(False) for _ in range(3))
    cold = min(read_all(True) for _ in range(3))
    total = block_bytes * len(entries)
    disk_bytes = store.size_bytes()
    files = sum(1 for _ in store.files())
    stored_tokens = files * engine.block_size
    compute = (stock_rows["prompt_tokens"] * block_bytes / engine.block_size
               / stock_rows["ttft_s"])
    return {"way": "load", "blocks_read": len(entries), "block_bytes": block_bytes,
            "store_gb_per_s_page_cache": total / warm / 1e9,
            "store_gb_per_s_disk": total / cold / 1e9,
            "compute_kv_gb_per_s": compute / 1e9,
            "store_over_compute_disk": (total / cold) / compute,
            "disk_bytes_per_token": disk_bytes / stored_tokens if stored_tokens else 0.0,
            "kv_bytes_per_token": block_bytes / engine.block_size, "store_files": files}


def _drop_store_pages() -> None:
    """Drop every file of the engine's store in this process from the page cache."""
    import span_vllm

    local = span_vllm.span_store_local()
    if local is None:
        raise RuntimeError("the engine in this process has no span store")
    for entry in local[0].files():
        _drop_pages(entry.path)


def _drop_pages(path: str) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (a cold read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages are not dropped: write them first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_corpus(engine: Any, docs: list[str], indexed: int, queries: int, seed: int,
                 progress: bool = True) -> dict[str, Any]:
    """The large-corpus row of the module doc on ``engine`` (a fresh start on the store, whose
    first ``indexed`` documents of ``docs`` an earlier engine indexed)."""
    from tqdm.auto import tqdm

    from span_vllm import span_store_flush
    from span_workflows.query.builders import rag
    from span_workflows.runtime.store_index import index_documents

    rng = random.Random(seed)
    first_pick = rng.sample(docs[:indexed], min(indexed, CORPUS_QUERY_DOCS))
    before = _stats()  # the first query after the restart, on documents indexed before it
    first = engine.execute(rag(SYSTEM, first_pick, QUESTION, max_tokens=8))
    first_moved = _moved(before)
    report = index_documents(engine, docs, SYSTEM, batch_size=8, progress=progress)
    span_store_flush()
    spans = computed = from_store = from_cache = 0
    for _ in tqdm(range(queries), desc="store: corpus", disable=not progress):
        pick = rng.sample(docs, CORPUS_QUERY_DOCS)
        before = _stats()
        result = engine.execute(rag(SYSTEM, pick, QUESTION, max_tokens=8))
        moved = _moved(before)
        spans += result.query.num_span_tokens if result.query else 0
        # each source from its own counter (a block loaded from the store is neither a
        # cache hit nor computed); what none of them counts is reported, not assigned
        from_cache += moved.get("hit_blocks", 0) * engine.block_size
        from_store += moved.get("store_hit_blocks", 0) * engine.block_size
        computed += moved.get("miss_blocks", 0) * engine.block_size
    served = from_cache + from_store
    total = served + computed
    corpus_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False))
                        for d in docs)
    return {"way": "corpus", "cache_tokens": engine.cache_tokens,
            "corpus_docs": len(docs), "corpus_tokens": corpus_tokens,
            "corpus_over_cache": corpus_tokens / engine.cache_tokens,
            "index_s": report.seconds,
            "queries": queries, "span_tokens": total,
            "span_tokens_of_queries": spans,
            "served_share": served / total if total else 0.0,
            "from_store_share": from_store / total if total else 0.0,
            "from_cache_share": from_cache / total if total else 0.0,
            "first_query_final_steps": first.metrics.final_steps,
            "first_query_prepares": first.metrics.prepare_requests,
            "first_query_store_blocks": first_moved.get("store_hit_blocks", 0),
            "first_query_miss_blocks": first_moved.get("miss_blocks", 0)}


def run_store(argv: list[str]) -> int:
    """``bench store``: the table; ``store.json`` / ``store.md`` / ``store.png`` unless
    ``--no-write``."""
    args = _parser().parse_args(argv)
    from span_workflows.apps.bench.provenance import stamp
    from span_workflows.apps.bench.report import print_table
    from span_workflows.apps.demo.corpus import documents
    from span_workflows.runtime.engine import Engine

    directory = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="span-store-"))
    try:
        engine = Engine(args.model, kv_cache_gib=4, progress=True, span_store=directory)
        try:
            pool = documents(engine.tokenizer, 3 * args.docs, args.doc_tokens)
            ways, _ = bench_ways(engine, pool, args.docs, args.reps)
            stock = next(r for r in ways if r["way"] == "stock")
            load = bench_load(engine, stock)
            rows = stamp(ways + [load], engine, reps=args.reps)
        finally:
            engine.close()
        engine = Engine(args.model, kv_cache_blocks=args.cache_blocks, progress=True,
                        span_store=directory)
        try:
            corpus_tokens = args.corpus_factor * engine.cache_tokens
            corpus = documents(engine.tokenizer, 3 * args.docs + corpus_tokens // args.doc_tokens,
                               args.doc_tokens)
            # the first 3 x docs were indexed by the first engine: the restart's first query
            rows += stamp([bench_corpus(engine, corpus, 3 * args.docs, args.queries,
                                        args.seed)], engine, reps=1)  # each query once
        finally:
            engine.close()
    finally:
        if not args.store:
            shutil.rmtree(directory, ignore_errors=True)
    print_table(rows)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "store.json").write_text(json.dumps(rows, indent=2) + "\n")
        (args.out / "store.md").write_text(markdown(rows))
        plot_store(rows, args.out / "store.png")
    return 0


def markdown(rows: list[dict[str, Any]]) -> str:
    """The three tables of the run, in Markdown."""
    ways = [r for r in rows if r["way"] in WAYS]
    load = next(r for r in rows if r["way"] == "load")
    corpus = next(r for r in rows if r["way"] == "corpus")
    first = ways[0]
    lines = [f"# bench store ({first['n_docs']} documents x {first['doc_tokens']} tokens, a new "
             f"combination; commit {first.get('commit', '?')}, {first.get('reps', '?')} reps)",
             "", "| way | TTFT (s) | vs stock | vs in cache | final steps | store blocks |"
             " same output |", "|---|---|---|---|---|---|---|"]
    for r in ways:
        lines.append(f"| {r['way']} | {r['ttft_s']:.3f} | {r['vs_stock']:.3f} | "
                     f"{r['vs_in_cache']:.2f} | {r['final_steps']} | {r['store_blocks']} | "
                     f"{r['same_output']} |")
    lines += ["", "| load | GB/s |", "|---|---|",
              f"| store, page cache | {load['store_gb_per_s_page_cache']:.2f} |",
              f"| store, disk | {load['store_gb_per_s_disk']:.2f} |",
              f"| computing the KV (stock prefill) | {load['compute_kv_gb_per_s']:.4f} |",
              "", f"Disk bytes per token: {load['disk_bytes_per_token']:.0f} "
              f"(KV bytes per token {load['kv_bytes_per_token']:.0f}).", "",
              f"Corpus of {corpus['corpus_over_cache']:.1f}x the KV cache "
              f"({corpus['corpus_tokens']} tokens, cache {corpus['cache_tokens']}), "
              f"{corpus['queries']} queries of {CORPUS_QUERY_DOCS} random documents: "
              f"{100 * corpus['served_share']:.1f} % of span tokens from cache or store "
              f"({100 * corpus['from_cache_share']:.1f} % cache, "
              f"{100 * corpus['from_store_share']:.1f} % store). First query after the "
              f"restart: {corpus['first_query_final_steps']} step(s), "
              f"{corpus['first_query_store_blocks']} blocks from the store, "
              f"{corpus['first_query_miss_blocks']} computed.", ""]
    return "\n".join(lines)


def plot_store(rows: list[dict[str, Any]], path: Path) -> None:
    """TTFT of the three ways (log scale) and the large corpus's token sources."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from span_workflows.apps.bench.report import save_figure

    ways = [r for r in rows if r["way"] in WAYS]
    corpus = next(r for r in rows if r["way"] == "corpus")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"in cache": "#55a868", "store": "#4c72b0", "store, disk": "#8172b2",
              "stock": "#c44e52"}
    left.bar([r["way"] for r in ways], [r["ttft_s"] for r in ways],
             color=[colors[r["way"]] for r in ways])
    left.set_yscale("log")
    left.set_ylabel("TTFT (s)")
    left.set_title(f"{ways[0]['n_docs']} x {ways[0]['doc_tokens']} tokens, new combination")
    shares = [corpus["from_cache_share"], corpus["from_store_share"],
              1 - corpus["served_share"]]
    right.bar(["KV cache", "span store", "computed"], [100 * s for s in shares],
              color=["#55a868", "#4c72b0", "#c44e52"])
    right.set_ylabel("% of span tokens")
    right.set_title(f"corpus {corpus['corpus_over_cache']:.0f}x the KV cache")
    fig.suptitle("span-workflows bench store")
    save_figure(fig, path)


def _parser() -> argparse.ArgumentParser:
    parser = new_parser("store")
    parser.add_argument("--docs", type=int, default=16, help="documents per query (default 16)")
    parser.add_argument("--doc-tokens", type=int, default=440,
                        help="tokens per document (default 440)")
    parser.add_argument("--reps", type=int, default=3,
                        help="new combinations asked; medians reported (default 3)")
    parser.add_argument("--cache-blocks", type=int, default=128,
                        help="KV cache of the large-corpus engine, in blocks (default 128)")
    parser.add_argument("--corpus-factor", type=int, default=10,
                        help="the large corpus in KV caches (default 10)")
    parser.add_argument("--queries", type=int, default=24,
                        help="queries over the large corpus (default 24)")
    parser.add_argument("--store", type=Path, default=None,
                        help="the store's directory (default: a temporary one, removed)")
    add_results_dir(parser, "store")
    return parser


__all__ = ["bench_corpus", "bench_load", "bench_ways", "markdown", "plot_store", "run_store"]
