"""``span-workflows bench <name>``: stock vLLM vs span queries, side by side in one run.

Every number of one table comes from the same process, engine, model and inputs, so ratios are
meaningful on a shared, noisy machine even when absolute times are not.

* ``rag`` — N documents × ``--doc-tokens`` tokens and a question: TTFT of *stock* (plain chat
  prompt, vLLM prefix caching on, documents shuffled per request as a retriever returns them),
  *span miss* (empty cache, prepares included), *span hit* (same documents seen before in another
  order) and the *floor* (the question alone).
* ``nested`` — judge/generator with a fan-out of n drafts: TTFT of the judge call.
* ``reposition`` — KV re-rotation throughput (tokens/ms) vs a plain copy of the same bytes.
* ``compile`` — client overhead of optimize + compile per query.
* ``route`` — routers over span-engine replicas (:mod:`span_workflows.apps.bench_route`).
* ``locality`` — needle in a haystack: extraction accuracy of a flat judge vs the tournament
  rewrite, crop on and off (:mod:`span_workflows.apps.bench_locality`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from span_workflows.apps.report import plot, print_table
from span_workflows.builders import g, judge_generator, rag, user

#: Where the committed results live (``benchmarks/results`` of the repository).
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
QUESTION = "Which module do the documents describe first, in one short sentence?"
_STDLIB = (
    "json", "pathlib", "itertools", "functools", "collections", "datetime", "re", "asyncio",
    "heapq", "bisect", "statistics", "textwrap", "shutil", "tempfile", "csv", "sqlite3",
    "zipfile", "argparse", "logging", "random", "decimal", "fractions", "uuid", "hashlib",
    "difflib", "enum", "dataclasses", "typing", "contextlib", "copy", "pickle", "threading",
    "queue", "subprocess", "socket", "calendar", "tarfile", "glob", "weakref", "operator",
)


def documents(tokenizer: Any, count: int, doc_tokens: int) -> list[str]:
    """``count`` distinct documents of about ``doc_tokens`` tokens of real English text (the
    standard library's documentation), deterministic."""
    import importlib

    text = []
    for name in _STDLIB:
        module = importlib.import_module(name)
        text.append(module.__doc__ or "")
        for attr in sorted(dir(module))[:40]:
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and not attr.startswith("_"):
                text.append(doc)
    ids = tokenizer.encode("\n".join(text), add_special_tokens=False)
    need = count * doc_tokens
    while len(ids) < need:
        ids = ids + ids
    return [tokenizer.decode(ids[i * doc_tokens:(i + 1) * doc_tokens]) for i in range(count)]


def bench_rag(engine: Any, docs_counts: Sequence[int], doc_tokens: int, reps: int,
              progress: bool = True) -> list[dict[str, Any]]:
    """One row per document count; see the module docstring."""
    from tqdm.auto import tqdm

    rng = random.Random(0)
    docs = documents(engine.tokenizer, max(docs_counts) * (reps + 2), doc_tokens)
    rows = []
    for n in tqdm(docs_counts, desc="rag", disable=not progress):
        stock, miss, hit, floor, same, hits = [], [], [], [], [], []
        for rep in range(reps):
            chosen = docs[(rep * n) % len(docs):][:n]
            if len(chosen) < n:
                chosen = docs[:n]
            shuffled = chosen[:]
            rng.shuffle(shuffled)
            stock.append(engine.stock(rag(SYSTEM, shuffled, QUESTION, max_tokens=8)).metrics.ttft_s)
            engine.reset_cache()
            first = engine.execute(rag(SYSTEM, chosen, QUESTION, max_tokens=8))
            miss.append(first.metrics.ttft_s)
            again = engine.execute(rag(SYSTEM, list(reversed(chosen)), QUESTION, max_tokens=8))
            hit.append(again.metrics.ttft_s)
            doc_span_tokens = again.query.num_span_tokens if again.query else 0
            cached_docs = max(0, again.metrics.cached_tokens - _prefix_len(again))
            hits.append(cached_docs / doc_span_tokens if doc_span_tokens else 0.0)
            same.append(first.text == again.text)
            engine.reset_cache()
            floor.append(engine.stock(g(user(QUESTION), max_tokens=1, temperature=0.0))
                         .metrics.ttft_s)
        med = statistics.median
        rows.append({
            "n_docs": n,
            "ttft_stock_s": med(stock), "ttft_span_miss_s": med(miss),
            "ttft_span_hit_s": med(hit), "ttft_floor_s": med(floor),
            "speedup_hit": med(stock) / med(hit), "speedup_miss": med(stock) / med(miss),
            "hit_rate": med(hits), "same_output": all(same),
        })
    return rows


def _prefix_len(result: Any) -> int:
    spans = result.query.spans if result.query else []
    return spans[0].length if spans and spans[0].kind == "prefix" else 0


def bench_nested(engine: Any, fanouts: Sequence[int], reps: int,
                 progress: bool = True) -> list[dict[str, Any]]:
    """Judge TTFT with n drafts: stock (drafts pasted as chat turns) vs span (drafts reused)."""
    from tqdm.auto import tqdm

    rows = []
    for n in tqdm(fanouts, desc="nested", disable=not progress):
        stock, span = [], []
        for rep in range(reps):
            q = judge_generator(
                n, f"Write two sentences about a lighthouse (variant {rep}).",
                "Which draft is best? Answer with its number.", max_tokens=96,
                judge_max_tokens=4, temperature=0.5,
            )
            engine.reset_cache()
            stock.append(_judge_ttft(engine.stock(q)))
            engine.reset_cache()
            span.append(_judge_ttft(engine.execute(q)))
        med = statistics.median
        rows.append({"fanout": n, "ttft_judge_stock_s": med(stock),
                     "ttft_judge_span_s": med(span), "speedup": med(stock) / med(span)})
    return rows


def _judge_ttft(result: Any) -> float:
    """TTFT of the outer judge call alone: its first token minus the end of its drafts."""
    return result.metrics.final_ttft_s


def bench_reposition(block_counts: Sequence[int], reps: int = 5) -> list[dict[str, Any]]:
    """Rotation of SmolLM2-shaped CPU KV blocks (30 layers) vs a plain copy of the key bytes."""
    import torch

    from span_vllm import CpuKeyLayout, RopeRotator

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
        rows.append({"blocks": blocks, "tokens": tokens,
                     "rotate_tokens_per_ms": tokens / (rot * 1000),
                     "copy_tokens_per_ms": tokens / (cp * 1000), "ratio_to_copy": cp / rot})
    return rows


def bench_compile(engine: Any, docs_counts: Sequence[int], doc_tokens: int,
                  reps: int = 5) -> list[dict[str, Any]]:
    """Optimize + compile time per RAG query (warm fragment-token cache), and its share of the
    span-hit TTFT measured in the same run."""
    from span_workflows.optimize import optimize

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


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_bench(name: str, argv: Sequence[str]) -> int:
    """CLI entry: parse ``argv`` for benchmark ``name``, run it, print/write its table."""
    if name == "route":
        from span_workflows.apps.bench_route import run_route

        return run_route(argv)
    parser = argparse.ArgumentParser(prog=f"span-workflows bench {name}")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--docs", type=_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--doc-tokens", type=int, default=440)
    parser.add_argument("--fanout", type=_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--blocks", type=_ints, default=[1, 16, 64, 256])
    parser.add_argument("--model", help="local HF model directory")
    parser.add_argument("--hay-chars", type=_ints, default=[0, 200, 400, 800])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--positions", type=lambda t: [p for p in t.split(",") if p],
                        default=["start", "middle", "end"])
    parser.add_argument("--no-crop", action="store_true",
                        help="locality: run with cropping off only (default: on and off)")
    parser.add_argument("--markdown", type=Path, help="locality: write the table here")
    parser.add_argument("--copy-tokens", type=int, default=8,
                        help="locality: tokens each inner generation copies (0: all)")
    args = parser.parse_args(list(argv))
    if name not in ("rag", "nested", "reposition", "compile", "locality"):
        from span_workflows.errors import SpanQueryError

        raise SpanQueryError("bench", f"unknown benchmark {name!r} "
                                      "(rag, nested, reposition, compile, locality)")
    if name == "locality":
        from span_workflows.apps.bench_locality import run_locality

        return run_locality(args)
    if name == "reposition":
        rows = bench_reposition(args.blocks, max(args.reps, 21))  # cheap: a steadier median
        x, ys, label = "blocks", ["rotate_tokens_per_ms", "copy_tokens_per_ms"], "tokens / ms"
    else:
        from span_workflows.engine import Engine

        engine = Engine(args.model, kv_cache_gib=4, progress=True)
        try:
            if name == "rag":
                rows = bench_rag(engine, args.docs, args.doc_tokens, args.reps)
                x, ys = "n_docs", ["ttft_stock_s", "ttft_span_miss_s", "ttft_span_hit_s",
                                   "ttft_floor_s"]
                label = "TTFT (s)"
            elif name == "nested":
                rows = bench_nested(engine, args.fanout, args.reps)
                x, ys, label = "fanout", ["ttft_judge_stock_s", "ttft_judge_span_s"], "TTFT (s)"
            else:
                rows = bench_compile(engine, args.docs, args.doc_tokens, args.reps)
                x, ys, label = "n_docs", ["compile_s", "ttft_span_hit_s"], "seconds"
        finally:
            engine.close()
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, x, ys, args.plot, f"span-workflows bench {name}", label)
    return 0
