"""A bulk of span queries on Ray Data: whole clusters to N span-engine actors.

The pipeline (:func:`run_bulk_on_ray`):

1. **read** — the queries (trees, JSON values or JSON lines), each parsed alone: a bad one is
   answered with its error at once and goes no further;
2. **cluster** — in the driver, by span keys (:mod:`span_workflows.runtime.bulk`: the router's keys
   for the engines' block size, clusters whose footprint fits one engine's KV cache,
   :attr:`BulkOptions.cache_tokens`); a cluster is split only when it exceeds that cache;
3. **run** — ``ray.data.from_items`` with one row, and one block, per cluster, then
   ``map_batches`` over an actor pool (``ActorPoolStrategy(size=N)``, one cluster per call, one
   call per actor at a time: a cluster goes whole to whichever engine is free) of
   :class:`SpanEngineActor` — an embedded :class:`~span_workflows.runtime.engine.Engine` per actor
   (the CPUs or GPU Ray gives it), which runs its cluster as a bulk (re-clustered by its own
   cache size, so a cluster larger than the real cache is split there);
4. **write** — the answers stream back to the driver as each cluster ends (``iter_rows``),
   as :class:`~span_workflows.runtime.result.BulkAnswer` with the engine that answered.

Faults are Ray Data's: an actor that dies is restarted and its cluster runs again (actor
restarts and task retries are on by default for actor pools), so every query is answered once.

Needs Ray's data extra at the ``ray[serve]`` pin (``ray[data]==2.60.0``: pandas, pyarrow).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from span_workflows.errors import SpanQueryError
from span_workflows.runtime import bulk
from span_workflows.runtime.result import BulkAnswer
from span_workflows.scaleout.ray_env import check_replicas, forwarded_env


@dataclass(frozen=True)
class BulkOptions:
    """How a bulk runs on Ray.

    ``replicas``: span-engine actors; ``num_cpus`` / ``num_gpus``: Ray resources per actor;
    ``model``, ``kv_cache_gib``, ``kv_cache_blocks`` (a cap on the KV cache, in blocks),
    ``block_size``: each engine's (as :class:`~span_workflows.runtime.engine.Engine`);
    ``schedule``, ``max_in_flight``, ``seed``: as :meth:`Engine.execute_bulk
    <span_workflows.runtime.engine.Engine.execute_bulk>`; ``cache_tokens``: one engine's KV cache in
    tokens, which clusters are sized to (``None``: ``kv_cache_blocks`` x ``block_size``, else
    estimated from ``kv_cache_gib`` and the model's shape); ``env``: extra environment of the
    actors."""

    replicas: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    model: str | None = None
    kv_cache_gib: int = 1
    kv_cache_blocks: int | None = None
    block_size: int = 32
    schedule: str = "cluster"
    max_in_flight: int = bulk.DEFAULT_MAX_IN_FLIGHT
    seed: int = 0
    cache_tokens: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_replicas(self.replicas, self.num_cpus, self.num_gpus)
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ValueError(f"kv_cache_blocks must be >= 1, not {self.kv_cache_blocks}")
        if self.cache_tokens is not None and self.cache_tokens < 1:
            raise ValueError(f"cache_tokens must be >= 1, not {self.cache_tokens}")
        bulk.check_options(self.schedule, self.max_in_flight)


@dataclass(frozen=True, slots=True)
class RayAnswer:
    """One answer of a bulk on Ray: the answer, the engine that gave it (``host:pid``; ``""``
    for a query refused before it ran), when that engine was ready and when its cluster
    ended (``time.time()`` seconds)."""

    answer: BulkAnswer
    engine: str = ""
    ready_at: float = 0.0
    ended_at: float = 0.0
    #: this query's share of the CPU time its engine spent on its cluster (seconds)
    cpu_s: float = 0.0


class SpanEngineActor:
    """One span engine of the pool: ``map_batches`` calls it with one cluster per batch
    (columns ``indices`` and ``queries``: the bulk's indices and JSON lines) and gets one row
    per query back (``index``, ``answer``: the answer's JSON line, ``engine``: who answered,
    ``ready_at`` / ``ended_at``: when the engine was ready, when the cluster ended,
    ``cpu_s``: each query's share of the CPU time the cluster took)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from span_workflows.runtime.engine import Engine

        self.options = BulkOptions(**settings)
        opts = self.options
        self.engine = Engine(opts.model, kv_cache_gib=opts.kv_cache_gib,
                             kv_cache_blocks=opts.kv_cache_blocks, block_size=opts.block_size,
                             load_progress=False)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.ready_at = time.time()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        from span_workflows.serving import wire

        out: dict[str, list[Any]] = {"index": [], "answer": [], "engine": [], "ready_at": [],
                                     "ended_at": [], "cpu_s": []}
        for indices, lines in zip(batch["indices"], batch["queries"], strict=True):
            indices, lines = list(indices), [str(line) for line in lines]
            cpu = time.process_time()
            answers = self.engine.execute_bulk(lines, schedule=self.options.schedule,
                                               max_in_flight=self.options.max_in_flight,
                                               seed=self.options.seed)
            ended, cpu = time.time(), (time.process_time() - cpu) / max(1, len(lines))
            for index, answer in zip(indices, answers, strict=True):
                global_answer = BulkAnswer(int(index), answer.result, answer.error)
                out["index"].append(int(index))
                out["answer"].append(json.dumps(wire.bulk_answer(global_answer),
                                                ensure_ascii=False))
                out["engine"].append(self.name)
                out["ready_at"].append(self.ready_at)
                out["ended_at"].append(ended)
                out["cpu_s"].append(cpu)
        return out


def cluster_rows(queries: Sequence[bulk.Query], options: BulkOptions, tokenizer: Any,
                 ) -> tuple[list[dict[str, Any]], list[BulkAnswer]]:
    """The rows of the pipeline (one per cluster: ``cluster``, ``indices``, ``queries``) and
    the answers of the queries that are not valid (their errors)."""
    from span_workflows.compiler.keys import QueryKeyer

    parsed = bulk.as_queries(queries)
    errors = [BulkAnswer(i, error=q) for i, q in enumerate(parsed)
              if isinstance(q, SpanQueryError)]
    items = bulk.key_items(parsed, QueryKeyer(tokenizer, options.block_size))
    plan = bulk.schedule_items(items, options.schedule, engine_cache_tokens(options),
                               seed=options.seed)
    rows = [{"cluster": c, "indices": list(cluster),
             "queries": [bulk.query_line(parsed[i]) for i in cluster]}  # type: ignore[arg-type]
            for c, cluster in enumerate(plan.clusters)]
    return rows, errors


def run_bulk_on_ray(queries: Sequence[bulk.Query], options: BulkOptions | None = None, *,
                    address: str | None = None,
                    progress: bool = False) -> Iterator[RayAnswer]:
    """Run ``queries`` on ``options.replicas`` span-engine actors (see the module docstring);
    yields a :class:`RayAnswer` per query as each cluster ends (the invalid queries' first).
    Starts a local Ray unless one is running or ``address`` (or ``RAY_ADDRESS``) names a
    cluster."""
    import ray

    options = options or BulkOptions()
    rows, errors = cluster_rows(queries, options, _tokenizer(options.model))
    yield from (RayAnswer(e) for e in errors)
    if not rows:
        return
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {**forwarded_env(), **options.env}})
    from span_workflows.serving import wire

    data = _pipeline(rows, options, progress)
    for row in data.iter_rows():
        yield RayAnswer(wire.parse_bulk_answer(json.loads(row["answer"])), str(row["engine"]),
                        float(row["ready_at"]), float(row["ended_at"]), float(row["cpu_s"]))


def _pipeline(rows: list[dict[str, Any]], options: BulkOptions, progress: bool) -> Any:
    """The Ray Data pipeline over the cluster rows (lazy: it runs as it is read)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    context.execution_options.preserve_order = False  # answers as clusters end
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows))
    return dataset.map_batches(
        SpanEngineActor, fn_constructor_kwargs={"settings": asdict(options)}, batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=options.replicas,
                                           max_tasks_in_flight_per_actor=1),
        num_cpus=options.num_cpus, num_gpus=options.num_gpus or None,
        runtime_env={"env_vars": dict(options.env)} if options.env else None)


def engine_cache_tokens(options: BulkOptions) -> int:
    """One engine's KV cache in tokens (see :attr:`BulkOptions.cache_tokens`)."""
    if options.cache_tokens is not None:
        return options.cache_tokens
    if options.kv_cache_blocks is not None:
        return options.kv_cache_blocks * options.block_size
    return estimated_cache_tokens(options.model, options.kv_cache_gib, options.block_size)


def estimated_cache_tokens(model: str | None, kv_cache_gib: int, block_size: int,
                           dtype_bytes: int = 4) -> int:
    """Tokens a CPU KV cache of ``kv_cache_gib`` holds for ``model`` (float32 by default:
    keys and values of every layer and KV head), whole blocks only."""
    from span_workflows.compiler.model import resolve_model

    config = json.loads((Path(resolve_model(model, progress=False)) / "config.json").read_text())
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config[
        "num_attention_heads"])
    per_token = 2 * int(config["num_hidden_layers"]) * heads * head_dim * dtype_bytes
    blocks = kv_cache_gib * 2**30 // (per_token * block_size)
    return int(blocks) * block_size


def _tokenizer(model: str | None) -> Any:
    from span_workflows.compiler.model import load_tokenizer

    return load_tokenizer(model)


__all__ = ["BulkOptions", "RayAnswer", "SpanEngineActor", "cluster_rows",
           "engine_cache_tokens", "estimated_cache_tokens", "forwarded_env", "run_bulk_on_ray"]
