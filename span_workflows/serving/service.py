"""Executes span queries against a running vLLM engine client (``AsyncLLM``), in the API server.

The engine core runs in another process: cache probes and the span counters reach it as the
plugin's engine-core utility calls (:data:`span_vllm.contract.PROBE_CALL`,
:data:`~span_vllm.contract.STATS_CALL`, :data:`~span_vllm.contract.STEPS_CALL`); requests go
through ``AsyncLLM.generate`` with their segments in ``SamplingParams.extra_args``
(:mod:`span_workflows.runtime.vllm_io`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from span_vllm import contract
from span_workflows.compiler.compile import Compiler
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Node
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime import bulk
from span_workflows.runtime.plan import (
    Output,
    Planner,
    Probe,
    QuerySettings,
    Request,
    StepCount,
    Steps,
    drive_async,
    guarded,
    share_prepares_async,
)
from span_workflows.runtime.result import BulkAnswer, Result
from span_workflows.runtime.routing import WeightsRouter, on_weights
from span_workflows.runtime.streaming import PartStream
from span_workflows.runtime.vllm_io import RequestRun, sampling_params, tokens_prompt
from span_workflows.serving.wire import QueryBody


class SpanQueryService:
    """Plans, runs and reports span queries on ``engine_client`` (vLLM's ``AsyncLLM``).

    ``router`` chooses each query's weights (:mod:`span_workflows.runtime.routing`; default: the
    base alone); ``loras`` maps an adapter's name to the ``LoRARequest`` the server loaded it
    with (vLLM's ``OpenAIServingModels.lora_requests``)."""

    def __init__(self, engine_client: Any, tokenizer: Any, block_size: int,
                 max_model_len: int, layout_key: str,
                 span_options: SpanOptions | None = None,
                 router: WeightsRouter | None = None,
                 loras: Mapping[str, Any] | None = None) -> None:
        self.engine = engine_client
        self.router = router or WeightsRouter("")
        self.loras: Mapping[str, Any] = loras if loras is not None else {}
        self.layout_key = layout_key
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.planner = Planner(Compiler.for_tokenizer(tokenizer, block_size,
                                                      options=span_options), max_model_len)
        self.stats: dict[str, int] = dict.fromkeys(contract.STAT_HELP, 0)

    async def execute(self, node: Node, *, optimize_query: bool = True,
                      stream: PartStream | None = None, span_options: SpanOptions | None = None,
                      cache_salt: str | None = None,
                      sampling: Mapping[str, Any] | None = None,
                      weights: str | None = None) -> Result:
        """Run one parsed query; with ``stream``, its answer's text is streamed as it grows.
        ``sampling``: more vLLM ``SamplingParams`` fields for the answer's own generations
        (see :func:`span_workflows.runtime.vllm_io.sampling_params`); ``weights``: the base's or an
        adapter's name (``None``: routed)."""
        plan = self.plan(node, optimize_query, span_options, cache_salt, weights)

        async def run(req: Request) -> Output:
            return await self._run(req, stream, sampling)

        [result] = await drive_async([plan], run, self._probe, self._steps)
        return result

    def weights_name(self, node: Node, optimize_query: bool = True,
                     weights: str | None = None) -> str:
        """The name of the weights :meth:`plan` runs ``node`` on (a stream names them in its
        first chunk, before the answer is known); raises what :meth:`plan` raises for a bad
        query."""
        return self.router.choose(self.planner.normalize(node, optimize_query), True,
                                  weights).name

    def plan(self, node: Node, optimize_query: bool = True,
             span_options: SpanOptions | None = None, cache_salt: str | None = None,
             weights: str | None = None) -> Any:
        """The plan of one query, on the weights the router chooses for it."""
        normal = self.planner.normalize(node, optimize_query)
        route = self.router.choose(normal, True, weights)
        options = span_options or self.router.options(route, self.planner.compiler.options)
        return on_weights(self.planner.plan_query(normal, True,
                                                  QuerySettings(options, cache_salt)), route)

    def cache_tokens(self) -> int:
        """The engine's KV cache in tokens (vLLM's block count, known once the engine core
        started, x block size; 0 if unknown)."""
        config = getattr(getattr(self.engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(config, "num_gpu_blocks", None) or 0
        return int(blocks) * self.block_size

    async def execute_bulk(self, queries: list[QueryBody | SpanQueryError], *,
                           schedule: str = "cluster",
                           max_in_flight: int = bulk.DEFAULT_MAX_IN_FLIGHT,
                           seed: int = 0) -> AsyncIterator[BulkAnswer]:
        """Run a bulk (see :mod:`span_workflows.runtime.bulk`): its answers as each is ready. The
        queries start in schedule order, at most ``max_in_flight`` and half the cache in
        prompt tokens at once (a new one as soon as one ends); identical prepares of the
        queries in flight run once."""
        bulk.check_options(schedule, max_in_flight)
        for index, query in enumerate(queries):
            if isinstance(query, SpanQueryError):
                yield BulkAnswer(index, error=query)
        items = bulk.key_items(queries, self.planner.keyer(), self.planner.compiler.options)
        cache = self.cache_tokens() or sum(i.prompt_tokens for i in items) or 1
        order = bulk.schedule_items(items, schedule, cache, seed=seed).order
        sizes = {item.index: item.prompt_tokens for item in items}
        run = share_prepares_async(lambda req: self._run(req, None))
        running: dict[asyncio.Task[Result | SpanQueryError], int] = {}
        budget, used, at = bulk.WINDOW_FILL * cache, 0, 0
        try:
            while at < len(order) or running:
                while at < len(order) and (not running or (
                        len(running) < max_in_flight and used + sizes[order[at]] <= budget)):
                    index = order[at]
                    task = asyncio.ensure_future(self._bulk_one(queries[index], run))
                    running[task] = index
                    used += sizes[index]
                    at += 1
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = running.pop(task)
                    used -= sizes[index]
                    try:
                        outcome: Result | Exception = task.result()
                    except Exception as exc:  # noqa: BLE001 - this query's answer
                        outcome = exc
                    yield (BulkAnswer(index, error=outcome) if isinstance(outcome, Exception)
                           else BulkAnswer(index, result=outcome))
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _bulk_one(self, query: QueryBody,
                        run: Callable[[Request], Awaitable[Output]]) -> Result | SpanQueryError:
        """One query of a bulk; its error (if invalid) as its outcome."""
        try:
            plan = guarded(self.plan(query.node, query.optimize, query.span_options,
                                     query.cache_salt, query.weights))
        except SpanQueryError as exc:
            return exc
        [outcome] = await drive_async([plan], run, self._probe, self._steps)
        return outcome

    async def _probe(self, step: Probe) -> list[bool]:
        """One utility call per cache salt and weights (usually one for the whole probe)."""
        groups: dict[tuple[str | None, str | None], list[int]] = {}
        for i, key in enumerate(zip(step.salts, step.weights, strict=True)):
            groups.setdefault(key, []).append(i)
        answers = [False] * len(step.sequences)
        for (salt, weights), indices in groups.items():
            prompts = [[list(step.sequences[i].token_ids), list(step.sequences[i].segments)]
                       for i in indices]
            lora = self._lora(weights)
            hits = await self.engine.engine_core.call_utility_async(
                contract.PROBE_CALL, prompts, salt,
                None if lora is None else [lora.lora_int_id, lora.lora_path])
            for i, hit in zip(indices, hits, strict=True):
                answers[i] = bool(hit)
        return answers

    async def _steps(self, step: StepCount) -> list[Steps]:
        return list(await self.engine.engine_core.call_utility_async(
            contract.STEPS_CALL, step.tags))

    async def _run(self, req: Request, stream: PartStream | None,
                   sampling: Mapping[str, Any] | None = None) -> Output:
        run = RequestRun(req, time.perf_counter(), stream)
        outputs = self.engine.generate(tokens_prompt(req),
                                       sampling_params(req, self.layout_key, sampling),
                                       f"span-{uuid.uuid4().hex}",
                                       lora_request=self._lora(req.weights))
        async for out in outputs:
            if run.see(out, time.perf_counter()):
                await outputs.aclose()  # aborts the request in the engine; nothing was streamed
                break
        return run.output(time.perf_counter())

    def _lora(self, weights: str | None) -> Any:
        """The ``LoRARequest`` of the adapter ``weights`` (``None``: the base)."""
        if weights is None:
            return None
        lora = self.loras.get(weights)
        if lora is None:
            raise SpanQueryError("model", f"adapter {weights!r} is not loaded on this server")
        return lora

    async def refresh_stats(self, timeout: float = 5.0) -> dict[str, int]:
        """Fetch the span counters from the engine core (keeps the last values on failure)."""
        try:
            snap = await asyncio.wait_for(
                self.engine.engine_core.call_utility_async(contract.STATS_CALL), timeout
            )
            self.stats.update({k: int(v) for k, v in dict(snap).items()})
        except Exception:  # noqa: BLE001 - metrics must never fail a scrape
            pass
        return dict(self.stats)


class StreamedRun:
    """A query run as a task whose pieces arrive in order on a queue: ``("delta", value)``
    (put by the query's stream, :meth:`put_delta`), then ``("done", result)`` or
    ``("error", exception)``. :meth:`start` waits for the first piece, so that a request
    failing before its first token can still get a plain error answer; :meth:`events` renders
    the rest as the response body and ends the task when the client leaves."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def put_delta(self, value: Any) -> None:
        """A piece of output (the query stream's callback)."""
        self.queue.put_nowait(("delta", value))

    async def start(self, run: Callable[[], Awaitable[Result]]) -> tuple[str, Any]:
        """Start ``run()`` and return the first piece (an ``"error"`` one has ended the
        task)."""

        async def work() -> None:
            try:
                self.queue.put_nowait(("done", await run()))
            except BaseException as exc:  # handed to the response, which reports it
                self.queue.put_nowait(("error", exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        self.task = asyncio.create_task(work())
        try:
            first = await self.queue.get()
        except BaseException:
            self.task.cancel()
            raise
        if first[0] == "error":
            await asyncio.gather(self.task, return_exceptions=True)
        return first

    async def events(self, first: tuple[str, Any],
                     render: Callable[[str, Any], tuple[list[bytes], bool]]
                     ) -> AsyncIterator[bytes]:
        """The body from ``first`` on: ``render(kind, value)`` gives each piece's bytes and
        whether it is the last."""
        kind, value = first
        try:
            while True:
                chunks, last = render(kind, value)
                for chunk in chunks:
                    yield chunk
                if last:
                    return
                kind, value = await self.queue.get()
        finally:
            if self.task is not None:
                if not self.task.done():
                    self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)


__all__ = ["SpanQueryService", "StreamedRun"]
