"""A query's span keys: the compiler's token form, hashed by the engine's rules.

:class:`SpanKey` names one routable piece of span KV and its size; routers
(:mod:`span_workflows.scaleout`) and the bulk scheduler (:mod:`span_workflows.runtime.bulk`) both
read them. :class:`QueryKeyer` normalizes a query as the planner does
(:func:`span_workflows.compiler.optimize.normalize`; an engine's or server's keyer is its planner's,
:meth:`Planner.keyer`, with its compiler and locality fan-in), compiles each of its G's
(:meth:`Compiler.compile_generate`) and keys the blocks of every plus span with
:func:`span_vllm.routing_block_keys` — the block hash chain the engine uses, so a span's keys
name its tokens and its anchor (the ordered context before its plus), never its position
among its siblings: the same documents retrieved in another order give the same keys.

A G whose prompt depends on the output of a nested G (not known before it runs) is keyed
without that output's span; a G that does not compile here (the server will report why) gives
no keys, and the query is routed by load alone.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import span_vllm
from span_workflows.compiler.compile import Compiler, TokenizedQuery
from span_workflows.compiler.optimize import normalize
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import MESSAGE_TYPES, Generate, Node, iter_nodes
from span_workflows.query.span_options import SpanOptions


@dataclass(frozen=True, slots=True)
class SpanKey:
    """One routable piece of span KV: ``key`` names it (equal keys = the same KV), ``tokens``
    is its size (> 0)."""

    key: Hashable
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens <= 0:
            raise ValueError(f"a span key holds a positive number of tokens, not {self.tokens}")


@dataclass(frozen=True, slots=True)
class QueryRoute:
    """What a router needs of one query: its span keys and its prompt text in order (for
    text-prefix routers such as Ray Serve LLM's ``PrefixCacheAffinityRouter``)."""

    keys: tuple[Any, ...]
    prompt: str = ""
    #: tokens of the query's compiled prompts (its G's), spans included
    prompt_tokens: int = 0
    #: plus spans (and spans of nested outputs) in those prompts
    spans: int = 0

    @property
    def span_tokens(self) -> int:
        """Tokens in the query's keyed spans."""
        return sum(k.tokens for k in self.keys)


class QueryKeyer:
    """Span keys of queries for one tokenizer and KV block size (the replicas' block size:
    keys at another size would name other blocks). ``compiler``: the caller's own compiler of
    that tokenizer and block size (an engine's), so a query is keyed by the very token form it
    runs as; one is built when none is given. ``locality_fanin``: the optimizer's, as the
    planner whose queries are keyed has it (an engine's keyer is :meth:`Planner.keyer`)."""

    def __init__(self, tokenizer: Any, block_size: int, *, with_prompt: bool = False,
                 compiler: Compiler | None = None, locality_fanin: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if compiler is not None and compiler.block_size != block_size:
            raise ValueError(f"the compiler's block size {compiler.block_size} is not "
                             f"{block_size}")
        self.tokenizer = tokenizer
        self.compiler = compiler or Compiler.for_tokenizer(tokenizer, block_size)
        self.block_size = block_size
        self.with_prompt = with_prompt
        self.locality_fanin = locality_fanin

    def route(self, node: Node, *, optimize_query: bool = True,
              span_options: SpanOptions | None = None,
              cache_salt: str | None = None) -> QueryRoute:
        """The :class:`QueryRoute` of a parsed query (never raises for a query the compiler
        refuses: that one gets no keys)."""
        try:
            tree = normalize(node, optimize_query=optimize_query,
                             locality_fanin=self.locality_fanin)
        except (SpanQueryError, RecursionError):
            return QueryRoute(())
        keys: list[SpanKey] = []
        prompt_tokens = spans = 0
        prompt = ""  # the messages' text in the order sent (what a text-prefix router sees)
        for g in (n for n in iter_nodes(tree) if isinstance(n, Generate)):
            try:
                tq = self.compiler.compile_generate(g, {}, options=span_options)
            except (SpanQueryError, KeyError, ValueError):
                continue
            keys.extend(SpanKey(h, self.block_size) for h in self.span_block_keys(tq, cache_salt))
            prompt_tokens += len(tq.token_ids)
            spans += sum(1 for s in tq.spans if s.kind in ("plus", "generated"))
        if self.with_prompt:
            prompt = "".join(str(getattr(n, "text", "")) for n in iter_nodes(node)
                             if isinstance(n, MESSAGE_TYPES))
        return QueryRoute(tuple(keys), prompt, prompt_tokens, spans)

    def span_block_keys(self, tq: TokenizedQuery, cache_salt: str | None = None) -> list[bytes]:
        """Keys of the full blocks of ``tq``'s plus spans (and spans of nested outputs)."""
        hashes = span_vllm.routing_block_keys(tq.token_ids, self.block_size, tq.segments,
                                              cache_salt)
        out = []
        for span in tq.spans:
            if span.kind not in ("plus", "generated"):
                continue
            first = span.offset // self.block_size
            last = (span.offset + span.length) // self.block_size
            out.extend(hashes[first:min(last, len(hashes))])
        return out


__all__ = ["QueryKeyer", "QueryRoute", "SpanKey"]
