"""Worker side of KV repositioning: re-rotate cached keys by a position delta (RoPE).

Keys are stored after RoPE: ``k_p = R(p·θ) k``. Because rotations compose,
``R(Δ·θ) k_p = k_{p+Δ}`` — moving a block by Δ positions is one more rotation of its keys, with
angles computed in float64. Values do not depend on position and are left alone.

All moves of a step are applied together: the moved blocks' keys of a group of layers are
gathered into one buffer (one ``index_select`` per layer), rotated there in place with five
elementwise ops for the whole group, and written back (one ``index_copy_`` per layer). The
rotation works along the head-dimension axis of whatever layout the cache has, so nothing is
transposed; the buffer is bounded (:data:`BUFFER_BYTES`) so it stays in cache-sized chunks.
The cache layout is hidden behind a :class:`KeyLayout` adapter: one for vLLM's CPU attention
backend and one for the GPU (FlashAttention-style) layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

#: Upper bound of the gather buffer of one group of layers (bytes).
BUFFER_BYTES = 1 << 20


class KeyLayout:
    """Where the keys sit in one layer's KV cache tensor."""

    #: Axis of the head dimension in :meth:`keys` (negative, so it also holds with a leading
    #: layer axis).
    head_dim_axis: ClassVar[int] = -1

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """A view of the keys with blocks on axis 0 (no copy)."""
        raise NotImplementedError

    def to_canonical(self, block_keys: torch.Tensor) -> torch.Tensor:
        """Blocks as returned by ``keys(cache)[ids]`` → ``[n, heads, block_size, head_dim]``."""
        raise NotImplementedError

    def from_canonical(self, keys: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_canonical`."""
        raise NotImplementedError

    def gather(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Keys of blocks ``ids`` as ``[n, heads, block_size, head_dim]`` (a copy)."""
        return self.to_canonical(self.keys(cache).index_select(0, ids))

    def scatter(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Write keys (as returned by :meth:`gather`) back to blocks ``ids``."""
        view = self.keys(cache)
        view.index_copy_(0, ids, self.from_canonical(keys).to(view.dtype))


@dataclass(frozen=True)
class CpuKeyLayout(KeyLayout):
    """vLLM CPU attention: ``[num_blocks, heads, block_size, 2*head_dim]``, where per block and
    head the first ``block_size*head_dim`` elements are K stored transposed
    (``[head_dim, block_size]``) and the rest is V."""

    head_dim: int
    head_dim_axis: ClassVar[int] = -2

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        nb, heads, bs, _ = cache.shape
        return cache.view(nb, heads, 2, self.head_dim * bs)[:, :, 0].view(
            nb, heads, self.head_dim, bs
        )

    def to_canonical(self, block_keys: torch.Tensor) -> torch.Tensor:
        return block_keys.transpose(-1, -2)

    def from_canonical(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.transpose(-1, -2)


@dataclass(frozen=True)
class GpuKeyLayout(KeyLayout):
    """FlashAttention-style GPU layout: ``[2, num_blocks, block_size, heads, head_dim]``
    (K is index 0)."""

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        return cache[0]

    def to_canonical(self, block_keys: torch.Tensor) -> torch.Tensor:
        return block_keys.permute(0, 2, 1, 3)

    def from_canonical(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.permute(0, 2, 1, 3)


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

    def cos_sin(self, deltas: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of the angles ``delta · θ_i`` as ``[n, rotary_dim // 2]``,
        computed in float64 and returned in ``dtype``."""
        angles = (deltas.to(device=device, dtype=torch.float64)[:, None]
                  * self.inv_freq.to(device)[None, :])
        return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)

    def rotate_in_place(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        axis: int, block_axis: int = 0) -> None:
        """Rotate ``keys`` in place along its head-dimension ``axis``; ``cos``/``sin`` are
        ``[n, rotary_dim // 2]`` with ``n`` the size of ``block_axis``."""
        axis %= keys.dim()
        half = self.rotary_dim // 2
        shape = [1] * keys.dim()
        shape[block_axis % keys.dim()] = cos.shape[0]
        shape[axis] = half
        cos, sin = cos.view(shape), sin.view(shape)
        if self.neox_style:
            x1, x2 = keys.narrow(axis, 0, half), keys.narrow(axis, half, half)
        else:
            pairs = keys.narrow(axis, 0, self.rotary_dim).unflatten(axis, (half, 2))
            x1, x2 = pairs.select(axis + 1, 0), pairs.select(axis + 1, 1)
        first = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1.0)
        x2.mul_(cos).addcmul_(first, sin)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """``keys``: ``[n, heads, block_size, head_dim]``; ``deltas``: ``[n]`` positions.
        Returns rotated keys (a new tensor, computed in float32 unless keys are float64)."""
        compute = torch.float64 if keys.dtype == torch.float64 else torch.float32
        out = keys.to(compute, copy=True)
        cos, sin = self.cos_sin(deltas, compute, keys.device)
        self.rotate_in_place(out, cos, sin, axis=-1)
        return out.to(keys.dtype)

    def apply(
        self,
        caches: Sequence[torch.Tensor],
        layout: KeyLayout,
        moves: Sequence[tuple[int, int]],
    ) -> None:
        """Rotate the keys of every ``(block_id, delta)`` in every layer's cache, in place.

        Layers that share one cache tensor are rotated once."""
        if not moves:
            return
        unique: dict[int, torch.Tensor] = {}
        for cache in caches:
            unique.setdefault(cache.data_ptr(), cache)
        views = [layout.keys(cache) for cache in unique.values()]
        first = views[0]
        device = first.device
        compute = torch.float64 if first.dtype == torch.float64 else torch.float32
        ids = torch.tensor([b for b, _ in moves], dtype=torch.long, device=device)
        deltas = torch.tensor([d for _, d in moves], dtype=torch.float64)
        cos, sin = self.cos_sin(deltas, compute, device)
        block_shape = tuple(first.shape[1:])
        per_layer = len(moves) * first[0].numel() * torch.finfo(compute).bits // 8
        group = max(1, BUFFER_BYTES // max(per_layer, 1))
        for start in range(0, len(views), group):
            chunk = views[start:start + group]
            buffer = torch.empty((len(chunk), len(moves), *block_shape), dtype=compute,
                                 device=device)
            for slot, view in zip(buffer, chunk, strict=True):
                if view.dtype == compute:
                    torch.index_select(view, 0, ids, out=slot)
                else:
                    slot.copy_(view.index_select(0, ids))
            self.rotate_in_place(buffer, cos, sin, axis=layout.head_dim_axis, block_axis=1)
            for slot, view in zip(buffer, chunk, strict=True):
                view.index_copy_(0, ids, slot if view.dtype == compute else slot.to(view.dtype))
