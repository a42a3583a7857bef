"""Worker side of KV repositioning: re-rotate cached keys by a position delta (RoPE).

Keys are stored after RoPE: ``k_p = R(p·θ) k``. Because rotations compose,
``R(Δ·θ) k_p = k_{p+Δ}`` — moving a block by Δ positions is one more rotation of its keys, with
angles computed in float64. Values do not depend on position and are left alone.

All moves of a step are applied as one gather → rotate → scatter per layer (vectorized over
blocks), in pure torch. The cache layout is hidden behind a :class:`KeyLayout` adapter: one for
vLLM's CPU attention backend and one for the GPU (FlashAttention-style) layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KeyLayout:
    """Gives a ``[blocks, heads, block_size, head_dim]`` view of the keys of chosen blocks."""

    def gather(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Keys of blocks ``ids`` as ``[n, heads, block_size, head_dim]`` (a copy)."""
        raise NotImplementedError

    def scatter(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Write keys (as returned by :meth:`gather`) back to blocks ``ids``."""
        raise NotImplementedError


@dataclass(frozen=True)
class CpuKeyLayout(KeyLayout):
    """vLLM CPU attention: ``[num_blocks, heads, block_size, 2*head_dim]``, where per block and
    head the first ``block_size*head_dim`` elements are K stored transposed
    (``[head_dim, block_size]``) and the rest is V."""

    head_dim: int

    def _keys(self, cache: torch.Tensor) -> torch.Tensor:
        nb, heads, bs, _ = cache.shape
        return cache.view(nb, heads, 2, self.head_dim * bs)[:, :, 0].view(
            nb, heads, self.head_dim, bs
        )

    def gather(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._keys(cache)[ids].transpose(-1, -2)

    def scatter(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> None:
        view = self._keys(cache)
        view[ids] = keys.transpose(-1, -2).to(view.dtype)


@dataclass(frozen=True)
class GpuKeyLayout(KeyLayout):
    """FlashAttention-style GPU layout: ``[2, num_blocks, block_size, heads, head_dim]``
    (K is index 0)."""

    def gather(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return cache[0][ids].permute(0, 2, 1, 3)

    def scatter(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> None:
        cache[0][ids] = keys.permute(0, 2, 1, 3).to(cache.dtype)


@dataclass
class RopeRotator:
    """Rotates keys by whole-position deltas for one RoPE configuration."""

    inv_freq: torch.Tensor  # float64, [rotary_dim // 2]
    rotary_dim: int
    neox_style: bool = True

    @classmethod
    def from_base(cls, base: float, rotary_dim: int, neox_style: bool = True) -> RopeRotator:
        """Default (unscaled) RoPE with frequency ``base``."""
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        return cls(1.0 / (base ** exponent), rotary_dim, neox_style)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """``keys``: ``[n, heads, block_size, head_dim]``; ``deltas``: ``[n]`` positions."""
        angles = deltas.to(torch.float64)[:, None] * self.inv_freq.to(keys.device)[None, :]
        compute = torch.float32 if keys.dtype != torch.float64 else torch.float64
        cos = torch.cos(angles).to(compute)[:, None, None, :]
        sin = torch.sin(angles).to(compute)[:, None, None, :]
        rot = keys[..., : self.rotary_dim].to(compute)
        if self.neox_style:
            half = self.rotary_dim // 2
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if self.rotary_dim < keys.shape[-1]:
            out = torch.cat((out, keys[..., self.rotary_dim:].to(compute)), dim=-1)
        return out.to(keys.dtype)

    def apply(
        self,
        caches: Sequence[torch.Tensor],
        layout: KeyLayout,
        moves: Sequence[tuple[int, int]],
    ) -> None:
        """Rotate the keys of every ``(block_id, delta)`` in every layer's cache, in place."""
        if not moves:
            return
        seen: set[int] = set()
        device = caches[0].device
        ids = torch.tensor([b for b, _ in moves], dtype=torch.long, device=device)
        deltas = torch.tensor([d for _, d in moves], dtype=torch.float64, device=device)
        for cache in caches:
            if cache.data_ptr() in seen:  # layers that share one cache are rotated once
                continue
            seen.add(cache.data_ptr())
            layout.scatter(cache, ids, self.rotate(layout.gather(cache, ids), deltas))
