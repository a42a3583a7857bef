"""``span-workflows bench route``: routers over span-engine replicas, side by side.

One trace of RAG queries (shared document pool, Zipf-skewed popularity, ``k`` documents per
query in a random order) is routed by every router in one run:

* ``--mode sim`` — the trace-driven simulator (:mod:`span_workflows.scaleout.simulate`) at
  2, 8, 32 and 100 replicas (``--replicas``), each replica an LRU model of a KV cache of
  ``--cache-tokens`` tokens, the single node's cache the same size;
* ``--mode real`` — a Ray Serve deployment of real span-engine replicas on this machine
  (:mod:`span_workflows.apps.bench.route_real`).

Rows (JSON): ``mode``, ``router``, ``replicas``, ``requests``, ``hit_rate`` (span tokens read
from cache / span tokens), ``single_node_hit_rate``, ``p50_ttft_s``, ``p95_ttft_s``,
``max_load_ratio`` (busiest replica's requests / mean). Sim and real rows are kept side by side
in ``benchmarks/results/route.json`` (a run replaces the rows of its own mode).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from span_workflows.apps.bench.options import add_results_dir, int_list, new_parser
from span_workflows.apps.bench.provenance import stamp
from span_workflows.apps.bench.report import print_table, save_figure
from span_workflows.scaleout.affinity import AffinityOptions
from span_workflows.scaleout.simulate import (
    ROUTERS,
    STOCK_ROUTERS,
    CostModel,
    TraceOptions,
    make_router,
    make_trace,
    simulate,
)

FIELDS = ("mode", "router", "replicas", "requests", "hit_rate", "single_node_hit_rate",
          "p50_ttft_s", "p95_ttft_s", "max_load_ratio")


def sim_rows(sizes: Sequence[int], trace: TraceOptions, affinity: AffinityOptions,
             cost: CostModel, requests_per_replica: int = 40,
             progress: bool = True) -> list[dict[str, Any]]:
    """Simulate every router at every size in ``sizes`` on one trace per size (at least
    ``trace.requests`` queries, ``requests_per_replica`` per replica); the single node runs
    the same trace with the same cache per replica."""
    from tqdm.auto import tqdm

    rows = []
    for n in tqdm(sizes, desc="route sim", disable=not progress):
        options = TraceOptions(**{**_fields(trace),
                                  "requests": max(trace.requests, requests_per_replica * n)})
        queries = make_trace(options)
        common = {"capacity_tokens": affinity.capacity_tokens, "cost": cost,
                  "system_tokens": options.system_tokens,
                  "question_tokens": options.question_tokens, "seed": options.seed}
        single = simulate(queries, make_router("single", options, affinity), 1, name="single",
                          **common)
        for router in ROUTERS:
            res = single if router == "single" else simulate(
                queries, make_router(router, options, affinity, options.seed), n, name=router,
                stock=router in STOCK_ROUTERS, **common)
            rows.append({
                "mode": "sim", "router": router, "replicas": 1 if router == "single" else n,
                "requests": res.requests, "hit_rate": round(res.hit_rate, 4),
                "single_node_hit_rate": round(single.hit_rate, 4),
                "p50_ttft_s": round(res.p50_ttft_s, 4), "p95_ttft_s": round(res.p95_ttft_s, 4),
                "max_load_ratio": round(res.max_load_ratio, 3),
                "cluster_replicas": n,
            })
    return rows


def _fields(options: TraceOptions) -> dict[str, Any]:
    return {name: getattr(options, name) for name in TraceOptions.__dataclass_fields__}


def merge_rows(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``path`` whose mode none of ``rows`` has, then ``rows``."""
    modes = {r["mode"] for r in rows}
    old = json.loads(path.read_text()) if path.exists() else []
    return [r for r in old if r.get("mode") not in modes] + rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (sim, then real), with each router's hit rate over the
    single node's, over the prefix router's (span replicas) and over what stock replicas
    behind the prefix router get, at the same size."""
    def refs(router: str) -> dict[tuple[str, int], float]:
        return {(r["mode"], r.get("cluster_replicas", r["replicas"])): r["hit_rate"]
                for r in rows if r["router"] == router}

    prefix, stock = refs("prefix-affinity"), refs("stock-prefix-affinity")
    head = ("| mode | replicas | router | requests | hit rate | × single node | × prefix "
            "| × stock prefix | p50 TTFT (s) | p95 TTFT (s) | max load ratio |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        size = r.get("cluster_replicas", r["replicas"])
        lines.append(
            f"| {r['mode']} | {size} | {r['router']} | {r['requests']} | {r['hit_rate']:.3f} "
            f"| {_ratio(r['hit_rate'], r['single_node_hit_rate'])} "
            f"| {_ratio(r['hit_rate'], prefix.get((r['mode'], size)))} "
            f"| {_ratio(r['hit_rate'], stock.get((r['mode'], size)))} "
            f"| {r['p50_ttft_s']:.3f} | {r['p95_ttft_s']:.3f} | {r['max_load_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def _ratio(value: float, ref: float | None) -> str:
    if ref is None:
        return "—"
    if ref == 0:
        return "∞" if value > 0 else "—"
    return f"{value / ref:.2f}"


def plot_rows(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Hit rate and max load ratio against replicas, one line per router (sim rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = [r for r in rows if r["mode"] == "sim"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for router in ROUTERS:
        pts = sorted((r["cluster_replicas"], r) for r in sim if r["router"] == router)
        if not pts:
            continue
        xs = [x for x, _ in pts]
        left.plot(xs, [r["hit_rate"] for _, r in pts], marker="o", label=router)
        if router != "single":
            right.plot(xs, [r["max_load_ratio"] for _, r in pts], marker="o", label=router)
    for ax, label in ((left, "span hit rate"), (right, "busiest replica / mean")):
        ax.set_xscale("log")
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    right.axhline(1.5, color="grey", linestyle="--", linewidth=1)
    fig.suptitle("span-workflows bench route (simulated replicas)")
    save_figure(fig, path, dpi=110)


def make_parser() -> argparse.ArgumentParser:
    """The options of ``span-workflows bench route``."""
    p = new_parser("route", model=False)
    p.add_argument("--mode", choices=("sim", "real"), default="sim")
    p.add_argument("--replicas", type=int_list(1), default=None,
                   help="cluster sizes (sim default 2,8,32,100; real default 2)")
    p.add_argument("--requests", type=int, default=None,
                   help="queries in the trace (sim default 4000, real default 24)")
    p.add_argument("--documents", type=int, default=None, help="document pool size")
    p.add_argument("--k", type=int, default=None, help="documents per query")
    p.add_argument("--zipf", type=float, default=0.9, help="popularity skew (Zipf s)")
    p.add_argument("--cache-tokens", type=int, default=12_000,
                   help="sim: span cache per replica (and of the single node), in tokens")
    p.add_argument("--imbalance-threshold", type=int, default=0,
                   help="span-affinity: extra requests in flight tolerated for affinity")
    p.add_argument("--max-share", type=float, default=1.25,
                   help="span-affinity: bounded-load factor over the fair share (0: off)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="real: queries in flight at once")
    add_results_dir(p, "route")
    return p


def run_route(argv: Sequence[str]) -> int:
    """CLI entry of ``span-workflows bench route``."""
    args = make_parser().parse_args(list(argv))
    if args.mode == "sim":
        trace = TraceOptions(requests=args.requests or 4000, documents=args.documents or 1000,
                             k=args.k or 5, zipf_s=args.zipf, seed=args.seed)
        affinity = AffinityOptions(capacity_tokens=args.cache_tokens,
                                   imbalance_threshold=args.imbalance_threshold,
                                   max_share=args.max_share or None)
        rows = sim_rows(args.replicas or [2, 8, 32, 100], trace, affinity, CostModel())
    else:
        from span_workflows.apps.bench.route_real import real_rows

        rows = real_rows(replicas=(args.replicas or [2])[0], requests=args.requests or 24,
                         documents=args.documents or 12, k=args.k or 3, zipf_s=args.zipf,
                         imbalance_threshold=args.imbalance_threshold, seed=args.seed,
                         concurrency=args.concurrency)
    print_table([{k: r[k] for k in FIELDS} for r in rows])
    # this run's rows: a simulation (no model runs), or servers this bench started, each
    # request sent once
    if args.mode == "sim":  # no model runs: its costs are CostModel's
        rows = [{**row, "model": None} for row in stamp(rows, reps=1)]
    else:
        from span_workflows.compiler.model import DEFAULT_MODEL_NAME

        rows = stamp(rows, reps=1, model=DEFAULT_MODEL_NAME)
    if not args.no_write:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        merged = merge_rows(out / "route.json", rows)
        (out / "route.json").write_text(json.dumps(merged, indent=2) + "\n")
        (out / "route.md").write_text(markdown(merged))
        plot_rows(merged, out / "route.png")
    return 0


__all__ = ["FIELDS", "make_parser", "markdown", "merge_rows", "plot_rows", "run_route",
           "sim_rows"]
