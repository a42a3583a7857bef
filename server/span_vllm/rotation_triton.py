"""Fused Triton kernel: rotate the keys of moved blocks in place, every layer in one launch.

Works on vLLM 0.32's paged GPU layout (:class:`span_vllm.rotation.PagedKeyLayout`): each layer
is a 4-D view ``[num_blocks * r, heads, kernel_block_size, 2 * head_size]`` with arbitrary
strides, K being ``[..., :head_size]``; manager block ``b`` is kernel blocks ``b*r .. b*r+r-1``.
All layers must share shape, strides and dtype (vLLM's views of one allocation do); they are
addressed as element offsets from the first layer's tensor, so no buffer is gathered: each
program reads a tile of rotary pairs, rotates it in float32 and writes it back where it was.
fp8 caches (``uint8`` bytes) are decoded with the layer's scale and re-encoded (saturating).

Imports torch and Triton only. :func:`available` says whether it can run here (CUDA, or
Triton's interpreter with ``TRITON_INTERPRET=1``, which the CPU tests use).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

#: Token rows of one tile (rows of a block are processed in a loop of this size).
TILE_TOKENS = 32


def available() -> bool:
    """Whether the fused kernel can run on CUDA tensors in this process."""
    return HAS_TRITON and torch.cuda.is_available()


if HAS_TRITON:

    @triton.jit
    def _rotate_keys_kernel(
        cache_ptr,  # first layer's cache (element pointer)
        layer_offsets_ptr,  # int64 [L]: element offset of each layer from cache_ptr
        block_ids_ptr,  # int64 [n]: manager block ids
        cos_ptr,  # float32 [n, HALF]
        sin_ptr,  # float32 [n, HALF]
        scales_ptr,  # float32 [L] (fp8 only)
        stride_block,  # element strides of one layer's 4-D view
        stride_head,
        stride_token,
        stride_dim,
        R: tl.constexpr,  # kernel blocks per manager block
        NK: tl.constexpr,  # tokens per kernel block
        HALF: tl.constexpr,  # rotary_dim // 2
        NEOX: tl.constexpr,
        FP8: tl.constexpr,
        FP8_TYPE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        move = tl.program_id(0)
        layer = tl.program_id(1)
        head = tl.program_id(2)
        block = tl.load(block_ids_ptr + move)
        layer_offset = tl.load(layer_offsets_ptr + layer)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HALF
        cos = tl.load(cos_ptr + move * HALF + d, mask=d_mask, other=1.0)[None, :]
        sin = tl.load(sin_ptr + move * HALF + d, mask=d_mask, other=0.0)[None, :]
        if NEOX:
            first_dim = d
            second_dim = d + HALF
        else:
            first_dim = 2 * d
            second_dim = 2 * d + 1
        if FP8:
            scale = tl.load(scales_ptr + layer)
        base = layer_offset + head.to(tl.int64) * stride_head
        for t0 in range(0, R * NK, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            t_mask = t < R * NK
            kernel_block = block * R + t // NK
            row = base + kernel_block * stride_block + (t % NK).to(tl.int64) * stride_token
            first = cache_ptr + row[:, None] + (first_dim * stride_dim)[None, :]
            second = cache_ptr + row[:, None] + (second_dim * stride_dim)[None, :]
            mask = t_mask[:, None] & d_mask[None, :]
            x1 = tl.load(first, mask=mask, other=0)
            x2 = tl.load(second, mask=mask, other=0)
            if FP8:
                x1 = x1.to(FP8_TYPE, bitcast=True).to(tl.float32) * scale
                x2 = x2.to(FP8_TYPE, bitcast=True).to(tl.float32) * scale
            else:
                x1 = x1.to(tl.float32)
                x2 = x2.to(tl.float32)
            y1 = x1 * cos - x2 * sin
            y2 = x2 * cos + x1 * sin
            if FP8:
                y1 = tl.minimum(tl.maximum(y1 / scale, -FP8_MAX), FP8_MAX)
                y2 = tl.minimum(tl.maximum(y2 / scale, -FP8_MAX), FP8_MAX)
                y1 = y1.to(FP8_TYPE).to(tl.uint8, bitcast=True)
                y2 = y2.to(FP8_TYPE).to(tl.uint8, bitcast=True)
            tl.store(first, y1.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(second, y2.to(cache_ptr.dtype.element_ty), mask=mask)


def _fp8_type(fp8_dtype: torch.dtype | None) -> Any:
    if fp8_dtype is None:
        return tl.float32  # unused
    if fp8_dtype == torch.float8_e4m3fn:
        return tl.float8e4nv
    if fp8_dtype == torch.float8_e5m2:
        return tl.float8e5
    raise TypeError(f"fp8 format {fp8_dtype} is not supported by the fused kernel")


def layer_offsets(caches: Sequence[torch.Tensor]) -> list[int] | None:
    """Element offsets of each cache from the first one, or ``None`` if they cannot be
    addressed from one pointer (different shape, strides or dtype, or misaligned)."""
    first = caches[0]
    size = first.element_size()
    offsets = []
    for cache in caches:
        if (cache.shape != first.shape or cache.stride() != first.stride()
                or cache.dtype != first.dtype or cache.device != first.device):
            return None
        delta = cache.data_ptr() - first.data_ptr()
        if delta % size:
            return None
        offsets.append(delta // size)
    return offsets


def rotate_paged_keys(
    caches: Sequence[torch.Tensor],
    layout: Any,
    block_ids: Sequence[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary_dim: int,
    neox_style: bool,
    scales: torch.Tensor | None = None,
    fp8_dtype: torch.dtype | None = None,
) -> None:
    """Rotate the keys of manager blocks ``block_ids`` in every cache, in place.

    ``layout`` is a :class:`~span_vllm.rotation.PagedKeyLayout` (``head_size``,
    ``num_blocks``); ``cos``/``sin`` float32 ``[n, rotary_dim // 2]`` on the caches' device;
    ``scales`` float32 ``[len(caches)]`` and ``fp8_dtype`` for fp8 caches."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    offsets = layer_offsets(caches)
    if offsets is None:  # layers not addressable from one pointer: one launch per layer
        for index, cache in enumerate(caches):
            rotate_paged_keys(
                [cache], layout, block_ids, cos, sin, rotary_dim=rotary_dim,
                neox_style=neox_style, fp8_dtype=fp8_dtype,
                scales=None if scales is None else scales[index:index + 1],
            )
        return
    first = caches[0]
    if first.dim() != 4 or first.shape[0] % layout.num_blocks:
        raise ValueError(f"not a paged KV cache view: {tuple(first.shape)}")
    if rotary_dim > layout.head_size or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} does not fit head size {layout.head_size}")
    device = first.device
    r = first.shape[0] // layout.num_blocks
    heads, kernel_tokens = first.shape[1], first.shape[2]
    half = rotary_dim // 2
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    offsets_t = torch.tensor(offsets, dtype=torch.int64, device=device)
    fp8 = fp8_dtype is not None
    if fp8 and scales is None:
        raise ValueError("fp8 keys need their scales")
    scales_t = (scales.to(device, torch.float32).contiguous() if fp8
                else torch.ones(1, dtype=torch.float32, device=device))
    grid = (len(ids), len(caches), heads)
    _rotate_keys_kernel[grid](
        first, offsets_t, ids, cos.contiguous(), sin.contiguous(), scales_t,
        first.stride(0), first.stride(1), first.stride(2), first.stride(3),
        R=r, NK=kernel_tokens, HALF=half, NEOX=bool(neox_style), FP8=fp8,
        FP8_TYPE=_fp8_type(fp8_dtype),
        FP8_MAX=float(torch.finfo(fp8_dtype).max) if fp8 else 1.0,
        BLOCK_T=min(TILE_TOKENS, triton.next_power_of_2(r * kernel_tokens)),
        BLOCK_D=triton.next_power_of_2(half),
    )
