"""The rotator against the KV caches vLLM 0.32 itself allocates (no engine).

Caches come from vLLM's own ``get_kv_cache_config_from_groups`` + ``allocate_kv_cache``, on CPU
tensors, for each ``KVCacheLayout`` and with manager blocks split into kernel blocks; keys are
written and read the way FlashAttention, FlashInfer and Triton attention address them
(``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` of the bound view, kernel block
``b * r + j`` for manager block ``b``). A move of manager block ``b`` from position ``p`` to
``q`` must leave exactly the keys a model computes at ``q``, and nothing else changed.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

from span_vllm.rotation import PagedKeyLayout, RopeRotator

HEADS, D, BLOCK, LAYERS, BLOCKS = 2, 64, 32, 3, 6


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def _allocate(vllm_config, layout_name: str, kernel_block: int, dtype: torch.dtype):
    """vLLM's allocation for one full-attention group of ``LAYERS`` layers."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=D, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    vllm_config.cache_config.kv_cache_layout = layout_name
    config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(names, spec)], spec.page_size_bytes * BLOCKS * LAYERS)
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout_name],
                               [kernel_block])
    return config, [caches[n] for n in names]


def _key_cache(cache: torch.Tensor) -> torch.Tensor:
    """K as the CUDA backends read it: ``[kernel_blocks, tokens, heads, head_size]``."""
    return cache.transpose(1, 2).split(D, dim=-1)[0]


def _write_block(cache: torch.Tensor, block: int, keys: torch.Tensor) -> None:
    """Store ``keys`` ``[BLOCK, HEADS, D]`` as manager block ``block``'s tokens."""
    kernel = cache.shape[2]
    r = BLOCK // kernel
    k = _key_cache(cache)
    for t in range(BLOCK):
        k[block * r + t // kernel, t % kernel] = keys[t]


def _read_block(cache: torch.Tensor, block: int) -> torch.Tensor:
    kernel = cache.shape[2]
    r = BLOCK // kernel
    k = _key_cache(cache)
    return torch.stack([k[block * r + t // kernel, t % kernel] for t in range(BLOCK)])


def _rope(keys: torch.Tensor, rotator: RopeRotator, start: int) -> torch.Tensor:
    """``keys`` ``[BLOCK, HEADS, D]`` rotated for positions ``start .. start+BLOCK-1``."""
    canon = keys.permute(1, 0, 2)[None].double()
    out = [rotator.rotate(canon[:, :, t:t + 1], torch.tensor([float(start + t)]))
           for t in range(BLOCK)]
    return torch.cat(out, dim=2)[0].permute(1, 0, 2)


LAYOUTS = [("LBNHC", BLOCK), ("LBHNC", BLOCK), ("LBNHC", 16), ("LBHNC", 8), ("LHBNC", BLOCK),
           ("BLNHC", BLOCK), ("BLHNC", BLOCK), ("BHLNC", BLOCK)]


@pytest.mark.parametrize(("layout_name", "kernel_block"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moving_a_block_equals_computing_its_keys_at_the_new_position(
    vllm_config, layout_name: str, kernel_block: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    config, caches = _allocate(vllm_config, layout_name, kernel_block, dtype)
    assert caches[0].shape == (BLOCKS * BLOCK // kernel_block, HEADS, kernel_block, 2 * D)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape))  # every byte: other blocks, V, other layers
    rotator = RopeRotator.from_base(500000.0, D)
    raw = [torch.randn(BLOCK, HEADS, D, dtype=torch.float64) for _ in caches]
    p, q, block = 37, 4133, 4
    for cache, keys in zip(caches, raw, strict=True):
        _write_block(cache, block, _rope(keys, rotator, p).to(dtype))
    before = [c.clone() for c in caches]
    layout = PagedKeyLayout(D, config.num_blocks)
    rotator.apply(caches, layout, [(block, q - p)])
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # bf16: one rounding of the result
    for cache, old, keys in zip(caches, before, raw, strict=True):
        got = _read_block(cache, block).double()
        want = _rope(keys, rotator, q)
        assert (got - want).abs().max() <= tol * want.abs().max() * 2, layout_name
        bits = {4: torch.int32, 2: torch.int16}[cache.element_size()]
        changed = cache.view(bits) != old.view(bits)  # bit-exact, NaN-safe
        kernel_view = changed.unflatten(0, (config.num_blocks, -1))
        assert not kernel_view[..., D:].any()  # values untouched
        kernel_view[block, ..., :D] = False
        assert not kernel_view.any()  # no other block, layer or byte


def test_the_cuda_backends_read_keys_as_the_first_head_size_channels() -> None:
    """The adapter's assumption, read from the installed vLLM source."""
    pattern = re.compile(
        r"kv_cache\.transpose\(1, 2\)\.split\(\s*self\.head_size, dim=-1\s*\)")
    for name in ("flash_attn", "triton_attn", "flashinfer"):  # flashinfer: no import on CPU
        origin = importlib.util.find_spec(f"vllm.v1.attention.backends.{name}").origin
        assert pattern.search(Path(origin).read_text()), name


def test_vllm_views_every_layer_as_blocks_heads_tokens_content() -> None:
    from vllm.v1.worker import utils

    doc = inspect.getdoc(utils.allocate_kv_cache) or ""
    assert "[B, H, N, C]" in doc
    source = inspect.getsource(utils.copy_kv_cache_blocks_inplace)
    # Manager block b owns kernel blocks b*r .. b*r+r-1: vLLM's own block copy folds them so.
    assert "cache.unflatten(0, (num_blocks, kernel_blocks_per_block))" in source


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_keys_are_decoded_rotated_and_reencoded_with_each_layers_scale(
    vllm_config, fp8_dtype: torch.dtype
) -> None:
    """vLLM stores fp8 KV as uint8 bytes ``fp8(k / k_scale)``; a move must equal quantizing the
    keys computed at the new position, up to fp8 rounding — never a rotation of raw bytes."""
    from span_vllm.rotation import Fp8Keys

    torch.manual_seed(5)
    config, caches = _allocate(vllm_config, "LBNHC", 16, torch.uint8)
    assert caches[0].dtype == torch.uint8
    for cache in caches:
        cache.copy_(torch.randint(0, 120, cache.shape, dtype=torch.uint8))
    scales = [0.05, 0.02, torch.tensor(0.1)]  # floats or the layer's _k_scale tensor
    rotator = RopeRotator.from_base(10000.0, D)
    raw = [torch.randn(BLOCK, HEADS, D, dtype=torch.float64) for _ in caches]
    p, q, block = 5, 905, 2

    def encode(keys: torch.Tensor, scale) -> torch.Tensor:
        return (keys / float(scale)).to(torch.float32).to(fp8_dtype).view(torch.uint8)

    def decode(stored: torch.Tensor, scale) -> torch.Tensor:
        return stored.view(fp8_dtype).to(torch.float64) * float(scale)

    for cache, keys, scale in zip(caches, raw, scales, strict=True):
        _write_block(cache, block, encode(_rope(keys, rotator, p), scale))
    before = [c.clone() for c in caches]
    rotator.apply(caches, PagedKeyLayout(D, config.num_blocks), [(block, q - p)],
                  fp8=Fp8Keys(fp8_dtype, scales))
    mantissa = torch.finfo(fp8_dtype).eps
    for cache, old, keys, scale in zip(caches, before, raw, scales, strict=True):
        got = decode(_read_block(cache, block), scale)
        fresh = decode(encode(_rope(keys, rotator, q), scale), scale)
        want = _rope(keys, rotator, q)
        # two fp8 roundings (at p, then after the move) against one for a fresh compute
        assert (got - want).abs().max() <= 2 * mantissa * want.abs().max()
        assert (got - want).abs().mean() <= 3 * (fresh - want).abs().mean()
        kernel = (cache != old).unflatten(0, (config.num_blocks, -1))
        assert not kernel[..., D:].any()
        kernel[block, ..., :D] = False
        assert not kernel.any()
