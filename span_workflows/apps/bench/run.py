"""``span-workflows bench <name>``: stock vLLM vs span queries, side by side in one run.

Every number of one table comes from the same process, engine, model and inputs, so ratios are
meaningful on a shared, noisy machine even when absolute times are not.

* ``rag`` — N documents × ``--doc-tokens`` tokens and a question: TTFT, engine steps and
  prompt tokens computed (``Metrics.computed_tokens``: what carries over to a GPU) of
  *stock* (plain chat prompt, vLLM prefix caching on, documents shuffled per request as a
  retriever returns them), *span miss* (empty cache, prepares included), *span hit* of the same
  documents seen before in another order (*reordered*) and of a *new combination* (every
  document cached by earlier queries of N documents, never this set: what a retriever asks),
  *new documents* (none cached, the system prompt seen before: what every retrieval after an
  engine's first computes; stock beside it after the same earlier query, its prefix cache
  holding what vLLM keeps of it), the *floor* (the system prompt and question alone, stock, on
  the weights stock runs on) and *stock's exact repeat* (the same stock prompt again, every
  document from vLLM's prefix cache: what reading the cached documents costs any engine, the
  floor a hit can reach). The *linked* new combination is the same on the weights stock runs on
  with the engine's own span options (the base's default: link blocks computed in the answer's
  step), what a model nobody made span-ready gets.
* ``nested`` — judge/generator with a fan-out of n drafts, for each ``align``: the judge's
  TTFT and engine steps, the draft tokens it reads from cache and loses, the drafts' extra
  decode steps (:mod:`span_workflows.apps.bench.align`).
* ``reposition`` — KV re-rotation throughput (tokens/ms) vs a plain copy of the same bytes.
* ``compile`` — client overhead of optimize + compile per query, and the plugin's block
  hashing cost per block at 1k / 32k / 128k tokens (plain and span layouts).
* ``route`` — routers over span-engine replicas (:mod:`span_workflows.apps.bench.route`).
* ``locality`` — needle in a haystack: extraction accuracy of a flat judge vs the tournament
  rewrite, per ``align`` (:mod:`span_workflows.apps.bench.locality`).
* ``needle`` — a needle in the drafts' output at their start, middle or end: the judge's exact
  match per ``align`` and stock (:mod:`span_workflows.apps.bench.align`).
* ``lint`` — ``span-workflows lint`` on a labelled set of commuting and order-dependent
  pluses: the share flagged by static checks and with the order check
  (:mod:`span_workflows.apps.bench.lint`).
* ``quality`` — answer accuracy of stock and every span mode on invented-fact RAG questions,
  with first-token KL and span-hit TTFT (:mod:`span_workflows.apps.bench.quality`).
* ``bulk`` — a bulk of RAG queries in arrival order, shuffled and clustered by shared spans,
  on one engine and on Ray actors (:mod:`span_workflows.apps.bench.bulk`).
* ``lora`` — prefill TTFT and decode throughput of the base and of the span-ready adapter,
  as LoRA beside the base and merged (:mod:`span_workflows.apps.bench.lora`).
* ``store`` — the span store: a new combination's TTFT from the store vs the KV cache vs
  stock, load throughput, and a corpus over 10x the KV cache
  (:mod:`span_workflows.apps.bench.store`).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from span_workflows.apps.bench.provenance import stamp
from span_workflows.apps.bench.report import plot, print_table
from span_workflows.apps.demo.corpus import documents
from span_workflows.query.builders import g, rag, system, user

SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
QUESTION = "Which module do the documents describe first, in one short sentence?"


def bench_rag(engine: Any, docs_counts: Sequence[int], doc_tokens: int, reps: int,
              progress: bool = True) -> list[dict[str, Any]]:
    """One row per document count; see the module docstring."""
    from tqdm.auto import tqdm

    from span_workflows.apps.bench.provenance import provenance
    from span_workflows.apps.bench.quality import new_combinations

    rng = random.Random(0)
    base = engine.model_name  # the weights stock queries run on
    *docs, other_doc = documents(engine.tokenizer, max(docs_counts) * 3 + 1, doc_tokens)
    warm_up = rag(SYSTEM, [other_doc], QUESTION, max_tokens=1)  # a document of no pool
    rows = []
    for n in tqdm(docs_counts, desc="rag", disable=not progress):
        runs: dict[str, list[Any]] = {k: [] for k in ("stock", "stock_repeat", "miss", "hit",
                                                      "combo", "linked", "floor",
                                                      "stock_new_docs", "new_docs")}
        same, hits = [], []
        pool = docs[: 3 * n]
        seen, fresh = new_combinations(pool, n, reps, seed=n) if n > 1 else (
            [[d] for d in pool], [[pool[0]]] * reps)
        for rep in range(reps):
            chosen = seen[rep % len(seen)]
            shuffled = chosen[:]
            rng.shuffle(shuffled)
            stock_query = rag(SYSTEM, shuffled, QUESTION, max_tokens=8)
            span_query = rag(SYSTEM, chosen, QUESTION, max_tokens=8)
            runs["stock"].append(engine.stock(stock_query))
            # stock's own best case: the exact same prompt again (all but its last tokens
            # from vLLM's prefix cache): what reading the cached documents costs any engine
            runs["stock_repeat"].append(engine.stock(stock_query))
            engine.reset_cache()
            first = engine.execute(span_query)
            runs["miss"].append(first)
            again = engine.execute(rag(SYSTEM, list(reversed(chosen)), QUESTION, max_tokens=8))
            runs["hit"].append(again)
            doc_span_tokens = again.query.num_span_tokens if again.query else 0
            cached_docs = max(0, again.metrics.cached_tokens - _prefix_len(again))
            hits.append(cached_docs / doc_span_tokens if doc_span_tokens else 0.0)
            same.append(first.text == again.text)
            # a new combination: every document cached by an earlier query, never this set
            combo, fresh_same = _new_combination(engine, seen, fresh[rep])
            runs["combo"].append(combo)
            # the same on the base with its own default options (link blocks)
            linked, linked_same = _new_combination(engine, seen, fresh[rep], base)
            runs["linked"].append(linked)
            same += [fresh_same, linked_same]
            # the prompt without the documents, on the weights stock queries run on
            runs["floor"].append(engine.stock(g([system(SYSTEM), user(QUESTION)],
                                                max_tokens=1, temperature=0.0)))
            # new documents after one earlier query with the same system prompt, both ways
            engine.reset_cache()
            engine.stock(warm_up)
            engine.execute(warm_up)
            runs["stock_new_docs"].append(engine.stock(stock_query))
            runs["new_docs"].append(engine.execute(span_query))
        med = statistics.median
        ttft = {k: med(r.metrics.ttft_s for r in v) for k, v in runs.items()}
        steps = {k: int(med(r.metrics.engine_steps for r in v)) for k, v in runs.items()}
        computed = {k: int(med(r.metrics.computed_tokens for r in v)) for k, v in runs.items()}
        rows.append({
            "n_docs": n,
            "ttft_stock_s": ttft["stock"], "ttft_span_miss_s": ttft["miss"],
            "ttft_span_hit_s": ttft["hit"], "ttft_span_new_combination_s": ttft["combo"],
            "ttft_floor_s": ttft["floor"], "ttft_stock_repeat_s": ttft["stock_repeat"],
            "tokens_stock_repeat": computed["stock_repeat"],
            "new_combination_over_stock_repeat": ttft["combo"] / ttft["stock_repeat"],
            "speedup_hit": ttft["stock"] / ttft["hit"],
            "speedup_new_combination": ttft["stock"] / ttft["combo"],
            "speedup_miss": ttft["stock"] / ttft["miss"],
            "ttft_stock_new_docs_s": ttft["stock_new_docs"],
            "ttft_span_new_docs_s": ttft["new_docs"],
            "speedup_new_docs": ttft["stock_new_docs"] / ttft["new_docs"],
            "steps_new_docs": steps["new_docs"],
            "tokens_stock_new_docs": computed["stock_new_docs"],
            "tokens_new_docs": computed["new_docs"],
            "hit_over_floor": ttft["hit"] / ttft["floor"],
            "new_combination_over_floor": ttft["combo"] / ttft["floor"],
            "ttft_linked_new_combination_s": ttft["linked"],
            "steps_linked_new_combination": steps["linked"],
            "tokens_linked_new_combination": computed["linked"],
            "speedup_linked_new_combination": ttft["stock"] / ttft["linked"],
            "linked_new_combination_over_floor": ttft["linked"] / ttft["floor"],
            "link_blocks_linked": runs["linked"][-1].query.options.link_blocks
            if runs["linked"][-1].query else None,
            "link_requests_linked": runs["linked"][-1].metrics.link_requests,
            "weights_linked": runs["linked"][-1].metrics.weights,
            "steps_stock": steps["stock"], "steps_miss": steps["miss"],
            "steps_hit": steps["hit"], "steps_new_combination": steps["combo"],
            "tokens_stock": computed["stock"], "tokens_miss": computed["miss"],
            "tokens_hit": computed["hit"], "tokens_new_combination": computed["combo"],
            "miss_tokens_over_stock": computed["miss"] / computed["stock"],
            "hit_rate": med(hits), "same_output": all(same),
            "weights_span": runs["combo"][-1].metrics.weights,
            "weights_stock": runs["stock"][-1].metrics.weights,
            **provenance(engine, reps=reps),
        })
    return rows


def _new_combination(engine: Any, seen: Sequence[Sequence[Any]], fresh: Sequence[Any],
                     weights: str | None = None) -> tuple[Any, bool]:
    """``fresh`` asked on an emptied cache after every set of ``seen`` (each of its documents
    cached by an earlier query, never this set), on ``weights`` (``None``: the router's
    choice): its result, and whether it answers as a fresh engine does (``fresh`` asked again
    on an emptied cache, which is left empty)."""
    query = rag(SYSTEM, list(fresh), QUESTION, max_tokens=8)
    engine.reset_cache()
    for earlier in seen:
        engine.execute(rag(SYSTEM, list(earlier), QUESTION, max_tokens=1), weights=weights)
    hit = engine.execute(query, weights=weights)
    engine.reset_cache()
    alone = engine.execute(query, weights=weights)
    engine.reset_cache()
    return hit, alone.text == hit.text


def _prefix_len(result: Any) -> int:
    spans = result.query.spans if result.query else []
    return spans[0].length if spans and spans[0].kind == "prefix" else 0


def bench_reposition(block_counts: Sequence[int], reps: int = 5) -> list[dict[str, Any]]:
    """Rotation of SmolLM2-shaped CPU KV blocks (30 layers) vs a plain copy of the key bytes."""
    import torch

    from span_vllm import CpuKeyLayout, RopeRotator
    from span_workflows.compiler.model import BASE_MODEL_NAME

    layers, heads, bs, dim = 30, 3, 32, 64
    rotator, layout = RopeRotator.from_base(100000.0, dim), CpuKeyLayout(dim)
    rows = []
    for blocks in block_counts:
        caches = [torch.randn(max(blocks * 2, 8), heads, bs, 2 * dim) for _ in range(layers)]
        moves = [(i * 2, 17 + i) for i in range(blocks)]
        ids = torch.tensor([b for b, _ in moves])
        rotator.apply(caches, layout, moves)  # warm-up: allocator and kernels
        rot_t, copy_t = [], []
        for _ in range(reps):
            t = time.perf_counter()
            rotator.apply(caches, layout, moves)
            rot_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            for cache in caches:  # the same key bytes read and written back, nothing else
                keys = layout.keys(cache)
                keys.index_copy_(0, ids, keys.index_select(0, ids))
            copy_t.append(time.perf_counter() - t)
        tokens = blocks * bs
        rot, cp = statistics.median(rot_t), statistics.median(copy_t)
        rows.append({"model": f"{BASE_MODEL_NAME} KV shapes (random values): {layers} "
                              f"layers, {heads} KV heads of {dim}, blocks of {bs}",
                     "blocks": blocks, "tokens": tokens,
                     "rotate_tokens_per_ms": tokens / (rot * 1000),
                     "copy_tokens_per_ms": tokens / (cp * 1000), "ratio_to_copy": cp / rot})
    return rows


def bench_compile(engine: Any, docs_counts: Sequence[int], doc_tokens: int,
                  reps: int = 5) -> list[dict[str, Any]]:
    """Optimize + compile time per RAG query (warm fragment-token cache), and its share of the
    span-hit TTFT measured in the same run."""
    from span_workflows.compiler.optimize import optimize

    docs = documents(engine.tokenizer, max(docs_counts), doc_tokens)
    rows = []
    for n in docs_counts:
        q = rag(SYSTEM, docs[:n], QUESTION, max_tokens=8)
        engine.execute(q)
        hit = statistics.median(engine.execute(q).metrics.ttft_s for _ in range(3))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            engine.compiler.compile_generate(optimize(q))
            times.append(time.perf_counter() - t)
        c = statistics.median(times)
        rows.append({"n_docs": n, "compile_s": c, "ttft_span_hit_s": hit,
                     "share_of_hit_ttft": c / hit})
    return rows


def bench_hashing(token_counts: Sequence[int] = (1024, 32768, 131072), block_size: int = 16,
                  span_tokens: int = 512, reps: int = 3) -> list[dict[str, Any]]:
    """The plugin's block-hashing cost per block for prompts of ``token_counts`` tokens at
    ``block_size``, plain (stock rules) and cut into spans of ``span_tokens`` (every span
    anchored after the first, isolated ones in between): flat per block when the chain root
    travels with the hashes, growing with the length when each block scans back for it."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    from span_vllm import hash_blocks
    from span_vllm.contract import ANCHORED, ISOLATED, ORDERED

    kv_cache_utils.init_none_hash(sha256)
    rows = []
    for count in token_counts:
        tokens = [(7 * i) % 32000 for i in range(count)]
        spans: list[tuple[int, str]] = [(0, ORDERED)]
        spans += [(start, ANCHORED if (start // span_tokens) % 2 else ISOLATED)
                  for start in range(span_tokens, count - span_tokens, span_tokens)]
        spans.append((count - span_tokens // 2, ORDERED))
        blocks = count // block_size
        row: dict[str, Any] = {"tokens": count, "blocks": blocks}
        for name, segments in (("plain", ()), ("spans", tuple(spans))):
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                hash_blocks(tokens, block_size, sha256, segments)
                times.append(time.perf_counter() - started)
            row[f"{name}_us_per_block"] = statistics.median(times) / blocks * 1e6
        rows.append(row)
    return rows


def run_bench(name: str, argv: Sequence[str]) -> int:
    """CLI entry: parse ``argv`` for benchmark ``name``, run it, print/write its table. A
    training run on this machine is waited for first (:mod:`span_workflows.tune.lock`) unless
    ``argv`` says ``--no-wait`` or asks for help (which measures nothing)."""
    argv = list(argv)
    if "--no-wait" in argv:
        argv.remove("--no-wait")
    elif not {"-h", "--help"} & set(argv):
        from span_workflows.tune.lock import wait_for_training

        wait_for_training()
    if name == "route":
        from span_workflows.apps.bench.route import run_route

        return run_route(argv)
    if name == "bulk":
        from span_workflows.apps.bench.bulk import run_bulk_bench

        return run_bulk_bench(argv)
    if name == "store":
        from span_workflows.apps.bench.store import run_store

        return run_store(list(argv))
    from span_workflows.apps.bench.options import BENCHMARKS, bench_parser

    parser = bench_parser(name)
    args = parser.parse_args(list(argv))
    if name not in BENCHMARKS:
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("bench", f"unknown benchmark {name!r} ({', '.join(BENCHMARKS)})")
    if name == "quality":
        from span_workflows.apps.bench.quality import run_quality

        return run_quality(args)
    if name == "lint":
        from span_workflows.apps.bench.lint import run_lint_bench

        return run_lint_bench(args)
    if name == "lora":
        from span_workflows.apps.bench.lora import run_lora

        return run_lora(args)
    args.docs = args.docs or [1, 2, 4, 8, 16]
    if name == "locality":
        from span_workflows.apps.bench.locality import run_locality

        args.hay_chars = args.hay_chars or [0, 200, 400, 800]
        return run_locality(args)
    if name in ("nested", "needle"):
        from span_workflows.apps.bench.align import run_needle, run_nested

        args.hay_chars = args.hay_chars or [10, 100, 1000]
        return run_nested(args) if name == "nested" else run_needle(args)
    if name == "reposition":
        rows = stamp(bench_reposition(args.blocks, max(args.reps, 21)),  # cheap: steadier
                     reps=max(args.reps, 21))
        x, ys, label = "blocks", ["rotate_tokens_per_ms", "copy_tokens_per_ms"], "tokens / ms"
    else:
        from span_workflows.runtime.engine import Engine

        engine = Engine(args.model, kv_cache_gib=4, progress=True)
        try:
            if name == "rag":
                rows = bench_rag(engine, args.docs, args.doc_tokens, args.reps)
                x, ys = "n_docs", ["ttft_stock_s", "ttft_span_miss_s",
                                   "ttft_stock_new_docs_s", "ttft_span_new_docs_s",
                                   "ttft_span_hit_s", "ttft_span_new_combination_s",
                                   "ttft_linked_new_combination_s", "ttft_floor_s"]
                label = "TTFT (s)"
            else:
                rows = stamp(bench_compile(engine, args.docs, args.doc_tokens, args.reps),
                             engine, reps=args.reps)
                x, ys, label = "n_docs", ["compile_s", "ttft_span_hit_s"], "seconds"
        finally:
            engine.close()
    print_table(rows)
    written: Any = rows
    if name == "compile":  # and the plugin's share: block hashing per block, by length
        hashing = bench_hashing(reps=args.reps)
        print()
        print_table(hashing)
        written = {"compile": rows, "hashing": stamp(hashing, engine, reps=args.reps)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(written, indent=2) + "\n")
    if args.plot:
        plot(rows, x, ys, args.plot, f"span-workflows bench {name}", label)
    return 0
