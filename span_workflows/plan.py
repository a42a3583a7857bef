"""Execution plans of span queries, shared by the embedded engine and the server.

A plan is a generator that yields *steps* and receives their answers:

* a list of :class:`Request` (run them; answer with one :class:`Output` each, in order), or
* a :class:`Probe` (which token sequences are all in the prefix cache now; answer with one
  ``bool`` per sequence).

Execution of one G: its nested G's first (concurrently when they commute), then *prepare*
requests (``max_tokens=1``) for the prefix and every plus span the cache does not hold yet —
batched, each computed alone so a span's cached KV never depends on its neighbours — then the
main request, whose spans are cache hits repositioned to where they now sit.

Plans advance in lockstep: :func:`gather` merges several plans into one, and the drivers
(:func:`drive` for a synchronous engine loop, :func:`drive_async` for an async engine client)
answer every probe before running any request, so all requests that can run together do.

The embedded :class:`span_workflows.engine.Engine` and the server both run these plans; the
prefix-cache probe is a step of the plan, so the same plan runs against an engine core in this
process or in another one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from span_vllm.contract import Segments
from span_workflows.compile import (
    Compiler,
    NestedOutput,
    SpanPrompt,
    TokenizedQuery,
    check_fits,
    nested_generations,
)
from span_workflows.errors import SpanQueryError
from span_workflows.ir import MESSAGE_TYPES, Cross, Generate, Node, Plus, child_path, content_hash
from span_workflows.layout import SpanOptions
from span_workflows.optimize import optimize, ordered_for_stock
from span_workflows.result import Metrics, Result
from span_workflows.sampling import Sampling, parse_answer
from span_workflows.tool_prompt import with_tool_prompts


@dataclass
class Request:
    """One generation to run. ``part`` is set on the final generation of a top-level G: its
    index among the parts of the query's answer (for streaming); ``None`` elsewhere."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    n: int = 1
    part: int | None = None
    logprobs: int | None = None
    #: abort after the first step if fewer prompt tokens than this came from the cache
    min_cached: int = 0
    #: span segments of ``prompt`` (empty: a plain prompt, hashed as stock vLLM does)
    segments: Segments = ()
    #: vLLM's ``cache_salt``: requests with different salts share no cached KV
    cache_salt: str | None = None
    #: the other sampling options and the output constraint (the G's)
    sampling: Sampling = field(default_factory=Sampling)

    @classmethod
    def prepare(cls, prompt: SpanPrompt, cache_salt: str | None = None) -> Request:
        """A prepare request: compute ``prompt``'s KV (one token generated, greedy)."""
        return cls(list(prompt.token_ids), 1, 0.0, segments=prompt.segments,
                   cache_salt=cache_salt)


@dataclass
class Output:
    """What a :class:`Request` produced, with its timings (``time.perf_counter`` seconds)."""

    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: int
    cached_tokens: int
    submitted: float
    first_token: float
    finished: float
    first_logprobs: dict[int, float] = field(default_factory=dict)
    #: the request was aborted after its first step: its cache hits fell short of
    #: ``Request.min_cached`` (a prepared span was evicted before it was used)
    short: bool = False
    #: why each sample ended: ``"stop"`` (end of turn or a stop sequence) or ``"length"``
    finish_reasons: list[str] = field(default_factory=list)
    #: the first sample's top log-probabilities per generated token (when asked)
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class Probe:
    """Ask which of ``sequences`` (each hashed as a request with its segments) are fully
    cached."""

    sequences: list[SpanPrompt]
    #: the ``cache_salt`` each sequence is hashed with (``None``: unsalted)
    salts: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.salts:
            self.salts = [None] * len(self.sequences)


@dataclass(frozen=True, slots=True)
class QuerySettings:
    """Per-query execution settings: span options, the tenant's cache salt, and how many
    top log-probabilities of each final generation's first token to record."""

    options: SpanOptions = field(default_factory=SpanOptions)
    cache_salt: str | None = None
    logprobs: int | None = None


Step = list[Request] | Probe
Plan = Generator[Step, Any, Result]

#: What separates the parts of a top-level join in its text.
PART_SEPARATOR = "\n\n"


class Planner:
    """Turns span queries into plans for one compiler and model context length."""

    def __init__(self, compiler: Compiler, max_model_len: int, *,
                 locality_fanin: int | None = None) -> None:
        self.locality_fanin = locality_fanin
        self.compiler = compiler
        self.block_size = compiler.block_size
        self.max_model_len = max_model_len

    def normalize(self, query: Node, optimize_query: bool = True, span_mode: bool = True) -> Node:
        """The tree that is executed: optimized (span mode) or desugared in order (stock).
        A top-level join holding a message is refused here, with its path in ``query`` (the
        optimizer reorders a plus)."""
        if isinstance(query, (Plus, Cross)):
            for i, child in enumerate(query.children):
                if isinstance(child, MESSAGE_TYPES):
                    raise SpanQueryError(child_path("", query, i),
                                         "a top-level join must join G's")
        query = with_tool_prompts(query)
        node = optimize(query, locality_fanin=self.locality_fanin) if optimize_query else query
        if not span_mode:
            node = ordered_for_stock(query)
        return node

    def plan_query(self, node: Node, span_mode: bool = True,
                   settings: QuerySettings | None = None) -> Plan:
        """The plan of a normalized query: a G or a top-level plus/cross of G's."""
        settings = settings or QuerySettings(self.compiler.options)
        if isinstance(node, Generate):
            return self.plan_generate(node, span_mode, inline=False, part=0, settings=settings)
        if isinstance(node, (Plus, Cross)):
            return self.plan_join(node, span_mode, settings)
        raise SpanQueryError("", f"the top of a query must be a G (or a join of G's), not "
                                 f"{type(node).__name__}")

    def plan_join(self, node: Plus | Cross, span_mode: bool,
                  settings: QuerySettings | None = None) -> Plan:
        """A top-level join: a plus runs its G's together, a cross one after another."""
        started = time.perf_counter()
        for i, child in enumerate(node.children):
            if not isinstance(child, Generate):
                raise SpanQueryError(child_path("", node, i), "a top-level join must join G's")
        if isinstance(node, Plus):
            parts = yield from gather([
                self.plan_generate(c, span_mode, inline=False, part=i, settings=settings)
                for i, c in enumerate(node.children)
            ])
        else:
            parts = []
            for i, child in enumerate(node.children):
                parts.append(
                    (yield from self.plan_generate(child, span_mode, inline=False, part=i,
                                                   settings=settings))
                )
        metrics = Metrics(
            ttft_s=min(p.metrics.ttft_s for p in parts),
            prompt_tokens=sum(p.metrics.prompt_tokens for p in parts),
            cached_tokens=sum(p.metrics.cached_tokens for p in parts),
            generated_tokens=sum(p.metrics.generated_tokens for p in parts),
            prepare_requests=sum(p.metrics.prepare_requests for p in parts),
            latency_s=time.perf_counter() - started,
            link_requests=sum(p.metrics.link_requests for p in parts),
            prepared_tokens=sum(p.metrics.prepared_tokens for p in parts),
        )
        return Result(PART_SEPARATOR.join(p.text for p in parts), metrics,
                      [t for p in parts for t in p.texts], parts=parts)

    def plan_generate(self, g: Generate, span_mode: bool, *, inline: bool,
                      part: int | None = None, settings: QuerySettings | None = None) -> Plan:
        """One G: nested G's, prepares of uncached spans, then the main request."""
        settings = settings or QuerySettings(self.compiler.options)
        options, salt = settings.options, settings.cache_salt
        started = time.perf_counter()
        nested_nodes = nested_generations(g)
        nested: dict[str, NestedOutput] = {}
        nested_results: dict[str, Result] = {}
        if nested_nodes:
            results = yield from gather([
                self.plan_generate(child, span_mode, inline=span_mode and child.inline_prompt,
                                   settings=settings)
                for _, child in nested_nodes
            ])
            for (path, _), result in zip(nested_nodes, results, strict=True):
                assert result.query is not None
                nested[path] = NestedOutput(
                    tuple(result.query.token_ids), tuple(result.token_ids), result.text
                )
                nested_results[path] = result
        if inline:
            prompt = self.compiler.inner_prompt(g, options)
            tq = TokenizedQuery(list(prompt.token_ids), [], self.block_size, g.max_tokens,
                                g.temperature, g.n, segments=prompt.segments, options=options)
            check_fits(tq, self.max_model_len)
        else:
            tq = self.compiler.compile_generate(
                g, nested, span_mode=span_mode, max_model_len=self.max_model_len,
                options=options,
            )
        max_tokens = tq.max_tokens or (self.max_model_len - len(tq.token_ids))
        expected = _expected_hits(tq) if span_mode else 0
        prepared = relinked = prepared_tokens = 0
        for attempt in range(MAX_ATTEMPTS):
            if span_mode and tq.prepare_stages:
                everything = tq.prepare
                cached = yield Probe(everything, [salt] * len(everything))
                # After an eviction, prepare every span again: those already cached are
                # then in use, and freshest in the cache, while the missing ones compute.
                hit = {_key(p) for p, c in zip(everything, cached, strict=True)
                       if c and not attempt}
                # A later stage's context holds the spans of the earlier ones: run in order.
                for stage in tq.prepare_stages:
                    prepares = missing(stage, [_key(p) in hit for p in stage])
                    if prepares:
                        outs = yield [Request.prepare(p, salt) for p in prepares]
                        prepared += len(prepares)
                        prepared_tokens += _computed(outs)
            if span_mode and tq.links:
                linked = yield Probe(tq.links, [salt] * len(tq.links))
                # Each link request reads the links before it: one at a time, in order.
                for link, cached in zip(tq.links, linked, strict=True):
                    if not cached or attempt:
                        outs = yield [Request.prepare(link, salt)]
                        relinked += 1
                        prepared_tokens += _computed(outs)
            last = attempt == MAX_ATTEMPTS - 1
            logprobs = g.sampling.logprobs if settings.logprobs is None else settings.logprobs
            [out] = yield [Request(tq.token_ids, max_tokens, tq.temperature, tq.n, part,
                                   None if inline else logprobs,
                                   0 if last else expected, tq.segments, salt, g.sampling)]
            if not out.short:
                break
        metrics = Metrics(
            ttft_s=out.first_token - started,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            generated_tokens=sum(len(t) for t in out.token_ids),
            prepare_requests=prepared,
            latency_s=out.finished - started,
            final_ttft_s=out.first_token - out.submitted,
            link_requests=relinked,
            prepared_tokens=prepared_tokens,
        )
        finish = out.finish_reasons[0] if out.finish_reasons else "stop"
        text, calls = out.texts[0], []
        if g.sampling.uses_tools:
            answer = parse_answer(text, f"call_{content_hash(g)[:8]}_{len(tq.token_ids)}")
            if answer is not None:
                text, calls = answer
                finish = "tool_calls" if calls else finish
        return Result(text, metrics, out.texts, out.token_ids[0], tq,
                      first_logprobs=out.first_logprobs, nested=nested_results,
                      finish_reason=finish, tool_calls=calls, logprobs=out.logprobs)


MAX_ATTEMPTS = 3


def _computed(outputs: Sequence[Output]) -> int:
    """Prompt tokens that ``outputs``' requests computed (did not read from the cache)."""
    return sum(max(0, o.prompt_tokens - o.cached_tokens) for o in outputs)


def _expected_hits(tq: TokenizedQuery) -> int:
    """Prompt tokens that must come from the cache for every span to have been computed alone:
    everything before the final ordered tail (0 when the prompt has no spans)."""
    if not tq.spans or not any(s.kind in ("plus", "generated") for s in tq.spans):
        return 0
    return tq.spans[-1].offset


def missing(prompts: Sequence[SpanPrompt], cached: Sequence[bool]) -> list[SpanPrompt]:
    """The prompts not cached (per ``cached``), without duplicates, in order."""
    unique: dict[tuple, SpanPrompt] = {}
    for prompt, hit in zip(prompts, cached, strict=True):
        if not hit:
            unique.setdefault(_key(prompt), prompt)
    return list(unique.values())


def _key(prompt: SpanPrompt) -> tuple:
    return (prompt.token_ids, prompt.segments)


def _start(plans: Sequence[Plan], results: list[Result | None]) -> dict[int, Step]:
    pending: dict[int, Step] = {}
    for i, plan in enumerate(plans):
        try:
            pending[i] = next(plan)
        except StopIteration as stop:
            results[i] = stop.value
    return pending


def _size(step: Step) -> int:
    return len(step.sequences) if isinstance(step, Probe) else len(step)


def _merge(pending: dict[int, Step]) -> tuple[Step, list[tuple[int, int]]]:
    """The next merged step of ``pending`` plans: all their probes if any probe, else all
    their requests; with ``(plan index, answer count)`` in answer order."""
    probes = {i: s for i, s in pending.items() if isinstance(s, Probe)}
    if probes:
        order = [(i, len(s.sequences)) for i, s in probes.items()]
        return Probe([q for s in probes.values() for q in s.sequences],
                     [salt for s in probes.values() for salt in s.salts]), order
    order = [(i, len(s)) for i, s in pending.items()]  # type: ignore[arg-type]
    return [r for s in pending.values() for r in s], order  # type: ignore[union-attr]


def _answer(plans: Sequence[Plan], pending: dict[int, Step], results: list[Result | None],
            order: list[tuple[int, int]], answers: Sequence[Any]) -> None:
    at = 0
    for i, count in order:
        try:
            pending[i] = plans[i].send(list(answers[at:at + count]))
        except StopIteration as stop:
            results[i] = stop.value
            del pending[i]
        at += count


def gather(plans: list[Plan]) -> Generator[Step, Any, list[Result]]:
    """Advance several plans in lockstep; return their results in order."""
    results: list[Result | None] = [None] * len(plans)
    pending = _start(plans, results)
    while pending:
        step, order = _merge(pending)
        answers = yield step
        _answer(plans, pending, results, order, answers)
    return [r for r in results if r is not None]


def drive(plans: list[Plan], run: Callable[[list[Request]], list[Output]],
          probe: Callable[[Probe], list[bool]]) -> list[Result]:
    """Run plans to completion with a synchronous engine: ``run`` executes a batch of
    requests together, ``probe`` answers cache probes."""
    plan = gather(plans)
    try:
        step = next(plan)
        while True:
            answer = probe(step) if isinstance(step, Probe) else run(step)
            step = plan.send(answer)
    except StopIteration as stop:
        return stop.value


async def drive_async(plans: list[Plan], run: Callable[[Request], Awaitable[Output]],
                      probe: Callable[[Probe], Awaitable[list[bool]]]) -> list[Result]:
    """Run plans to completion with an async engine: ``run`` executes one request (the
    requests of a step run concurrently), ``probe`` answers cache probes."""
    plan = gather(plans)
    try:
        step = next(plan)
        while True:
            if isinstance(step, Probe):
                answer: list[Any] = await probe(step)
            else:
                answer = list(await _all(run(r) for r in step))
            step = plan.send(answer)
    except StopIteration as stop:
        return stop.value


async def _all(coros: Any) -> list[Any]:
    """Await coroutines concurrently; if one fails, cancel the rest and re-raise."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


__all__ = [
    "Metrics", "Output", "Plan", "Planner", "Probe", "QuerySettings", "Request", "Result", "Step",
    "check_fits",
    "drive", "drive_async", "gather", "missing",
]
