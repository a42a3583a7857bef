"""Worker side of KV repositioning: re-rotate cached keys by a position delta (RoPE).

Keys are stored after RoPE: ``k_p = R(p·θ) k``. Because rotations compose,
``R(Δ·θ) k_p = k_{p+Δ}`` — moving a block by Δ positions is one more rotation of its keys, with
angles computed in float64 from the model's own frequencies ``θ``. Values do not depend on
position and are left alone. Every token of a block moves by the same Δ, so the order of the
tokens inside a block (and how a block is split into kernel blocks) does not matter: only which
elements are keys, and along which axis the head dimension runs.

All moves of a step are applied together. On CUDA with Triton, one fused kernel rotates every
moved block of every layer in place (:mod:`span_vllm.rotation_triton`); elsewhere the moved keys
of a group of layers are gathered into one bounded buffer (:data:`BUFFER_BYTES`), rotated there
along the layout's head-dimension axis and written back. Both compute in float32 (float64 for a
float64 cache) and store in the cache's dtype. fp8 caches (``uint8`` storage, one scale per
layer: ``stored = fp8(k / scale)``) are dequantized, rotated and requantized.

This module imports nothing but torch (and Triton, lazily, on CUDA), so it also runs where vLLM
is not installed (``tests/gpu/device_check.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

#: Upper bound of the gather buffer of one group of layers (bytes), torch path.
BUFFER_BYTES = 1 << 20

#: Dtypes a cache may hold keys in directly (anything else must be fp8 with scales).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KeyLayout:
    """Where the keys sit in one layer's KV cache tensor."""

    #: Axis of the head dimension in :meth:`keys` (negative, so it also holds with a leading
    #: layer axis).
    head_dim_axis: ClassVar[int] = -1

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """A view of the keys with (manager) blocks on axis 0 (no copy)."""
        raise NotImplementedError

    def to_canonical(self, block_keys: torch.Tensor) -> torch.Tensor:
        """Blocks as returned by ``keys(cache)[ids]`` → ``[n, heads, tokens, head_dim]``."""
        raise NotImplementedError

    def from_canonical(self, keys: torch.Tensor, block_shape: torch.Size) -> torch.Tensor:
        """The inverse of :meth:`to_canonical`; ``block_shape`` is ``keys(cache).shape[1:]``."""
        raise NotImplementedError

    def gather(self, cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Keys of blocks ``ids`` as ``[n, heads, tokens, head_dim]`` (a copy)."""
        return self.to_canonical(self.keys(cache).index_select(0, ids))

    def scatter(self, cache: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor) -> None:
        """Write keys (as returned by :meth:`gather`) back to blocks ``ids``."""
        view = self.keys(cache)
        view.index_copy_(0, ids, self.from_canonical(keys, view.shape[1:]).to(view.dtype))


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

    def from_canonical(self, keys: torch.Tensor, block_shape: torch.Size) -> torch.Tensor:
        return keys.transpose(-1, -2)


@dataclass(frozen=True)
class PagedKeyLayout(KeyLayout):
    """vLLM 0.32's GPU attention backends (FlashAttention, FlashInfer, Triton attention).

    ``allocate_kv_cache`` gives every layer a 4-D view ``[num_blocks * r, heads,
    kernel_block_size, 2 * head_size]`` whose strides follow the resolved ``KVCacheLayout``
    (``LBNHC`` by default, ``LBHNC`` for FlashInfer's HND, ...); the backends read K as
    ``cache[..., :head_size]``. When the backend needs smaller blocks than the KV cache manager,
    each manager block ``b`` is split into ``r`` kernel blocks ``b*r .. b*r + r - 1`` (dim 0
    counts kernel blocks). The rotator is handed manager block ids.
    """

    head_size: int
    num_blocks: int  # manager blocks

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, r, heads, kernel_block_size, head_size]`` (a strided view)."""
        if cache.dim() != 4 or cache.shape[0] % self.num_blocks:
            raise ValueError(
                f"not a vLLM paged KV cache view for {self.num_blocks} blocks: "
                f"{tuple(cache.shape)}"
            )
        return cache.unflatten(0, (self.num_blocks, -1))[..., : self.head_size]

    def to_canonical(self, block_keys: torch.Tensor) -> torch.Tensor:
        return block_keys.transpose(1, 2).flatten(2, 3)

    def from_canonical(self, keys: torch.Tensor, block_shape: torch.Size) -> torch.Tensor:
        r, heads, tokens, dim = block_shape
        return keys.unflatten(2, (r, tokens)).transpose(1, 2)


@dataclass(frozen=True)
class Fp8Keys:
    """Keys stored as fp8 with one scale per layer (vLLM's per-tensor fp8 KV cache):
    ``stored = fp8(k / scale)``, the cache tensor holding the fp8 bytes as ``uint8``.

    ``scales`` is aligned with the caches given to :meth:`RopeRotator.apply`: floats or
    0-d/1-element tensors (read at every move, so scales computed after start-up are honoured).
    """

    fp8_dtype: torch.dtype
    scales: Sequence[float | torch.Tensor]

    def scale_tensor(self, indices: Sequence[int], device: torch.device) -> torch.Tensor:
        """float32 ``[len(indices)]`` scales of the caches at ``indices``."""
        values = [self.scales[i] for i in indices]
        if all(isinstance(v, torch.Tensor) for v in values):
            return torch.stack([v.reshape(()).to(device, torch.float32) for v in values])
        return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)

    @property
    def max_value(self) -> float:
        return float(torch.finfo(self.fp8_dtype).max)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype keys of ``dtype`` are rotated in: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class RopeRotator:
    """Rotates keys by whole-position deltas for one RoPE configuration.

    ``inv_freq`` are the model's own per-pair frequencies (as the model computes its
    cos/sin cache from them: angle of pair ``i`` at position ``p`` is ``p * inv_freq[i]``);
    ``rotary_dim`` ≤ head size is the rotated prefix of each head (partial rotary);
    ``neox_style`` pairs ``i`` with ``i + rotary_dim/2``, otherwise ``2i`` with ``2i+1``.
    """

    inv_freq: torch.Tensor  # float64, [rotary_dim // 2]
    rotary_dim: int
    neox_style: bool = True
    #: "auto": the fused Triton kernel where it can run, else torch; "torch": always torch.
    backend: str = "auto"

    def __post_init__(self) -> None:
        self.inv_freq = self.inv_freq.detach().to("cpu", torch.float64).reshape(-1)
        if self.inv_freq.numel() * 2 != self.rotary_dim:
            raise ValueError(
                f"{self.inv_freq.numel()} frequencies do not fit rotary_dim {self.rotary_dim}"
            )

    @classmethod
    def from_base(cls, base: float, rotary_dim: int, neox_style: bool = True) -> RopeRotator:
        """Default (unscaled) RoPE with frequency ``base``."""
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
        return cls(1.0 / (base ** exponent), rotary_dim, neox_style)

    def cos_sin(self, deltas: torch.Tensor, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` of the angles ``delta · θ_i`` as ``[n, rotary_dim // 2]``,
        computed in float64 and returned in ``dtype``."""
        angles = deltas.to("cpu", torch.float64)[:, None] * self.inv_freq[None, :]
        return (torch.cos(angles).to(device=device, dtype=dtype),
                torch.sin(angles).to(device=device, dtype=dtype))

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

    def copy_rotated(self, cache: torch.Tensor, layout: KeyLayout, sources: torch.Tensor,
                     copies: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Copy whole blocks ``sources`` of one layer's float ``cache`` onto ``copies``, the
        keys of copy ``i`` rotated by the angles of ``cos[i]``/``sin[i]`` (``[n, rotary_dim //
        2]`` in float32 or float64; a zero angle copies exactly): one gather, one rotation in
        the gathered blocks, one scatter. For layouts whose :meth:`KeyLayout.keys` views any
        stack of whole blocks (the CPU layout)."""
        blocks = cache.index_select(0, sources)
        keys = layout.keys(blocks)
        if keys.dtype == cos.dtype:
            self.rotate_in_place(keys, cos, sin, axis=layout.head_dim_axis)
        else:
            exact = keys.to(cos.dtype)
            self.rotate_in_place(exact, cos, sin, axis=layout.head_dim_axis)
            keys.copy_(exact)
        cache.index_copy_(0, copies, blocks)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """``keys``: ``[n, heads, tokens, head_dim]``; ``deltas``: ``[n]`` positions.
        Returns rotated keys (a new tensor, computed in float32 unless keys are float64)."""
        compute = compute_dtype(keys.dtype)
        out = keys.to(compute, copy=True)
        cos, sin = self.cos_sin(deltas, compute, keys.device)
        self.rotate_in_place(out, cos, sin, axis=-1)
        return out.to(keys.dtype)

    def apply(
        self,
        caches: Sequence[torch.Tensor],
        layout: KeyLayout,
        moves: Sequence[tuple[int, int]],
        *,
        fp8: Fp8Keys | None = None,
    ) -> None:
        """Rotate the keys of every ``(block_id, delta)`` in every layer's cache, in place.

        ``delta`` may differ per block (any integer). Layers that share one cache tensor are
        rotated once. Without ``fp8`` every cache must hold float keys; with it, fp8 bytes."""
        if not moves:
            return
        unique: dict[tuple[int, torch.dtype], int] = {}
        for index, cache in enumerate(caches):
            unique.setdefault((cache.data_ptr(), cache.dtype), index)
        indices = list(unique.values())
        chosen = [caches[i] for i in indices]
        _check_dtypes(chosen, fp8)
        ids = [b for b, _ in moves]
        deltas = torch.tensor([d for _, d in moves], dtype=torch.float64)
        if self._use_triton(chosen, layout):
            from span_vllm import rotation_triton

            cos, sin = self.cos_sin(deltas, torch.float32, chosen[0].device)
            rotation_triton.rotate_paged_keys(
                chosen, layout, ids, cos, sin, rotary_dim=self.rotary_dim,
                neox_style=self.neox_style,
                scales=None if fp8 is None else fp8.scale_tensor(indices, chosen[0].device),
                fp8_dtype=None if fp8 is None else fp8.fp8_dtype,
            )
            return
        self._apply_torch(chosen, indices, layout, ids, deltas, fp8)

    def _use_triton(self, caches: Sequence[torch.Tensor], layout: KeyLayout) -> bool:
        if self.backend != "auto" or not isinstance(layout, PagedKeyLayout):
            return False
        if not all(c.is_cuda for c in caches):
            return False
        from span_vllm import rotation_triton

        return rotation_triton.available()

    def _apply_torch(
        self,
        caches: Sequence[torch.Tensor],
        indices: Sequence[int],
        layout: KeyLayout,
        block_ids: Sequence[int],
        deltas: torch.Tensor,
        fp8: Fp8Keys | None,
    ) -> None:
        views = [layout.keys(cache) for cache in caches]
        first = views[0]
        device = first.device
        compute = compute_dtype(first.dtype)
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        cos, sin = self.cos_sin(deltas, compute, device)
        block_shape = tuple(first.shape[1:])
        per_layer = len(block_ids) * first[0].numel() * torch.finfo(compute).bits // 8
        group = max(1, BUFFER_BYTES // max(per_layer, 1))
        for start in range(0, len(views), group):
            chunk = views[start:start + group]
            buffer = torch.empty((len(chunk), len(block_ids), *block_shape), dtype=compute,
                                 device=device)
            for slot, view in zip(buffer, chunk, strict=True):
                if view.dtype == compute:
                    torch.index_select(view, 0, ids, out=slot)
                elif fp8 is not None:
                    slot.copy_(view.index_select(0, ids).view(fp8.fp8_dtype))
                else:
                    slot.copy_(view.index_select(0, ids))
            scale = None
            if fp8 is not None:
                scale = fp8.scale_tensor(indices[start:start + group], device)
                scale = scale.view(-1, *([1] * (buffer.dim() - 1)))
                buffer.mul_(scale)
            self.rotate_in_place(buffer, cos, sin, axis=layout.head_dim_axis, block_axis=1)
            if fp8 is not None:
                buffer.div_(scale).clamp_(-fp8.max_value, fp8.max_value)
            for slot, view in zip(buffer, chunk, strict=True):
                if view.dtype == compute:
                    view.index_copy_(0, ids, slot)
                elif fp8 is not None:
                    view.index_copy_(0, ids, slot.to(fp8.fp8_dtype).view(view.dtype))
                else:
                    view.index_copy_(0, ids, slot.to(view.dtype))


def _check_dtypes(caches: Sequence[torch.Tensor], fp8: Fp8Keys | None) -> None:
    """Refuse to reinterpret bytes: float keys without scales, fp8 bytes with them."""
    for cache in caches:
        if fp8 is None and cache.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"KV cache of dtype {cache.dtype} holds quantized keys: pass their fp8 format"
            )
        if fp8 is not None and cache.element_size() != 1:
            raise TypeError(f"fp8 keys expected in a 1-byte cache, got {cache.dtype}")
