"""The training forward: a Hugging Face causal LM computing exactly what the engine computes.

Fine-tuning a model to answer in span mode as it does in stock mode needs a forward pass that
*is* span mode, differentiable. :func:`span_forward` runs one compiled span query
(:class:`~span_workflows.compiler.compile.TokenizedQuery`) and a target answer through the model the
way the patched vLLM serves it:

* ordered runs (the prefix before a plus, the tail after it) attend to everything before them,
  at their positions in the prompt;
* every span of a plus group is computed in its mode's context — after the group's context
  (``attend="prefix"``: the KV before the group, the span at positions right after it, as its
  prepare request computes it) or alone from position 0 (``"self"``) — all spans of a group in
  one batched forward, each row reading the context and itself only; its keys are then rotated
  (RoPE) to where the span sits in the prompt, as the engine re-rotates cached blocks;
* a span's *link blocks* (``SpanOptions.link_blocks``: its first blocks, recomputed in the
  prompt's context) are computed at their positions after the context and the earlier spans of
  the group as cached (their unlinked KV), and replace the span's cached first blocks for every
  later reader; the span's own later tokens keep the KV they were cached with. All link blocks
  of a group are one forward, as the engine runs them in one step;
* the answer (teacher-forced) attends to all of it.

:func:`stock_forward` is the plain causal forward over the stock chat prompt. Both return the
logits that predict each answer token (row 0: the first token, from the prompt's last
position), so the same loss trains both forms. :func:`span_prompt_cache` is the span-mode
prompt without an answer — the composed cache up to the generation prompt — to generate from
(:mod:`span_workflows.tune.dev_eval`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from span_workflows.compiler.compile import Span, TokenizedQuery

_GROUP_KINDS = ("plus",)


@dataclass
class _KV:
    """Per-layer keys and values of a prompt being composed, as ``[1, H, T, D]`` pieces."""

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    length: int = 0

    @classmethod
    def empty(cls, layers: int) -> _KV:
        return cls([[] for _ in range(layers)], [[] for _ in range(layers)])

    def append(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer].append(k)
            self.values[layer].append(v)
        self.length += int(keys[0].shape[2])

    def cache(self, batch: int = 1) -> Any:
        """The composed KV as a Hugging Face cache (``None`` when empty), ``batch`` rows."""
        from transformers import DynamicCache

        if not self.length:
            return None
        data = []
        for ks, vs in zip(self.keys, self.values, strict=True):
            k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
            data.append((k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)))
        return DynamicCache(ddp_cache_data=data)


def _groups(spans: Sequence[Span]) -> list[tuple[str, list[Span]]]:
    """The spans as runs: ``("ordered", [span])`` or ``("plus", [spans of one group])``."""
    runs: list[tuple[str, list[Span]]] = []
    for span in spans:
        if span.kind == "generated":
            raise ValueError("the training forward handles plus spans of messages; nested "
                             "outputs (generated spans) are not supported")
        if span.kind in _GROUP_KINDS:
            if runs and runs[-1][0] == "plus":
                runs[-1][1].append(span)
            else:
                runs.append(("plus", [span]))
        else:
            runs.append(("ordered", [span]))
    return runs


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _dtype(model: Any) -> torch.dtype:
    return next(model.parameters()).dtype


def _rotate(model: Any, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """``keys`` ([B, H, T, D], after RoPE) moved by ``delta`` positions with the model's own
    rotary embedding (RoPE angles are linear in position: one more rotation by ``delta``)."""
    if not delta:
        return keys
    from transformers.models.llama.modeling_llama import rotate_half

    rotary = _base(model).rotary_emb
    cos, sin = rotary(keys, torch.tensor([[delta]], device=keys.device))
    cos, sin = cos[:, None].to(keys.dtype), sin[:, None].to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def _base(model: Any) -> Any:
    """The decoder (``model.model`` of a causal LM, through a PEFT wrapper too)."""
    inner = model
    while not hasattr(inner, "rotary_emb"):
        inner = inner.model if hasattr(inner, "model") else inner.base_model
    return inner


def _new_kv(out: Any, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The last ``count`` positions' K and V of every layer of a forward's cache."""
    layers = out.past_key_values.layers
    return ([layer.keys[:, :, -count:] for layer in layers],
            [layer.values[:, :, -count:] for layer in layers])


class SpanPromptCache(NamedTuple):
    """A span-mode prompt computed up to its last ordered run (the tail: the question and the
    generation prompt), as :func:`span_prompt_cache` returns it."""

    #: the composed KV of everything before the tail, a Hugging Face ``DynamicCache`` (``None``
    #: when the tail is the whole prompt)
    cache: Any
    #: the tail's token ids, still to be run
    tail_ids: list[int]
    #: their positions, ``[1, len(tail_ids)]`` (right after the cached tokens)
    tail_positions: torch.Tensor


def _compose(model: Any, tq: TokenizedQuery) -> tuple[_KV, list[int], int]:
    """Every run of ``tq`` but the last, composed as the engine computes it; the last run's
    token ids and its offset."""
    runs = _groups(tq.spans)
    if not runs or runs[-1][0] != "ordered":
        raise ValueError("a span-mode prompt ends with an ordered run (the generation prompt)")
    device = next(model.parameters()).device
    layers = model.config.num_hidden_layers
    kv = _KV.empty(layers)
    tokens = tq.token_ids
    options = tq.options
    links = {s[0]: (s[2] if len(s) > 2 else 0) for s in tq.segments}
    for kind, spans in runs[:-1]:
        if kind == "plus":
            _plus_group(model, kv, tokens, spans, options.attend,
                        [links.get(s.offset, 0) for s in spans], tq.block_size, device)
            continue
        span = spans[0]
        ids = list(tokens[span.offset: span.offset + span.length])
        positions = torch.arange(span.offset, span.offset + len(ids), device=device)[None]
        out = _base(model)(input_ids=torch.tensor([ids], device=device),
                           position_ids=positions, past_key_values=kv.cache(), use_cache=True)
        kv.append(*_new_kv(out, len(ids)))
    tail = runs[-1][1][0]
    return kv, list(tokens[tail.offset: tail.offset + tail.length]), tail.offset


def span_forward(model: Any, tq: TokenizedQuery, answer_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(answer_ids), vocab]`` of ``answer_ids`` after the span-mode prompt ``tq``
    (compiled with its :class:`~span_workflows.query.span_options.SpanOptions`), computed as the
    engine
    computes it (see the module docstring). Row ``i`` predicts ``answer_ids[i]``; row 0 is the
    first generated token's distribution. Differentiable in the model's parameters."""
    kv, ids, offset = _compose(model, tq)
    device = next(model.parameters()).device
    ids += list(answer_ids[:-1])
    positions = torch.arange(offset, offset + len(ids), device=device)[None]
    out = model(input_ids=torch.tensor([ids], device=device), position_ids=positions,
                past_key_values=kv.cache(), use_cache=True, logits_to_keep=len(answer_ids))
    return out.logits[0]


def span_prompt_cache(model: Any, tq: TokenizedQuery) -> SpanPromptCache:
    """The span-mode prompt ``tq`` computed as :func:`span_forward` computes it, up to its
    tail: the composed KV cache of every run before the last ordered one, and that run's ids
    and positions. Running ``model(input_ids=tail_ids, position_ids=tail_positions,
    past_key_values=cache, use_cache=True)`` then gives the first generated token's logits
    (the last row) and a cache to decode on from position ``tail_positions[0, -1] + 1`` —
    what the engine's span mode generates from."""
    kv, ids, offset = _compose(model, tq)
    device = next(model.parameters()).device
    positions = torch.arange(offset, offset + len(ids), device=device)[None]
    return SpanPromptCache(kv.cache(), ids, positions)


def _plus_group(model: Any, kv: _KV, tokens: Sequence[int], spans: list[Span], attend: str,
                links: list[int], block_size: int, device: torch.device) -> None:
    """Compute one plus group's spans in their mode's context, rotate them into place, then
    their link blocks (``links[i]`` blocks of span ``i``, as its segment says); append the
    group's final KV to ``kv``. Spans of one length share a batched forward (no padding)."""
    context = kv.length if attend == "prefix" else 0
    span_k: list[list[torch.Tensor]] = [[] for _ in spans]
    span_v: list[list[torch.Tensor]] = [[] for _ in spans]
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        by_length.setdefault(s.length, []).append(i)
    for width, members in by_length.items():
        ids = torch.tensor([list(tokens[spans[i].offset: spans[i].offset + width])
                            for i in members], device=device)
        rows = len(members)
        positions = (context + torch.arange(width, device=device))[None].expand(rows, -1)
        out = _base(model)(input_ids=ids, position_ids=positions,
                           past_key_values=kv.cache(rows) if context else None, use_cache=True)
        new_k, new_v = _new_kv(out, width)
        for r, i in enumerate(members):
            # keys rotated from where the span was computed to where it sits
            delta = spans[i].offset - context
            span_k[i] = [_rotate(model, k[r: r + 1], delta) for k in new_k]
            span_v[i] = [v[r: r + 1] for v in new_v]
    if any(links):
        _links(model, kv, tokens, spans, links, span_k, span_v, block_size, device)
    for keys, values in zip(span_k, span_v, strict=True):
        kv.append(keys, values)


def _links(model: Any, kv: _KV, tokens: Sequence[int], spans: list[Span], links: list[int],
           span_k: list[list[torch.Tensor]], span_v: list[list[torch.Tensor]],
           block_size: int, device: torch.device) -> None:
    """Recompute every span's link blocks in one forward: each reads the context, the earlier
    spans of the group as cached, and its own earlier link tokens; then splice them in."""
    dtype = _dtype(model)
    context = kv.length
    starts = [context]
    for s in spans:
        starts.append(starts[-1] + s.length)
    total = starts[-1]
    ids: list[int] = []
    positions: list[int] = []
    reads: list[torch.Tensor] = []
    owner: list[int] = []
    for i, (s, count) in enumerate(zip(spans, links, strict=True)):
        n = count * block_size
        ids += list(tokens[s.offset: s.offset + n])
        positions += list(range(s.offset, s.offset + n))
        owner += [i] * n
        row = torch.zeros(total, dtype=torch.bool, device=device)
        row[: starts[i]] = True  # the context and the earlier spans, as cached
        reads += [row] * n
    m = len(ids)
    past = torch.stack(reads)
    who = torch.tensor(owner, device=device)
    at = torch.tensor(positions, device=device)
    own = (who[:, None] == who[None, :]) & (at[None, :] <= at[:, None])
    mask = _additive(torch.cat([past, own], dim=1), dtype)[None, None]
    group = _KV.empty(len(span_k[0]))
    group.keys = [list(layer) for layer in kv.keys]
    group.values = [list(layer) for layer in kv.values]
    group.length = kv.length
    for keys, values in zip(span_k, span_v, strict=True):
        group.append(keys, values)
    out = _base(model)(input_ids=torch.tensor([ids], device=device), position_ids=at[None],
                       attention_mask=mask, past_key_values=group.cache(), use_cache=True)
    link_k, link_v = _new_kv(out, m)
    at_row = 0
    for i, count in enumerate(links):
        n = count * block_size
        if n:
            span_k[i] = [torch.cat([lk[:, :, at_row: at_row + n], k[:, :, n:]], dim=2)
                         for lk, k in zip(link_k, span_k[i], strict=True)]
            span_v[i] = [torch.cat([lv[:, :, at_row: at_row + n], v[:, :, n:]], dim=2)
                         for lv, v in zip(link_v, span_v[i], strict=True)]
        at_row += n


def stock_forward(model: Any, prompt_ids: Sequence[int],
                  answer_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(answer_ids), vocab]`` of ``answer_ids`` after a plain prompt (ordinary
    causal attention): row ``i`` predicts ``answer_ids[i]``."""
    device = next(model.parameters()).device
    ids = [*prompt_ids, *answer_ids[:-1]]
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=False,
                logits_to_keep=len(answer_ids))
    return out.logits[0]


__all__ = ["SpanPromptCache", "span_forward", "span_prompt_cache", "stock_forward"]
