"""An exact HF-transformers reference of what every span mode computes, for measuring quality.

A span-mode prompt (:class:`~span_workflows.compiler.compile.TokenizedQuery`) is answered by one
forward pass of the model over its token form with a custom attention mask that gives every
token exactly the KV context its mode promises, then greedy decoding with the KV cache. Position
ids are always a token's index in the token form: RoPE attention depends on relative positions
only, so "a span computed alone from position 0, its keys rotated to where it sits" is the same
computation (up to float rounding) as "the span computed under this mask at its final position".

Attention modes (``attention``), for the tokens of plus spans; ordered tokens (``prefix`` and
``cross`` spans) always attend to every token before them:

* ``"full"`` — ordinary causal attention over the whole token form (the span *layout* with no
  isolation: what the layout alone costs);
* ``"prefix"`` — what the engine computes for ``SpanOptions(attend="prefix")``: every plus
  span is computed *right after* the ordered context before its plus group (as its prepare
  request computes it), attending to that context and to itself, never to sibling spans; its
  keys are then rotated to where the span sits. Built stage by stage (one forward per span over
  the context's KV, keys rotated with the model's own rotary embedding, the KV spliced into
  one cache), since a span that moved sees its context at its prepare-time distance, which no
  single masked pass at the final positions reproduces;
* ``"prefix-final"`` — the same attention pattern computed at the final positions (the span
  sees its context at the distance it sits from it in the final prompt): a reference-only
  variant, not cacheable across positions;
* ``"self"`` — a token of a plus span attends only to the earlier tokens of its own span
  (``SpanOptions(attend="self")``).

Tokens of ``generated`` spans (nested outputs) attend only to their own span in both span modes.
A *plus group* is a run of consecutive ``plus``/``generated`` spans with no ordered span between
them.

**Link tokens** (EPIC's "LegoLink"): with ``link_tokens=k > 0`` on top of ``prefix`` or
``self``, the first ``k`` tokens of every span of a plus group (``plus`` and ``generated``) are
*recomputed in context*. Two versions of each such link token then exist:

* its *original* KV, computed with its span in the span's mode: the span's own later tokens were
  computed against it (they keep the KV they had when the span was cached);
* its *recomputed* KV, which attends to everything before it in the token form *as cached* —
  the prefix, the earlier spans with the KV of their own mode (their link tokens included, in
  their original version: the link requests of one plus are independent of each other) and its
  own span's earlier recomputed link tokens; every later reader outside its span (the ordered
  tail, generated tokens) sees this version.

One forward pass computes both exactly: the ``m`` link tokens are appended to the token form a
second time (*copies*) with the same position ids, and a 4-D additive mask routes reads:

* a token-form row ``i`` reads the token-form columns its mode allows, except that a read of a
  link token of *another* span is redirected from the original column to that token's copy;
* a copy row (link token at position ``p``) reads every token-form column before ``p``
  except its own span's link tokens, and its own span's copies whose position is ``<= p``
  (itself included).

The prompt's first-token logits are those of its last token-form row (index ``n - 1``), not of
the last row of the extended sequence. Logits are computed for every row, as a plain forward
does: the output head applied to one row alone rounds differently (by ~4e-5 nat in float32), and
the reference should be bitwise a plain forward under the same mask.

Generation then attends to every prompt entry in the KV cache except the stale originals of link
tokens (their copies stand in for them), and to the earlier generated tokens — what an engine
does when it serves cached spans with their first tokens recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from span_workflows.compiler.compile import Span, TokenizedQuery

Attention = Literal["full", "prefix", "prefix-final", "self"]
ATTENTION_CHOICES: tuple[str, ...] = ("full", "prefix", "prefix-final", "self")
_GROUP_KINDS = ("plus", "generated")


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The extended sequence one forward pass runs, and who reads whom.

    ``source[e]`` is the token-form index whose token entry ``e`` of the sequence holds (the
    first ``num_tokens`` entries are the token form itself, the rest copies of link tokens);
    ``position_ids[e]`` its RoPE position (``source[e]``); ``allowed[q, k]`` whether entry ``q``
    reads entry ``k``; ``decode_visible[k]`` whether a generated token reads prompt entry ``k``.
    """

    num_tokens: int
    link_positions: tuple[int, ...]
    source: torch.Tensor
    allowed: torch.Tensor
    decode_visible: torch.Tensor

    @property
    def position_ids(self) -> torch.Tensor:
        """RoPE positions of the sequence's entries: each one's index in the token form."""
        return self.source

    @property
    def length(self) -> int:
        """Entries of the extended sequence (token form plus link copies)."""
        return int(self.source.numel())


@dataclass(frozen=True, eq=False)
class ReferenceOutput:
    """Greedy output of one query under one attention mode.

    ``first_logprobs`` is the log-softmax (float64, whole vocabulary) of the first generated
    token's distribution; ``top_logprobs`` its ``top_logprobs`` most likely tokens (empty unless
    asked for); ``token_ids`` the generated tokens, a final stop token included, and
    ``token_logprobs`` the log-probability of each when it was chosen; ``text`` their decoding
    without special tokens; ``finish_reason`` ``"stop"`` (a stop token) or ``"length"``
    (``max_tokens`` reached); ``plan`` the masks the prompt ran with.
    """

    text: str
    token_ids: tuple[int, ...]
    first_logprobs: torch.Tensor
    token_logprobs: tuple[float, ...] = ()
    top_logprobs: dict[int, float] = field(default_factory=dict)
    finish_reason: Literal["stop", "length"] = "length"
    plan: AttentionPlan | None = None


def plus_groups(spans: Sequence[Span]) -> list[int]:
    """For each span, the index of the first span of its plus group (``-1`` for ordered spans).

    Consecutive ``plus``/``generated`` spans with no ``prefix``/``cross`` span between them form
    one group."""
    starts: list[int] = []
    for i, span in enumerate(spans):
        if span.kind not in _GROUP_KINDS:
            starts.append(-1)
        elif i > 0 and starts[i - 1] >= 0:
            starts.append(starts[i - 1])
        else:
            starts.append(i)
    return starts


def _check_spans(spans: Sequence[Span], num_tokens: int) -> None:
    at = 0
    for span in spans:
        if span.offset != at or span.length < 0:
            raise ValueError(f"spans must tile the token form: span at {span.offset}, expected "
                             f"{at}")
        at += span.length
    if at != num_tokens:
        raise ValueError(f"spans cover {at} tokens, the token form has {num_tokens}")


def base_allowed(spans: Sequence[Span], attention: Attention) -> torch.Tensor:
    """``[n, n]`` bool: which token-form tokens each token's KV attends to in ``attention``
    (causal; no link tokens)."""
    n = sum(s.length for s in spans)
    idx = torch.arange(n)
    allowed = idx[None, :] <= idx[:, None]
    if attention == "full":
        return allowed
    firsts = plus_groups(spans)
    for span, first in zip(spans, firsts, strict=True):
        if first < 0:
            continue
        rows = slice(span.offset, span.offset + span.length)
        own = (idx >= span.offset) & (idx < span.offset + span.length)
        context = idx < spans[first].offset
        if attention == "self" or span.kind == "generated":
            allowed[rows] &= own[None, :]
        elif attention == "prefix":
            raise ValueError("attention='prefix' is built stage by stage, not with a mask; "
                             "the mask of the same pattern at the final positions is "
                             "'prefix-final'")
        else:
            allowed[rows] &= (own | context)[None, :]
    return allowed


def link_positions(spans: Sequence[Span], link_tokens: int) -> list[int]:
    """Token-form positions of the first ``link_tokens`` tokens of every span of a plus group
    (a shorter span contributes all its tokens), in increasing order."""
    out: list[int] = []
    for span in spans:
        if span.kind in _GROUP_KINDS:
            out.extend(range(span.offset, span.offset + min(link_tokens, span.length)))
    return out


def build_plan(spans: Sequence[Span], attention: Attention, link_tokens: int = 0) -> AttentionPlan:
    """The extended sequence and its masks for ``spans`` under ``attention`` with
    ``link_tokens`` recomputed tokens per span (see the module docstring)."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, not "
                         f"{attention!r}")
    if link_tokens < 0:
        raise ValueError(f"link_tokens must be >= 0, not {link_tokens}")
    if link_tokens and attention == "full":
        raise ValueError("link_tokens recompute span tokens in context; with attention='full' "
                         "every token already is")
    n = sum(s.length for s in spans)
    base = base_allowed(spans, attention)
    links = torch.tensor(link_positions(spans, link_tokens), dtype=torch.long)
    m = int(links.numel())
    span_id = torch.repeat_interleave(torch.arange(len(spans)),
                                      torch.tensor([s.length for s in spans], dtype=torch.long))
    is_link = torch.zeros(n, dtype=torch.bool)
    is_link[links] = True
    same_span = span_id[:, None] == span_id[None, :]
    redirected = base & is_link[None, :] & ~same_span  # reads of another span's link token
    allowed = torch.zeros(n + m, n + m, dtype=torch.bool)
    allowed[:n, :n] = base & ~redirected
    allowed[:n, n:] = redirected[:, links]
    idx = torch.arange(n)
    copy_span = span_id[links]
    own_link = is_link[None, :] & (span_id[None, :] == copy_span[:, None])
    allowed[n:, :n] = (idx[None, :] < links[:, None]) & ~own_link
    allowed[n:, n:] = (links[None, :] <= links[:, None]) & (copy_span[None, :]
                                                            == copy_span[:, None])
    visible = torch.ones(n + m, dtype=torch.bool)
    visible[links] = False
    return AttentionPlan(n, tuple(links.tolist()), torch.cat([idx, links]), allowed, visible)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[1, 1, q, k]`` additive mask: 0 where ``allowed``, the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


class AttentionReference:
    """The model of ``model_dir`` (default: :func:`~span_workflows.compiler.model.resolve_model`) on
    the CPU in ``dtype`` (float32 by default), answering token forms under any span attention
    mode.

    Loads the model and tokenizer once; :meth:`generate` is deterministic (greedy)."""

    def __init__(self, model_dir: str | Path | None = None, *,
                 dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from span_workflows.compiler.model import resolve_model

        path = Path(model_dir) if model_dir is not None else resolve_model(progress=False)
        self.model_dir = path
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path))
        self.model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        self.dtype = dtype
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> frozenset[int]:
        """The tokenizer's EOS, ``<|im_end|>`` if the vocabulary has it, and the generation
        config's EOS ids."""
        ids: set[Any] = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if im_end != self.tokenizer.unk_token_id:  # unknown tokens convert to UNK
            ids.add(im_end)
        configured = self.model.generation_config.eos_token_id
        ids.update(configured if isinstance(configured, list) else [configured])
        return frozenset(i for i in ids if isinstance(i, int))

    def plan(self, tq: TokenizedQuery, attention: Attention, link_tokens: int = 0
             ) -> AttentionPlan:
        """The :class:`AttentionPlan` of ``tq`` (checks that its spans tile its tokens)."""
        _check_spans(tq.spans, len(tq.token_ids))
        return build_plan(tq.spans, attention, link_tokens)

    @torch.no_grad()
    def generate(self, tq: TokenizedQuery, attention: Attention, *, max_tokens: int,
                 link_tokens: int = 0, top_logprobs: int | None = None) -> ReferenceOutput:
        """Greedy answer of ``tq`` under ``attention`` with ``link_tokens`` recomputed tokens
        per span: one masked prompt pass, then at most ``max_tokens`` tokens (``0``: the first
        token's log-probabilities only), stopping after a stop token (EOS, ``<|im_end|>``)."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, not {max_tokens}")
        if attention == "prefix":
            return self._generate_staged(tq, max_tokens, link_tokens, top_logprobs)
        plan = self.plan(tq, attention, link_tokens)
        ids = torch.tensor(tq.token_ids, dtype=torch.long)[plan.source][None]
        out = self.model(
            input_ids=ids, attention_mask=additive_mask(plan.allowed, self.dtype),
            position_ids=plan.position_ids[None], use_cache=True,
        )
        first = torch.log_softmax(out.logits[0, plan.num_tokens - 1].double(), dim=-1)
        tokens, logprobs, reason = self._decode(plan, out.past_key_values, first, max_tokens)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return ReferenceOutput(text, tuple(tokens), first, tuple(logprobs),
                               _top(first, top_logprobs), reason, plan)

    def _decode(self, plan: AttentionPlan, cache: Any, first: torch.Tensor, max_tokens: int
                ) -> tuple[list[int], list[float], Literal["stop", "length"]]:
        """Greedy tokens after the prompt and their log-probabilities; each token reads the
        visible prompt entries of ``cache`` and the earlier generated tokens."""
        tokens: list[int] = []
        chosen: list[float] = []
        visible = plan.decode_visible
        logprobs = first
        while len(tokens) < max_tokens:
            token = int(torch.argmax(logprobs))
            tokens.append(token)
            chosen.append(float(logprobs[token]))
            if token in self.stop_ids:
                return tokens, chosen, "stop"
            if len(tokens) == max_tokens:
                break
            visible = torch.cat([visible, torch.ones(1, dtype=torch.bool)])
            out = self.model(
                input_ids=torch.tensor([[token]]),
                attention_mask=additive_mask(visible[None], self.dtype),
                position_ids=torch.tensor([[plan.num_tokens + len(tokens) - 1]]),
                past_key_values=cache, use_cache=True,
            )
            cache = out.past_key_values
            logprobs = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
        return tokens, chosen, "length"


    def _generate_staged(self, tq: TokenizedQuery, max_tokens: int, link_tokens: int,
                         top_logprobs: int | None) -> ReferenceOutput:
        """``attention="prefix"`` built as the engine builds it (see the module docstring);
        with ``link_tokens``, the first tokens of each span are then recomputed at their final
        positions after everything before them."""
        if link_tokens < 0:
            raise ValueError(f"link_tokens must be >= 0, not {link_tokens}")
        _check_spans(tq.spans, len(tq.token_ids))
        kv = _SplicedCache(self.model, len(tq.token_ids))
        firsts = plus_groups(tq.spans)
        logits = torch.empty(0)
        pending: list[tuple[list[int], list[int]]] = []  # link tokens of the current plus
        for i, span in enumerate(tq.spans):
            final = list(range(span.offset, span.offset + span.length))
            ids = tq.token_ids[span.offset: span.offset + span.length]
            if firsts[i] < 0:  # ordered: after everything before it, where it sits
                kv.splice(pending)
                pending = []
                logits = kv.compute(ids, final, list(range(span.offset)), final)
                continue
            start = tq.spans[firsts[i]].offset if span.kind == "plus" else 0
            computed_at = list(range(start, start + span.length))
            kv.compute(ids, computed_at, list(range(start)), final,
                       rotate_by=span.offset - start)
            link = final[:link_tokens]
            if link:
                # after the context and the earlier spans as cached; spliced in at the end of
                # the plus, so no later link of the plus reads it
                pending.append((ids[: len(link)], link))
        first = torch.log_softmax(logits.double(), dim=-1)
        tokens: list[int] = []
        chosen: list[float] = []
        logprobs = first
        reason: Literal["stop", "length"] = "length"
        while len(tokens) < max_tokens:
            token = int(torch.argmax(logprobs))
            tokens.append(token)
            chosen.append(float(logprobs[token]))
            if token in self.stop_ids:
                reason = "stop"
                break
            if len(tokens) == max_tokens:
                break
            position = kv.length
            kv.grow()
            step = kv.compute([token], [position], list(range(position)), [position])
            logprobs = torch.log_softmax(step.double(), dim=-1)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return ReferenceOutput(text, tuple(tokens), first, tuple(chosen),
                               _top(first, top_logprobs), reason, None)


class _SplicedCache:
    """Per-layer K/V of a token form, filled span by span by separate forwards."""

    def __init__(self, model: Any, length: int) -> None:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (1, cfg.num_key_value_heads, length, head_dim)
        self.model = model
        self.keys = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def grow(self) -> None:
        """Room for one more token at the end."""
        self.keys = [torch.cat([k, torch.zeros_like(k[:, :, :1])], dim=2) for k in self.keys]
        self.values = [torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=2)
                       for v in self.values]

    @torch.no_grad()
    def compute(self, token_ids: Sequence[int], positions: list[int], context: list[int],
                store_at: list[int], rotate_by: int = 0) -> torch.Tensor:
        """Run ``token_ids`` at RoPE ``positions`` causally after the cached KV at ``context``;
        store their KV at ``store_at`` (keys rotated by ``rotate_by`` positions); return the
        last token's logits."""
        logits, keys, values = self._forward(token_ids, positions, context, rotate_by)
        self._store(store_at, keys, values)
        return logits

    def splice(self, links: list[tuple[list[int], list[int]]]) -> None:
        """Recompute link tokens (``(token_ids, positions)`` each, at their positions after
        everything before them as it is now), then store them all: none reads another."""
        computed = [(positions, *self._forward(ids, positions, list(range(positions[0])))[1:])
                    for ids, positions in links]
        for positions, keys, values in computed:
            self._store(positions, keys, values)

    def _forward(self, token_ids: Sequence[int], positions: list[int], context: list[int],
                 rotate_by: int = 0) -> tuple[torch.Tensor, list[torch.Tensor],
                                              list[torch.Tensor]]:
        from transformers import DynamicCache

        past = None
        if context:
            at = torch.tensor(context)
            past = DynamicCache(ddp_cache_data=[
                (k[:, :, at], v[:, :, at]) for k, v in zip(self.keys, self.values, strict=True)])
        out = self.model(input_ids=torch.tensor([list(token_ids)]),
                         position_ids=torch.tensor([positions]), past_key_values=past,
                         use_cache=True)
        q = len(positions)
        keys, values = [], []
        for cached in out.past_key_values.layers:
            k = cached.keys[:, :, -q:]
            keys.append(self._rotate(k, rotate_by) if rotate_by else k)
            values.append(cached.values[:, :, -q:])
        return out.logits[0, -1], keys, values

    def _store(self, store_at: list[int], keys: list[torch.Tensor],
               values: list[torch.Tensor]) -> None:
        where = torch.tensor(store_at)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][:, :, where] = k
            self.values[layer][:, :, where] = v

    def _rotate(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys moved by ``delta`` positions with the model's own rotary embedding (angles
        are linear in position, so one more rotation by ``delta``)."""
        from transformers.models.llama.modeling_llama import rotate_half

        cos, sin = self.model.model.rotary_emb(keys, torch.tensor([[delta]]))
        cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
        return keys * cos + rotate_half(keys) * sin


def _top(logprobs: torch.Tensor, k: int | None) -> dict[int, float]:
    if not k:
        return {}
    values, indices = torch.topk(logprobs, k)
    return {int(i): float(v) for i, v in zip(indices, values, strict=True)}


__all__ = ["ATTENTION_CHOICES", "Attention", "AttentionPlan", "AttentionReference",
           "ReferenceOutput", "additive_mask", "base_allowed", "build_plan", "link_positions",
           "plus_groups"]
