"""``span-workflows bench bulk``: one bulk of RAG queries in arrival order, shuffled and
clustered, on one engine and on two Ray actors, side by side.

**Trace** (:func:`make_trace`): documents of ``doc_tokens`` tokens (standard-library
documentation, :func:`span_workflows.apps.demo.corpus.documents`) in *topics* of 8, a retriever's
neighbourhoods; topics are Zipf-popular (``s`` = 0.9); each query retrieves k = 5 documents,
``topic_docs`` (default 4) of its topic's and the rest by global Zipf popularity over all
documents, in a random order, after a shared system prompt and before its own question. The
number of topics is the smallest whose *working set* (the distinct documents the trace reads,
in cache tokens, padding included) is at least ``ratio`` × the KV cache.

**Runs** (one engine per document size, in a child process: vLLM's in-process engine starts
once per process; its cache capped with ``kv_cache_blocks``): for each working-set ratio
(``--ratios``, default 4 and 0.5: a working set 4× the cache, and one that fits) the same
queries as a bulk with ``schedule`` ``given`` (arrival order), ``random`` and ``cluster``, each
on an empty cache; then ``cluster`` on 2 Ray Data actors (``--replicas``) with the same cache
each (for ``--ray-doc-tokens``, default the 100-token documents). A few queries
(``--alone``) also run alone on an empty cache.

**Rows** (JSON): ``schedule``, ``engines``, ``doc_tokens``, ``working_set_over_cache``,
``queries``, ``queries_per_s`` (queries / wall time of the bulk; on Ray from the first engine
ready to the last answer), ``queries_per_cpu_s`` (queries / CPU seconds the engines spent: the
measure that a machine shared with other work does not distort), ``hit_rate`` (prompt tokens
read from the cache that the query did not compute / prompt tokens), ``tokens_computed``
(prompt tokens computed by all requests, prepares and links included), ``p50_latency_s`` (a
query's own latency inside the bulk), ``same_answers`` (every answer equals the same query's
answer in arrival order on one engine, and the sampled queries run alone answer the same),
``clusters``, ``cache_tokens``, ``wall_s``, ``cpu_s``, ``reps`` (every bulk, Ray's included,
runs ``--reps`` times, default 3, each on an empty cache; the run with the median wall time
is the row's) and the spread of those runs, ``queries_per_s_min`` and ``queries_per_s_max``.
Written to
``benchmarks/results/bulk.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from span_workflows.apps.bench.options import add_results_dir, float_list, int_list, new_parser
from span_workflows.apps.bench.provenance import stamp
from span_workflows.apps.bench.report import save_figure

SYSTEM = "You are a helpful assistant. Answer the question using only the documents."
SCHEDULES = ("given", "random", "cluster")
#: KV cache blocks (of 32 tokens) per engine, by document size: a handful of queries' worth
CACHE_BLOCKS = {100: 96, 440: 192}
PER_TOPIC = 8


@dataclass(frozen=True)
class TraceShape:
    """One trace: ``queries`` RAG queries of ``k`` documents over ``topics`` topics of
    :data:`PER_TOPIC` documents (see the module docstring)."""

    topics: int
    queries: int
    doc_tokens: int
    k: int = 5
    topic_docs: int = 4
    zipf_s: float = 0.9
    seed: int = 0


def _zipf_cumulative(count: int, s: float) -> list[float]:
    total, out = 0.0, []
    for rank in range(count):
        total += 1.0 / (rank + 1) ** s
        out.append(total)
    return out


def _pick(rng: random.Random, cumulative: list[float]) -> int:
    return min(bisect.bisect_left(cumulative, rng.random() * cumulative[-1]),
               len(cumulative) - 1)


def make_trace(shape: TraceShape) -> list[list[int]]:
    """Each query's documents (ids ``topic * 8 + j``), in prompt order."""
    rng = random.Random(shape.seed)
    topic_weights = _zipf_cumulative(shape.topics, shape.zipf_s)
    doc_weights = _zipf_cumulative(shape.topics * PER_TOPIC, shape.zipf_s)
    # global popularity over a shuffled document order (not topic by topic)
    ranked = list(range(shape.topics * PER_TOPIC))
    rng.shuffle(ranked)
    trace = []
    for _ in range(shape.queries):
        topic = _pick(rng, topic_weights)
        docs = rng.sample(range(topic * PER_TOPIC, (topic + 1) * PER_TOPIC),
                          min(shape.topic_docs, shape.k))
        while len(docs) < shape.k:
            d = ranked[_pick(rng, doc_weights)]
            if d not in docs:
                docs.append(d)
        rng.shuffle(docs)
        trace.append(docs)
    return trace


def working_set_tokens(trace: Sequence[Sequence[int]], doc_tokens: int,
                       block_size: int = 32) -> int:
    """Cache tokens of the distinct documents ``trace`` reads (each padded to whole blocks)."""
    padded = -(-(doc_tokens + 8) // block_size) * block_size  # the message's own tokens too
    return len({d for q in trace for d in q}) * padded


def shape_for(ratio: float, doc_tokens: int, cache_tokens: int, uses_per_doc: float,
              seed: int = 0) -> TraceShape:
    """The smallest trace whose working set is at least ``ratio`` × ``cache_tokens``, with
    about ``uses_per_doc`` reads of each document."""
    topics = 1
    while True:
        queries = max(16, round(uses_per_doc * topics * PER_TOPIC / 5))
        shape = TraceShape(topics, queries, doc_tokens, seed=seed)
        if working_set_tokens(make_trace(shape), doc_tokens) >= ratio * cache_tokens:
            return shape
        topics += 1


def make_queries(shape: TraceShape, texts: Sequence[str]) -> list[Any]:
    """The span queries of ``shape``'s trace over documents ``texts``."""
    from span_workflows.query.builders import rag

    return [rag(SYSTEM, [texts[d] for d in docs],
                f"Question {i}: which topic do the documents describe first?", max_tokens=4)
            for i, docs in enumerate(make_trace(shape))]


def _texts(tokenizer: Any, shape: TraceShape) -> list[str]:
    from span_workflows.apps.demo.corpus import documents

    count = shape.topics * PER_TOPIC
    body = documents(tokenizer, count, shape.doc_tokens)
    return [f"Document {d} (topic {d // PER_TOPIC}). {body[d]}" for d in range(count)]


def measure(answers: Sequence[Any], wall_s: float, cpu_s: float) -> dict[str, Any]:
    """The row's numbers from a bulk's answers (input order), its wall time and the CPU time
    its engines spent."""
    metrics = [a.result.metrics for a in answers if a.ok]
    prompt = sum(m.prompt_tokens for m in metrics)
    return {
        "queries": len(answers),
        "queries_per_s": round(len(answers) / wall_s, 3),
        "queries_per_cpu_s": round(len(answers) / cpu_s, 3),
        "hit_rate": round(sum(m.reused_tokens for m in metrics) / prompt, 4) if prompt else 0.0,
        "tokens_computed": sum(m.prepared_tokens + m.prompt_tokens - m.cached_tokens
                               for m in metrics),
        "p50_latency_s": round(statistics.median(m.latency_s for m in metrics), 3),
        "wall_s": round(wall_s, 2),
        "cpu_s": round(cpu_s, 2),
        "failed": sum(1 for a in answers if not a.ok),
    }


@dataclass(frozen=True)
class Setting:
    """One document size's runs: the shapes by ratio and the engine's cache."""

    doc_tokens: int
    cache_blocks: int
    ratios: tuple[float, ...]
    uses_per_doc: float
    max_in_flight: int
    alone: int
    seed: int = 0
    #: runs of each bulk (each on an empty cache; the run of median wall time is kept)
    reps: int = 3
    #: the engines' model (``None``: the default)
    model: str | None = None


@dataclass(frozen=True)
class Repeated:
    """The run of median wall time among repeated runs of one bulk, and the spread."""

    answers: list[Any]
    wall_s: float
    cpu_s: float
    #: every run's wall seconds, shortest first
    walls: tuple[float, ...]

    def spread(self) -> dict[str, float]:
        """The slowest and fastest run, as queries per wall second."""
        count = len(self.answers)
        return {"queries_per_s_min": round(count / self.walls[-1], 3),
                "queries_per_s_max": round(count / self.walls[0], 3)}


def median_run(runs: Sequence[tuple[list[Any], float, float]]) -> Repeated:
    """Of ``(answers, wall_s, cpu_s)`` runs, the one with the median wall time."""
    ordered = sorted(runs, key=lambda run: run[1])
    answers, wall, cpu = ordered[len(ordered) // 2]
    return Repeated(answers, wall, cpu, tuple(run[1] for run in ordered))


def _timed_bulk(engine: Any, queries: Sequence[Any], schedule: str, setting: Setting,
                reps: int) -> Repeated:
    """``reps`` runs of one bulk, each on an empty cache: the run with the median wall
    time (its answers, wall and CPU seconds) and every run's wall time."""
    runs = []
    for _ in range(reps):
        engine.reset_cache()
        started, cpu = time.perf_counter(), time.process_time()
        answers = engine.execute_bulk(queries, schedule=schedule,
                                      max_in_flight=setting.max_in_flight, seed=setting.seed)
        runs.append((answers, time.perf_counter() - started, time.process_time() - cpu))
    return median_run(runs)


def one_engine_rows(setting: Setting) -> dict[str, Any]:
    """The one-engine rows of one document size (run in a child process), with each ratio's
    queries and reference answers for the Ray rows."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from span_workflows.compiler.keys import QueryKeyer
    from span_workflows.runtime.bulk import as_queries, key_items, schedule_items
    from span_workflows.runtime.engine import Engine

    engine = Engine(setting.model, kv_cache_gib=1, kv_cache_blocks=setting.cache_blocks,
                    load_progress=False)
    cache = engine.cache_tokens
    keyer = QueryKeyer(engine.tokenizer, engine.block_size)
    rows, references = [], {}
    try:
        for ratio in setting.ratios:
            shape = shape_for(ratio, setting.doc_tokens, cache, setting.uses_per_doc,
                              setting.seed)
            queries = make_queries(shape, _texts(engine.tokenizer, shape))
            working = working_set_tokens(make_trace(shape), setting.doc_tokens) / cache
            items = key_items(as_queries(queries), keyer, engine.span_options)
            texts: dict[str, list[str]] = {}
            for schedule in SCHEDULES:
                run = _timed_bulk(engine, queries, schedule, setting, setting.reps)
                texts[schedule] = [a.result.text if a.ok else "" for a in run.answers]
                clusters = len(schedule_items(items, schedule, cache, seed=setting.seed)
                               .clusters)
                rows.append({"schedule": schedule, "engines": 1,
                             "doc_tokens": setting.doc_tokens,
                             "working_set_over_cache": round(working, 2),
                             **measure(run.answers, run.wall_s, run.cpu_s),
                             **run.spread(), "reps": setting.reps,
                             "clusters": clusters, "cache_tokens": cache,
                             "topics": shape.topics})
                print(f"bench bulk: {setting.doc_tokens}-token documents, working set "
                      f"{working:.2f}x cache, {schedule}: {rows[-1]['queries_per_s']} q/s, "
                      f"{rows[-1]['queries_per_cpu_s']} q/CPU-s", flush=True)
            alone_ok = True
            rng = random.Random(setting.seed)
            for i in rng.sample(range(len(queries)), min(setting.alone, len(queries))):
                engine.reset_cache()
                alone_ok &= engine.execute(queries[i]).text == texts["given"][i]
            for row in rows[-len(SCHEDULES):]:
                row["same_answers"] = alone_ok and texts[row["schedule"]] == texts["given"]
            references[ratio] = {"shape": asdict(shape), "texts": texts["given"],
                                 "working": working}
    finally:
        engine.close()
    return {"rows": rows, "references": references, "cache_tokens": cache}


def ray_rows(setting: Setting, references: dict[float, Any], cache_tokens: int,
             replicas: int) -> list[dict[str, Any]]:
    """``cluster`` on ``replicas`` Ray Data actors for each ratio above 1 (the same queries
    and cache size as the one-engine rows)."""

    from span_workflows.compiler.model import load_tokenizer
    from span_workflows.scaleout.bulk import BulkOptions, run_bulk_on_ray

    tokenizer = load_tokenizer(setting.model)
    rows = []
    for ratio, ref in references.items():
        if ratio <= 1:
            continue
        shape = TraceShape(**ref["shape"])
        queries = make_queries(shape, _texts(tokenizer, shape))
        options = BulkOptions(model=setting.model, replicas=replicas, num_cpus=1, kv_cache_gib=1,
                              kv_cache_blocks=setting.cache_blocks,
                              max_in_flight=setting.max_in_flight, seed=setting.seed,
                              env={"VLLM_LOGGING_LEVEL": "ERROR"})
        runs, served_by, texts = [], set(), None
        for _ in range(setting.reps):  # each run starts its actors afresh: an empty cache
            got = list(run_bulk_on_ray(queries, options))
            answers = sorted((g.answer for g in got), key=lambda a: a.index)
            wall = max(g.ended_at for g in got) - min(g.ready_at for g in got)
            runs.append((answers, wall, sum(g.cpu_s for g in got)))
            served_by.add(len({g.engine for g in got}))
            run_texts = [a.result.text if a.ok else "" for a in answers]
            texts = run_texts if texts in (None, run_texts) else []  # [] : runs disagreed
        run = median_run(runs)
        rows.append({"schedule": "cluster", "engines": replicas,
                     "doc_tokens": setting.doc_tokens,
                     "working_set_over_cache": round(ref["working"], 2),
                     **measure(run.answers, run.wall_s, run.cpu_s), **run.spread(),
                     "cache_tokens": cache_tokens, "topics": shape.topics,
                     "reps": setting.reps, "same_answers": texts == ref["texts"],
                     "clusters": _ray_clusters(queries, options, tokenizer),
                     "engines_answering": min(served_by)})
        print(f"bench bulk: {setting.doc_tokens}-token documents on {replicas} Ray actors: "
              f"{rows[-1]['queries_per_s']} q/s", flush=True)
    return rows


def _ray_clusters(queries: Sequence[Any], options: Any, tokenizer: Any) -> int:
    from span_workflows.scaleout.bulk import cluster_rows

    return len(cluster_rows(queries, options, tokenizer)[0])


# -- report ------------------------------------------------------------------------------------


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a table, with throughput (per wall second and per CPU second) and tokens
    computed over arrival order's (same document size and working set, one engine), and the
    Ray rows over one engine's clustered run."""
    base = {(r["doc_tokens"], r["working_set_over_cache"]): r for r in rows
            if r["schedule"] == "given" and r["engines"] == 1}
    one = {(r["doc_tokens"], r["working_set_over_cache"]): r for r in rows
           if r["schedule"] == "cluster" and r["engines"] == 1}
    lines = ["| doc tokens | working set / cache | schedule | engines | queries | queries/s "
             "| × arrival | queries/CPU-s | × arrival | × one engine | hit rate "
             "| tokens computed | × arrival | p50 latency (s) | same answers "
             "| runs: queries/s min–max |",
             "|" + "---|" * 16]
    for r in rows:
        key = (r["doc_tokens"], r["working_set_over_cache"])
        ref, single = base.get(key, {}), one.get(key, {})
        lines.append(
            f"| {r['doc_tokens']} | {r['working_set_over_cache']:.2f} | {r['schedule']} "
            f"| {r['engines']} | {r['queries']} | {r['queries_per_s']:.3f} "
            f"| {_ratio(r['queries_per_s'], ref.get('queries_per_s'))} "
            f"| {r['queries_per_cpu_s']:.3f} "
            f"| {_ratio(r['queries_per_cpu_s'], ref.get('queries_per_cpu_s'))} "
            f"| {_ratio(r['queries_per_s'], single.get('queries_per_s'))} "
            f"| {r['hit_rate']:.3f} | {r['tokens_computed']} "
            f"| {_ratio(r['tokens_computed'], ref.get('tokens_computed'))} "
            f"| {r['p50_latency_s']:.2f} | {'yes' if r['same_answers'] else 'no'} "
            f"| {_spread(r)} |")
    return "\n".join(lines) + "\n"


def _spread(row: dict[str, Any]) -> str:
    if "queries_per_s_min" not in row:
        return "—"
    return f"{row['reps']}: {row['queries_per_s_min']:.3f}–{row['queries_per_s_max']:.3f}"


def _ratio(value: float, ref: float | None) -> str:
    return "—" if not ref else f"{value / ref:.2f}"


PANELS = (("queries_per_s", "queries / wall second"),
          ("queries_per_cpu_s", "queries / CPU second"),
          ("tokens_computed", "prompt tokens computed (lower is better)"))


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Throughput (wall and CPU) and tokens computed per setting, one bar per schedule (and
    per Ray run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(r["doc_tokens"], r["working_set_over_cache"]) for r in rows})
    kinds = [("given", 1), ("random", 1), ("cluster", 1)] + sorted(
        {(r["schedule"], r["engines"]) for r in rows if r["engines"] > 1})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.4))
    width = 0.8 / len(kinds)
    for k, (schedule, engines) in enumerate(kinds):
        label = schedule if engines == 1 else f"{schedule}, {engines} Ray actors"
        for ax, (column, _) in zip(axes, PANELS, strict=True):
            xs, ys = [], []
            for s, (doc, ratio) in enumerate(settings):
                row = next((r for r in rows if (r["doc_tokens"], r["working_set_over_cache"],
                                                r["schedule"], r["engines"]) ==
                            (doc, ratio, schedule, engines)), None)
                if row is not None:
                    xs.append(s + k * width)
                    ys.append(row[column])
            ax.bar(xs, ys, width, label=label)
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set_xticks([s + 0.4 - width / 2 for s in range(len(settings))])
        ax.set_xticklabels([f"{d}-token docs\nworking set {r:.2f}× cache"
                            for d, r in settings], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("span-workflows bench bulk (SmolLM2-135M, CPU)")
    save_figure(fig, path, dpi=110)


def make_parser() -> argparse.ArgumentParser:
    """The options of ``span-workflows bench bulk``."""
    p = new_parser("bulk")
    p.add_argument("--doc-tokens", type=int_list(1),
                   default=[100, 440], help="document sizes (default: 100,440)")
    p.add_argument("--ratios", type=float_list,
                   default=[4.0, 0.5],
                   help="working set over the KV cache, per run (default: 4,0.5)")
    p.add_argument("--uses-per-doc", type=float, default=3.0,
                   help="about how many queries read each document (default: 3)")
    p.add_argument("--cache-blocks", type=int, default=None,
                   help="KV cache blocks per engine (default: 96 for 100-token documents, "
                        "192 for 440)")
    p.add_argument("--max-in-flight", type=int, default=4,
                   help="queries run together (default: 4)")
    p.add_argument("--replicas", type=int, default=2,
                   help="Ray actors for the distributed rows (0: none; default: 2)")
    p.add_argument("--ray-doc-tokens", type=int_list(1),
                   default=[100], help="document sizes of the Ray rows (default: 100)")
    p.add_argument("--alone", type=int, default=3,
                   help="queries also run alone per working set, for same_answers")
    p.add_argument("--reps", type=int, default=3,
                   help="runs of each bulk, each on an empty cache; the run of median wall "
                        "time is kept, the spread reported (default: 3)")
    p.add_argument("--parts", type=Path, default=None,
                   help="keep each document size's one-engine rows here and reuse them when "
                        "run again with the same settings (e.g. to redo the Ray rows)")
    add_results_dir(p, "bulk")
    return p


def run_bulk_bench(argv: Sequence[str]) -> int:
    """CLI entry of ``span-workflows bench bulk``."""
    import multiprocessing

    from span_workflows.apps.bench.report import print_table

    args = make_parser().parse_args(list(argv))
    rows: list[dict[str, Any]] = []
    later = []
    spawn = multiprocessing.get_context("spawn")
    parts = json.loads(args.parts.read_text()) if args.parts and args.parts.exists() else {}
    for doc_tokens in args.doc_tokens:
        setting = Setting(doc_tokens, args.cache_blocks or CACHE_BLOCKS.get(doc_tokens, 192),
                          tuple(args.ratios), args.uses_per_doc, args.max_in_flight,
                          args.alone, args.seed, args.reps, args.model)
        key = json.dumps(asdict(setting), sort_keys=True)
        part = parts.get(key)
        if part is None:
            with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                part = pool.submit(one_engine_rows, setting).result()
            if args.parts:
                parts[key] = part
                args.parts.write_text(json.dumps(parts) + "\n")
        rows.extend(part["rows"])
        later.append((setting, part))
    if args.replicas > 0:
        import ray

        from span_workflows.scaleout.bulk import forwarded_env

        ray.init(num_cpus=max(args.replicas, 1), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": forwarded_env()})
        try:
            for setting, part in later:
                if setting.doc_tokens not in args.ray_doc_tokens:
                    continue
                rows.extend(ray_rows(setting, {float(k): v for k, v in
                                               part["references"].items()},
                                     part["cache_tokens"], args.replicas))
        finally:
            ray.shutdown()
    rows.sort(key=lambda r: (r["doc_tokens"], -r["working_set_over_cache"], r["engines"],
                             SCHEDULES.index(r["schedule"])))
    from span_workflows.compiler.model import DEFAULT_MODEL_NAME

    rows = stamp(rows, model=args.model or DEFAULT_MODEL_NAME)  # each row has its own reps
    print_table(rows)
    if not args.no_write:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "bulk.json").write_text(json.dumps(rows, indent=2) + "\n")
        (out / "bulk.md").write_text(markdown(rows))
        plot_rows(rows, out / "bulk.png")
    return 0


__all__ = ["TraceShape", "make_parser", "make_trace", "markdown", "plot_rows",
           "run_bulk_bench", "shape_for", "working_set_tokens"]
