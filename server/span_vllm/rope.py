"""The model's own RoPE, as the rotator needs it: frequencies, rotated width, pairing.

Rotating a cached key by Δ positions equals recomputing it at the new position only if the
rotation angle of every pair is *linear in the position* (``angle_i(p) = p · θ_i``). vLLM's
rotary modules rotate with ``cos_sin_cache[position]`` (``RotaryEmbedding.forward_*``); the
variants that keep that forward and build the cache as ``m · (cos pθ_i, sin pθ_i)`` — default,
Llama-3 (llama3 scaling), linear, NTK, vLLM's (fixed-base) dynamic NTK, YaRN, partial rotary,
GPT-J pairing — are accepted. Their ``θ_i`` are the float32 frequencies the module itself
computes (``_compute_inv_freq``, captured while it builds its cache); the attention factor
``m`` (YaRN's ``mscale``) multiplies the stored key and is unchanged by a rotation.

:func:`rope_spec` *checks* linearity instead of trusting a class list: it recomputes the
module's float32 cache and compares every row with ``m · (cos pθ, sin pθ)`` (and the module's
buffer with that rotation: rounding-level differences are logged, others refused), so a
variant whose angles depend on anything but the position (per-request long/short factors,
multimodal positions, several scaling factors, frequencies that change with the sequence
length) is refused before the first request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from span_vllm.rotation import RopeRotator

logger = logging.getLogger(__name__)

#: A buffer further than this (relative to the attention factor) from ``m · (cos pθ, sin pθ)``
#: holds another rotation (or no rotation), not the same one rounded differently.
BUFFER_GROSS = 1e-2

#: Positions of the cache checked one by one, then positions spread over the rest.
CHECK_HEAD = 2048
CHECK_SPREAD = 2048


class UnsupportedRopeError(RuntimeError):
    """The model's positional encoding cannot be moved by re-rotating cached keys."""


@dataclass(frozen=True)
class RopeSpec:
    """What the rotator needs from one rotary module."""

    inv_freq: tuple[float, ...]  # θ_i (float32 values, as the module uses them)
    rotary_dim: int
    head_size: int
    neox_style: bool
    kind: str  # the module's class name, for messages

    def rotator(self) -> RopeRotator:
        return RopeRotator(torch.tensor(self.inv_freq, dtype=torch.float64),
                           self.rotary_dim, self.neox_style)

    def same_rotation(self, other: RopeSpec) -> bool:
        """Whether both rotate keys identically (the class name may differ)."""
        return (self.inv_freq, self.rotary_dim, self.neox_style) == (
            other.inv_freq, other.rotary_dim, other.neox_style)


def rope_spec(module: Any) -> RopeSpec:
    """The :class:`RopeSpec` of one vLLM rotary module; raises :class:`UnsupportedRopeError`
    with the reason when re-rotating its keys would not equal recomputing them."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kind = type(module).__name__
    if not isinstance(module, RotaryEmbedding):
        raise UnsupportedRopeError(
            f"RoPE {kind} does not rotate keys by cos_sin_cache[position] (vLLM's "
            "RotaryEmbedding): multimodal (MRoPE), MLA, dual-chunk and long/short-factor "
            "variants place keys by more than their token position"
        )
    for name in ("forward_native", "forward_cuda", "forward_cpu", "forward_static"):
        mine = getattr(type(module), name, None)
        if mine is not None and mine is not getattr(RotaryEmbedding, name, None):
            raise UnsupportedRopeError(
                f"RoPE {kind} rotates with its own {name} (e.g. multimodal or per-request "
                "positions): a cached key cannot be moved by a position delta"
            )
    factors = getattr(module, "scaling_factors", None)
    if factors is not None and len(factors) != 1:
        raise UnsupportedRopeError(
            f"RoPE {kind} keeps one cos/sin cache per scaling factor ({factors}); the factor "
            "used depends on the request"
        )
    rotary_dim, head_size = int(module.rotary_dim), int(module.head_size)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise UnsupportedRopeError(f"RoPE {kind}: rotary_dim {rotary_dim} / head {head_size}")
    inv_freq, reference = _captured_frequencies(module)
    position_scale = 1.0 / float(factors[0]) if factors is not None else 1.0
    theta = inv_freq.to(torch.float64) * position_scale
    _check_linear(module, kind, theta, reference)
    return RopeSpec(tuple(theta.tolist()), rotary_dim, head_size, bool(module.is_neox_style),
                    kind)


def _captured_frequencies(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The frequencies the module computes while it builds its cache, and that cache
    (float32, ``[positions, rotary_dim]``)."""
    captured: list[torch.Tensor] = []
    original = module._compute_inv_freq

    def capture(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        captured.append(out.detach().to("cpu", torch.float32))
        return out

    buffer = getattr(module, "cos_sin_cache", None)
    device = buffer.device if isinstance(buffer, torch.Tensor) else torch.device("cpu")
    module._compute_inv_freq = capture
    try:
        with device:  # as when the model was built: same kernels, same float32 values
            reference = module._compute_cos_sin_cache()
    finally:
        del module._compute_inv_freq  # back to the class's method
    if len(captured) != 1:
        raise UnsupportedRopeError(
            f"RoPE {type(module).__name__} builds its cache from {len(captured)} frequency "
            "sets; cannot tell which one a position uses"
        )
    half = int(module.rotary_dim) // 2
    inv_freq = captured[0].reshape(-1)
    if inv_freq.numel() != half:
        raise UnsupportedRopeError(
            f"RoPE {type(module).__name__}: {inv_freq.numel()} frequencies for "
            f"rotary_dim {module.rotary_dim}"
        )
    return inv_freq, reference.detach().to("cpu", torch.float32)


def _check_linear(module: Any, kind: str, theta: torch.Tensor, reference: torch.Tensor) -> None:
    """Rows ``p`` of the float32 cache are ``m · (cos pθ, sin pθ)`` up to float32 rounding of
    the angle, and the module's buffer holds them (in its dtype). Checked on every position
    below :data:`CHECK_HEAD` and :data:`CHECK_SPREAD` positions spread over the rest."""
    half = theta.numel()
    if reference.dim() != 2 or reference.shape[1] != 2 * half:
        raise UnsupportedRopeError(f"RoPE {kind}: cos/sin cache of shape "
                                   f"{tuple(reference.shape)}")
    total = reference.shape[0]
    rows = torch.unique(torch.cat((
        torch.arange(min(total, CHECK_HEAD)),
        torch.linspace(0, total - 1, CHECK_SPREAD).round().long(),
    )))
    m = float(reference[0, :half].double().mean())
    angles = rows.double()[:, None] * theta[None, :]
    expected = torch.cat((torch.cos(angles), torch.sin(angles)), dim=1) * m
    # float32 rounds the angle p·θ (relative 2^-24) and cos/sin themselves.
    tolerance = (angles.abs() * 2.0 ** -22 + 2.0 ** -20).repeat(1, 2) * abs(m) + 1e-6
    bad = (reference[rows].double() - expected).abs() > tolerance
    if bool(bad.any()):
        row = int(rows[bad.any(dim=1)][0])
        raise UnsupportedRopeError(
            f"RoPE {kind}: the angle at position {row} is not position × frequency, so a "
            "cached key cannot be moved by re-rotating it"
        )
    buffer = getattr(module, "cos_sin_cache", None)
    if buffer is None:
        return
    if tuple(buffer.shape) != tuple(reference.shape):
        raise UnsupportedRopeError(f"RoPE {kind}: its cos_sin_cache has another shape than "
                                   "the cache it computes")
    stored = buffer.detach()[rows.to(buffer.device)].to("cpu", torch.float64)
    excess = ((stored - expected).abs() - tolerance) / abs(m)
    worst = float(excess.max())
    if worst <= 2 * torch.finfo(buffer.dtype).eps:
        return
    if worst > BUFFER_GROSS:
        row = int(rows[(excess > BUFFER_GROSS).any(dim=1)][0])
        raise UnsupportedRopeError(
            f"RoPE {kind}: its cos_sin_cache buffer ({buffer.dtype}) is not the rotation it "
            f"computes (off by {worst:.3g} at position {row})"
        )
    # The buffer was built with other float kernels than this check (another CPU vector
    # width, a reduced-precision math mode): the same rotation, rounded differently.
    logger.warning("RoPE %s: cos_sin_cache (%s) is %.3g off the float32 rotation it computes; "
                   "repositioned keys differ from recomputed ones by as much", kind,
                   buffer.dtype, worst)


def model_rope(model: Any, layer_names: Iterable[str]) -> RopeSpec:
    """The one RoPE every attention layer of ``layer_names`` applies to its keys.

    Each attention layer is matched with the ``rotary_emb`` of the module that owns it
    (``LlamaAttention.attn`` ↔ ``LlamaAttention.rotary_emb``). Raises
    :class:`UnsupportedRopeError` if a layer has no RoPE (NoPE layers, or layers of another
    model such as a draft model), or if layers rotate differently."""
    wanted = set(layer_names)
    found: dict[str, Any] = {}
    for owner in model.modules():
        rope = getattr(owner, "rotary_emb", None)
        for child in owner.children():
            name = getattr(child, "layer_name", None)
            if name in wanted:
                found[name] = rope
    missing = sorted(wanted - {n for n, r in found.items() if r is not None})
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise UnsupportedRopeError(
            f"no RoPE found for attention layer(s) {shown}: span mode re-rotates every "
            "cached key, so every layer must use one RoPE"
        )
    specs: dict[int, RopeSpec] = {}
    for rope in found.values():
        if id(rope) not in specs:
            specs[id(rope)] = rope_spec(rope)
    distinct = list(specs.values())
    for other in distinct[1:]:
        if not distinct[0].same_rotation(other):
            raise UnsupportedRopeError(
                f"attention layers use different RoPE ({distinct[0].kind} vs {other.kind}, "
                "or other frequencies): per-layer RoPE is not supported"
            )
    return distinct[0]
