"""Execution plans of span queries, shared by the embedded engine and the server.

A plan is a generator that yields *steps* and receives their answers:

* a list of :class:`Request` (run them; answer with one :class:`Output` each, in order),
* a :class:`Probe` (which token sequences are all in the prefix cache now; answer with one
  ``bool`` per sequence), or
* a :class:`StepCount` (how many engine steps the requests with these step tags waited for;
  answer with ``[to_first_token, to_end]`` or ``None`` per tag).

Execution of one G: its nested G's first (concurrently when they commute); one probe of
everything its prompt needs from the cache; then per plus (a *stage*), the *prepare* requests
(``max_tokens=1``) of the spans the cache lacks — batched, each computed alone so a span's
cached KV never depends on its neighbours — and then the plus's *link* requests, batched too
(each reads the earlier spans as cached); then the main request, whose spans are cache hits
repositioned to where they now sit. The last stage's prepares and link requests are submitted
with the main request, before it, in one batch: the engine computes them in the answer's own
forward pass. A link block sits where the main request reads it, so the main request shares
it as it is written (each layer writes the whole batch's KV before any token attends); a span
prepared in the same pass sits elsewhere, and is copied inside the pass on CPU
(:mod:`span_vllm.positions`), while elsewhere its readers wait a step for it. A new
combination of cached spans, links included, therefore answers in one engine step (on a GPU
too); a miss with links in one step on CPU, two elsewhere. ``Planner(links_with_answer=False)``
gives the links a step of their own, before the answer's. A span the main request computes in
its own context (``TokenizedQuery.main_computes_from``) is not prepared.

The nested G's of a G that reads them with ``align="pad"`` or ``"bias"`` run with a
:class:`Fill`: their requests go on after their text with pad tokens up to a block boundary
(the plugin's logits processor), and their results hold the text alone (the pads are counted
in ``Metrics.fill_tokens``); the reading G's prompt then finds their last blocks cached.

Plans advance in lockstep: :func:`gather` merges several plans into one, and the drivers
(:func:`drive` for a synchronous engine loop, :func:`drive_async` for an async engine client)
answer every probe before running any request, so all requests that can run together do.

The embedded :class:`span_workflows.runtime.engine.Engine` and the server both run these plans; the
prefix-cache probe is a step of the plan, so the same plan runs against an engine core in this
process or in another one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from span_vllm.contract import BIAS_DEFAULTS, Segments
from span_workflows.compiler.compile import (
    Compiler,
    NestedOutput,
    SpanPrompt,
    TokenizedQuery,
    alignment,
    check_fits,
    nested_generations,
)
from span_workflows.compiler.keys import QueryKeyer
from span_workflows.compiler.optimize import normalize
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Cross, Generate, Node, Plus, child_path, content_hash
from span_workflows.query.sampling import Sampling, parse_answer
from span_workflows.query.span_options import Align, SpanOptions
from span_workflows.runtime.result import Metrics, Result


@dataclass(frozen=True, slots=True)
class Fill:
    """Fill the last KV block of a nested G's request by generation
    (:func:`span_vllm.contract.align_args`): after its text — up to the first of ``ends``, or
    ``budget`` tokens — the request writes ``pad`` up to a block boundary, then ``stop``;
    ``bias`` (or ``None``) nudges where the text ends."""

    pad: int
    stop: int
    ends: tuple[int, ...]
    budget: int
    bias: dict[str, float] | None = None

    def text_end(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a request's output) are its text."""
        for i, token in enumerate(token_ids[: self.budget]):
            if token in self.ends:
                return i + 1
        return min(len(token_ids), self.budget)


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
    #: the step tag the engine core counts this request's steps under
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: fill the last KV block after the text (a nested G read with ``align="pad"``/``"bias"``)
    fill: Fill | None = None
    #: the LoRA adapter (by name) the request runs on; ``None``: the base weights
    weights: str | None = None

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
    #: ``Request.min_cached`` (a prepared span was evicted before it was used), or the engine
    #: failed it before its first token (a span store block could not be loaded)
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
    #: the LoRA adapter each sequence is hashed under (``None``: the base weights)
    weights: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.salts:
            self.salts = [None] * len(self.sequences)
        if not self.weights:
            self.weights = [None] * len(self.sequences)


@dataclass
class StepCount:
    """Ask how many engine steps the requests with these step tags waited for."""

    tags: list[str]


#: What a :class:`StepCount` answers per tag: ``[to_first_token, to_end]`` or ``None``.
Steps = list[int] | None


@dataclass
class _StageLog:
    """The requests of a G's own stages, for counting the engine steps it waited for."""

    stages: list[list[str]] = field(default_factory=list)

    def add(self, requests: Sequence[Request]) -> None:
        self.stages.append([r.tag for r in requests])

    def tags(self) -> list[str]:
        return [t for stage in self.stages for t in stage]

    def totals(self, counts: Sequence[Steps]) -> tuple[int, int]:
        """Steps to the final request's first token and to its end: each earlier stage
        counts to the end of its slowest request (the next stage waits for it)."""
        at = 0
        per_stage: list[list[Steps]] = []
        for stage in self.stages:
            per_stage.append(list(counts[at:at + len(stage)]))
            at += len(stage)
        done = sum(max((c[1] for c in stage if c), default=0) for stage in per_stage[:-1])
        last = [c for c in per_stage[-1] if c] if per_stage else []
        return (done + max((c[0] for c in last), default=0),
                done + max((c[1] for c in last), default=0))


@dataclass(frozen=True, slots=True)
class QuerySettings:
    """Per-query execution settings: span options, the tenant's cache salt, and how many
    top log-probabilities of each final generation's first token to record."""

    options: SpanOptions = field(default_factory=SpanOptions)
    cache_salt: str | None = None
    logprobs: int | None = None
    #: the weights asked for by name (:mod:`span_workflows.runtime.routing`; ``None``: routed)
    weights: str | None = None
    #: whether the caller set ``options`` (else the routed weights' own options apply)
    own_options: bool = False


Step = list[Request] | Probe | StepCount
Plan = Generator[Step, Any, Result]

#: What separates the parts of a top-level join in its text.
PART_SEPARATOR = "\n\n"


class Planner:
    """Turns span queries into plans for one compiler and model context length."""

    def __init__(self, compiler: Compiler, max_model_len: int, *,
                 locality_fanin: int | None = None, links_with_answer: bool = True) -> None:
        self.locality_fanin = locality_fanin
        #: the last plus's link requests go with the answer's request, so a hit with links
        #: answers in one engine step (``False``: a step of their own before it)
        self.links_with_answer = links_with_answer
        self.compiler = compiler
        self.block_size = compiler.block_size
        self.max_model_len = max_model_len
        self._keyers: dict[bool, QueryKeyer] = {}

    def normalize(self, query: Node, optimize_query: bool = True, span_mode: bool = True) -> Node:
        """The tree that is executed (:func:`span_workflows.compiler.optimize.normalize` with this
        planner's locality fan-in)."""
        return normalize(query, optimize_query=optimize_query, span_mode=span_mode,
                         locality_fanin=self.locality_fanin)

    def keyer(self, *, with_prompt: bool = False) -> QueryKeyer:
        """The planner's :class:`~span_workflows.compiler.keys.QueryKeyer` (made once per
        ``with_prompt``): it keys a query by the tree this planner runs, compiled by its
        compiler, so routers and the bulk scheduler name the blocks the engine will hold."""
        keyer = self._keyers.get(with_prompt)
        if keyer is None:
            keyer = self._keyers[with_prompt] = QueryKeyer(
                self.compiler.renderer.tokenizer, self.block_size, with_prompt=with_prompt,
                compiler=self.compiler, locality_fanin=self.locality_fanin)
        return keyer

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
            fill_tokens=sum(p.metrics.fill_tokens for p in parts),
            nested_tokens=sum(p.metrics.nested_tokens for p in parts),
            nested_lost_tokens=sum(p.metrics.nested_lost_tokens for p in parts),
            nested_computed_tokens=sum(p.metrics.nested_computed_tokens for p in parts),
            # a plus's parts run together: the first answer waits for the fewest steps; a
            # cross's parts one after another: its first part starts first
            engine_steps=(min if isinstance(node, Plus) else _first)(
                [p.metrics.engine_steps for p in parts]),
            final_steps=(min if isinstance(node, Plus) else _first)(
                [p.metrics.final_steps for p in parts]),
        )
        return Result(PART_SEPARATOR.join(p.text for p in parts), metrics,
                      [t for p in parts for t in p.texts], parts=parts,
                      steps_to_end=(max if isinstance(node, Plus) else sum)(
                          p.steps_to_end for p in parts))

    def plan_generate(self, g: Generate, span_mode: bool, *, inline: bool,
                      part: int | None = None, settings: QuerySettings | None = None,
                      read_as: Align | None = None) -> Plan:
        """One G: nested G's, prepares of uncached spans, then the main request. ``read_as``
        is how the G that reads this one (``inline``) aligns it."""
        settings = settings or QuerySettings(self.compiler.options)
        options, salt = settings.options, settings.cache_salt
        started = time.perf_counter()
        nested_nodes = nested_generations(g)
        nested: dict[str, NestedOutput] = {}
        nested_results: dict[str, Result] = {}
        if nested_nodes:
            align = alignment(g, options)
            results = yield from gather([
                self.plan_generate(child, span_mode, inline=span_mode and child.inline_prompt,
                                   settings=settings, read_as=align)
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
        fill = (self._fill(g, max_tokens, options, read_as)
                if span_mode and inline and read_as in ("pad", "bias") else None)
        if fill is not None:
            max_tokens = min(max_tokens + self.block_size,
                             self.max_model_len - len(tq.token_ids))
        drafts = _DraftTokens(tq, nested) if span_mode and nested else None
        expected = _expected_hits(tq) if span_mode else 0
        prepared = relinked = prepared_tokens = 0
        log = _StageLog()

        def count_prepares(prompts: Sequence[SpanPrompt], outs: Sequence[Output]) -> None:
            nonlocal prepared, prepared_tokens
            prepared += len(prompts)
            prepared_tokens += _computed(outs)
            if drafts is not None:
                drafts.count_prepares(prompts, outs)

        def count_links(prompts: Sequence[SpanPrompt], outs: Sequence[Output]) -> None:
            nonlocal relinked, prepared_tokens
            relinked += len(prompts)
            prepared_tokens += _computed(outs)

        for attempt in range(MAX_ATTEMPTS):
            everything = [*tq.prepare, *tq.links] if span_mode else []
            hit: set[tuple] = set()
            if everything and not attempt:
                cached = yield Probe(everything, [salt] * len(everything))
                hit = {_key(p) for p, c in zip(everything, cached, strict=True) if c}
            # After an eviction, prepare every span again (``hit`` stays empty): those already
            # cached are then in use, and freshest in the cache, while the missing ones compute.
            # A later stage's context holds the spans of the earlier ones: stages run in order;
            # a stage's links read its spans as cached: after its prepares.
            # The last stage's prepares and links go with the main request, in that order: the
            # engine computes them in the answer's own forward pass where it can (a link block
            # sits where the answer reads it: shared, not moved; a span prepared in the same
            # pass is copied inside it on CPU, else the reader waits a step).
            final_prepares: list[SpanPrompt] = []
            final_links: list[SpanPrompt] = []
            for index, (stage, links) in enumerate(
                    zip(tq.prepare_stages, tq.link_stages, strict=True)):
                prepares = missing(stage, [_key(p) in hit for p in stage])
                relinks = missing(links, [_key(p) in hit for p in links])
                if index == len(tq.prepare_stages) - 1 and (
                        self.links_with_answer or not relinks):
                    final_prepares, final_links = prepares, relinks
                    continue
                if prepares:
                    requests = [Request.prepare(p, salt) for p in prepares]
                    log.add(requests)
                    count_prepares(prepares, (yield requests))
                if relinks:
                    requests = [Request.prepare(p, salt) for p in relinks]
                    log.add(requests)
                    count_links(relinks, (yield requests))
            last = attempt == MAX_ATTEMPTS - 1
            logprobs = g.sampling.logprobs if settings.logprobs is None else settings.logprobs
            final = Request(tq.token_ids, max_tokens, tq.temperature, tq.n, part,
                            None if inline else logprobs, 0 if last else expected,
                            tq.segments, salt, g.sampling, fill=fill)
            batch = [*(Request.prepare(p, salt) for p in (*final_prepares, *final_links)), final]
            log.add(batch)
            *outs, out = yield batch
            count_prepares(final_prepares, outs[:len(final_prepares)])
            count_links(final_links, outs[len(final_prepares):])
            if not out.short:
                break
        if out.short and out.finish_reasons and out.finish_reasons[0] == "error":
            raise RuntimeError(f"the engine failed the request {MAX_ATTEMPTS} times "
                               "(KV blocks it was promised could not be loaded)")
        filled = 0
        if fill is not None:
            out, filled = _without_fill(out, fill, self.compiler.renderer.tokenizer)
        counts = yield StepCount(log.tags())
        own_first, own_end = log.totals(counts)
        before = max((r.steps_to_end for r in nested_results.values()), default=0)
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
            engine_steps=before + own_first,
            final_steps=own_first,
            fill_tokens=filled,
            nested_tokens=drafts.tokens if drafts else 0,
            nested_lost_tokens=drafts.lost if drafts else 0,
            nested_computed_tokens=drafts.computed if drafts else 0,
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
                      finish_reason=finish, tool_calls=calls, logprobs=out.logprobs,
                      steps_to_end=before + own_end)


    def _fill(self, g: Generate, budget: int, options: SpanOptions,
              read_as: Align) -> Fill | None:
        """The fill of a nested G read with ``align="pad"``/``"bias"``; ``None`` for a G with
        stop sequences (vLLM ends it on the text, so its last block is computed by a prepare,
        as with ``"recompute"``)."""
        if g.sampling.stop or not self.compiler.end_ids:
            return None
        bias = dict(BIAS_DEFAULTS) if read_as == "bias" else None
        return Fill(self.compiler.pad_id(options), self.compiler.tokens.marker,
                    self.compiler.end_ids, budget, bias)


MAX_ATTEMPTS = 3


class _DraftTokens:
    """Counts, for a G that reads nested G's, their tokens, those its prompt leaves out, and
    those its prepare requests compute again (real tokens of a draft's last block)."""

    def __init__(self, tq: TokenizedQuery, nested: Mapping[str, NestedOutput]) -> None:
        self.tokens = self.lost = self.computed = 0
        self._pads: dict[tuple[int, ...], int] = {}
        for span in tq.spans:
            if span.kind != "generated":
                continue
            out = nested.get(span.label.removeprefix("G@"))
            if out is None:
                continue
            total = len(out.prompt_ids) + len(out.output_ids)
            self.tokens += total
            self.lost += max(0, total - span.content_tokens)
            key = tuple(tq.token_ids[span.offset:span.offset + span.length])
            self._pads[key] = span.pad_tokens

    def count_prepares(self, prompts: Sequence[SpanPrompt], outs: Sequence[Output]) -> None:
        """Add the draft tokens that these prepare requests computed."""
        for prompt, out in zip(prompts, outs, strict=True):
            pads = self._pads.get(prompt.token_ids)
            if pads is not None:
                self.computed += max(0, out.prompt_tokens - out.cached_tokens - pads)


def _without_fill(out: Output, fill: Fill, tokenizer: Any) -> tuple[Output, int]:
    """``out`` of a filled request as its text alone, and how many tokens the fill took."""
    ids, texts, reasons, filled = [], [], [], 0
    for i, tokens in enumerate(out.token_ids):
        end = fill.text_end(tokens)
        text_ids, extra = tokens[:end], tokens[end:]
        text = out.texts[i]
        if extra:
            tail = tokenizer.decode(extra, skip_special_tokens=True)
            text = (text[: len(text) - len(tail)] if tail and text.endswith(tail)
                    else tokenizer.decode(text_ids, skip_special_tokens=True) if tail else text)
        ended = bool(text_ids) and text_ids[-1] in fill.ends
        ids.append(text_ids)
        texts.append(text)
        reasons.append("stop" if ended else "length" if end >= fill.budget
                       else (out.finish_reasons[i] if i < len(out.finish_reasons) else "stop"))
        filled += len(extra) if i == 0 else 0
    logprobs = out.logprobs[: len(ids[0])] if ids else out.logprobs
    return dataclasses.replace(out, texts=texts, token_ids=ids, finish_reasons=reasons,
                               logprobs=logprobs), filled


def _first(values: Sequence[int]) -> int:
    return values[0] if values else 0


def _computed(outputs: Sequence[Output]) -> int:
    """Prompt tokens that ``outputs``' requests computed (did not read from the cache)."""
    return sum(max(0, o.prompt_tokens - o.cached_tokens) for o in outputs)


def _expected_hits(tq: TokenizedQuery) -> int:
    """Prompt tokens that must come from the cache for every span to have been computed in
    its own context: everything before the final ordered tail, or before the part the main
    request computes in its own context (0 when the prompt has no spans)."""
    if not tq.spans or not any(s.kind in ("plus", "generated") for s in tq.spans):
        return 0
    return min(tq.spans[-1].offset, tq.main_computes_from)


def missing(prompts: Sequence[SpanPrompt], cached: Sequence[bool]) -> list[SpanPrompt]:
    """The prompts not cached (per ``cached``), without duplicates, in order; a prompt that
    another one of them starts with (tokens and segments) is left out: the longer computes
    and caches it."""
    unique: dict[tuple, SpanPrompt] = {}
    for prompt, hit in zip(prompts, cached, strict=True):
        if not hit:
            unique.setdefault(_key(prompt), prompt)
    wanted = list(unique.values())
    return [p for p in wanted if not any(q is not p and _starts(q, p) for q in wanted)]


def _starts(longer: SpanPrompt, prompt: SpanPrompt) -> bool:
    """Whether ``longer`` begins with ``prompt``: its tokens, under the same segments."""
    n = len(prompt.token_ids)
    return (len(longer.token_ids) > n and longer.token_ids[:n] == prompt.token_ids
            and tuple(s for s in longer.segments if s[0] < n) == tuple(prompt.segments))


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


def _merge(pending: dict[int, Step]) -> tuple[Step, list[tuple[int, int]]]:
    """The next merged step of ``pending`` plans: all their probes if any probe, else all
    their step counts if any, else all their requests; with ``(plan index, answer count)`` in
    answer order."""
    probes = {i: s for i, s in pending.items() if isinstance(s, Probe)}
    if probes:
        order = [(i, len(s.sequences)) for i, s in probes.items()]
        return Probe([q for s in probes.values() for q in s.sequences],
                     [salt for s in probes.values() for salt in s.salts],
                     [w for s in probes.values() for w in s.weights]), order
    counts = {i: s for i, s in pending.items() if isinstance(s, StepCount)}
    if counts:
        return (StepCount([t for s in counts.values() for t in s.tags]),
                [(i, len(s.tags)) for i, s in counts.items()])
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
          probe: Callable[[Probe], list[bool]],
          steps: Callable[[StepCount], list[Steps]] | None = None) -> list[Result]:
    """Run plans to completion with a synchronous engine: ``run`` executes a batch of
    requests together, ``probe`` answers cache probes, ``steps`` step counts (without it,
    every count is unknown: 0)."""
    plan = gather(plans)
    try:
        step = next(plan)
        while True:
            if isinstance(step, Probe):
                answer: list[Any] = probe(step)
            elif isinstance(step, StepCount):
                answer = steps(step) if steps is not None else [None] * len(step.tags)
            else:
                answer = run(step)
            step = plan.send(answer)
    except StopIteration as stop:
        return stop.value


def guarded(plan: Plan) -> Generator[Step, Any, Result | SpanQueryError]:
    """``plan``, whose :class:`SpanQueryError` (or a query too deep to process) becomes its
    result instead of ending the plans it runs with: one bad query of many fails alone."""
    try:
        return (yield from plan)
    except SpanQueryError as exc:
        return exc
    except (RecursionError, MemoryError) as exc:
        return SpanQueryError("", f"query too large to process ({type(exc).__name__})")


def prepare_key(req: Request) -> tuple | None:
    """What makes two prepare requests the same work (their KV is the same), or ``None`` for
    a request that is not a plain prepare."""
    if (req.max_tokens != 1 or req.temperature != 0.0 or req.n != 1 or req.part is not None
            or req.logprobs is not None or req.min_cached or req.sampling != Sampling()):
        return None
    return (tuple(req.prompt), tuple(req.segments), req.cache_salt, req.weights)


def _reused(out: Output) -> Output:
    """``out`` as seen by a request that shared another's work: it computed nothing."""
    return replace(out, cached_tokens=out.prompt_tokens)


def share_prepares(run: Callable[[list[Request]], list[Output]]
                   ) -> Callable[[list[Request]], list[Output]]:
    """A ``run`` for :func:`drive` that runs identical prepare requests of one batch once (the
    plans of several queries missing the same span would each compute it); the others get its
    output with every prompt token counted as cached."""

    def shared(requests: list[Request]) -> list[Output]:
        first: dict[tuple, int] = {}
        unique: list[Request] = []
        source: list[tuple[int, bool]] = []
        for req in requests:
            key = prepare_key(req)
            if key is not None and key in first:
                source.append((first[key], True))
                continue
            if key is not None:
                first[key] = len(unique)
            source.append((len(unique), False))
            unique.append(req)
        outs = run(unique)
        return [_reused(outs[i]) if copy else outs[i] for i, copy in source]

    return shared


def share_prepares_async(run: Callable[[Request], Awaitable[Output]]
                         ) -> Callable[[Request], Awaitable[Output]]:
    """:func:`share_prepares` for :func:`drive_async`: a prepare identical to one still running
    (for any plan driven with this ``run``) waits for it instead of computing it again."""
    running: dict[tuple, asyncio.Future[Output]] = {}

    async def shared(req: Request) -> Output:
        key = prepare_key(req)
        if key is None:
            return await run(req)
        if key in running:
            return _reused(await asyncio.shield(running[key]))
        task = asyncio.ensure_future(run(req))
        running[key] = task
        try:
            return await task
        finally:
            if running.get(key) is task:
                del running[key]

    return shared


async def drive_async(plans: list[Plan], run: Callable[[Request], Awaitable[Output]],
                      probe: Callable[[Probe], Awaitable[list[bool]]],
                      steps: Callable[[StepCount], Awaitable[list[Steps]]] | None = None,
                      ) -> list[Result]:
    """Run plans to completion with an async engine: ``run`` executes one request (the
    requests of a step run concurrently), ``probe`` answers cache probes, ``steps`` step
    counts (without it, every count is unknown: 0)."""
    plan = gather(plans)
    try:
        step = next(plan)
        while True:
            if isinstance(step, Probe):
                answer: list[Any] = await probe(step)
            elif isinstance(step, StepCount):
                answer = (await steps(step) if steps is not None
                          else [None] * len(step.tags))
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
    "Fill", "Metrics", "Output", "Plan", "Planner", "Probe", "QuerySettings", "Request", "Result",
    "Step", "StepCount", "Steps",
    "check_fits",
    "drive", "drive_async", "gather", "guarded", "missing", "prepare_key", "share_prepares",
    "share_prepares_async",
]
