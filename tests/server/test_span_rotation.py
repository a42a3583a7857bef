"""RoPE re-rotation of cached keys and the CPU/GPU key layouts (no engine)."""

from __future__ import annotations

import pytest
import torch

from span_vllm.rotation import CpuKeyLayout, PagedKeyLayout, RopeRotator

HEADS, BS, D = 3, 32, 64


def _rope_at(rotator: RopeRotator, keys: torch.Tensor, start: int) -> torch.Tensor:
    """Keys of a block whose first token sits at ``start`` (per-token positions)."""
    out = []
    for t in range(keys.shape[2]):
        out.append(rotator.rotate(keys[:, :, t : t + 1], torch.tensor([start + t])))
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("neox", [True, False])
def test_rotating_by_delta_equals_computing_at_the_new_position(neox: bool) -> None:
    torch.manual_seed(0)
    rotator = RopeRotator.from_base(100000.0, D, neox)
    raw = torch.randn(1, HEADS, BS, D, dtype=torch.float32)
    at_0 = _rope_at(rotator, raw, 0)
    at_4000 = _rope_at(rotator, raw, 4000)
    moved = rotator.rotate(at_0, torch.tensor([4000]))
    assert torch.allclose(moved, at_4000, atol=2e-4, rtol=1e-4)
    back = rotator.rotate(moved, torch.tensor([-4000]))
    assert torch.allclose(back, at_0, atol=2e-4)
    assert not torch.allclose(at_0, at_4000, atol=1e-2)


def test_cpu_layout_gathers_and_scatters_only_keys() -> None:
    layout = CpuKeyLayout(D)
    cache = torch.randn(8, HEADS, BS, 2 * D)
    keys = cache.view(8, HEADS, 2, D * BS)[:, :, 0].view(8, HEADS, D, BS).transpose(-1, -2)
    ids = torch.tensor([1, 5])
    got = layout.gather(cache, ids)
    assert torch.equal(got, keys[ids])
    values_before = cache.view(8, HEADS, 2, D * BS)[:, :, 1].clone()
    layout.scatter(cache, ids, torch.zeros_like(got))
    assert torch.count_nonzero(layout.gather(cache, ids)) == 0
    assert torch.equal(cache.view(8, HEADS, 2, D * BS)[:, :, 1], values_before)
    assert torch.count_nonzero(layout.gather(cache, torch.tensor([0]))) > 0


def _paged(num_blocks: int = 8, r: int = 1) -> torch.Tensor:
    """A vLLM 0.32 paged cache view ``[blocks*r, heads, tokens/r, 2*D]`` in LBNHC order
    (physically ``[blocks*r, tokens/r, heads, 2*D]``)."""
    return torch.randn(num_blocks * r, BS // r, HEADS, 2 * D).transpose(1, 2)


@pytest.mark.parametrize("r", [1, 2])
def test_paged_layout_gathers_and_scatters_only_keys(r: int) -> None:
    layout = PagedKeyLayout(D, num_blocks=8)
    cache = _paged(8, r)
    ids = torch.tensor([2, 3])
    got = layout.gather(cache, ids)
    assert got.shape == (2, HEADS, BS, D)
    kernel = cache.unflatten(0, (8, r))  # manager block b = kernel blocks b*r .. b*r+r-1
    expected = kernel[ids][..., :D].transpose(1, 2).flatten(2, 3)
    assert torch.equal(got, expected)
    values = cache[..., D:].clone()
    layout.scatter(cache, ids, got * 2)
    assert torch.allclose(layout.gather(cache, ids), got * 2)
    assert torch.equal(cache[..., D:], values)
    untouched = kernel[4:5][..., :D].transpose(1, 2).flatten(2, 3)
    assert torch.equal(layout.gather(cache, torch.tensor([4])), untouched)


def test_apply_rotates_every_layer_once_per_shared_cache() -> None:
    torch.manual_seed(1)
    rotator = RopeRotator.from_base(10000.0, D)
    layout = PagedKeyLayout(D, num_blocks=4)
    shared, other = _paged(4), _paged(4)
    before_shared, before_other = shared.clone(), other.clone()
    rotator.apply([shared, shared, other], layout, [(1, 7), (3, -2)])
    expected = rotator.rotate(layout.gather(before_shared, torch.tensor([1, 3])),
                              torch.tensor([7.0, -2.0]))
    assert torch.allclose(layout.gather(shared, torch.tensor([1, 3])), expected, atol=1e-6)
    assert torch.equal(shared[0], before_shared[0])
    assert not torch.equal(other, before_other)


@pytest.mark.gpu
def test_gpu_rotation_on_device_matches_cpu() -> None:
    rotator = RopeRotator.from_base(100000.0, D)
    layout = PagedKeyLayout(D, num_blocks=16)
    cache = _paged(16)
    gpu = cache.cuda()
    rotator.apply([cache], layout, [(3, 100), (9, -50)])
    rotator.apply([gpu], layout, [(3, 100), (9, -50)])  # the fused kernel where Triton is
    assert torch.allclose(gpu.cpu(), cache, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("buffer_bytes", [1, 1 << 20])
def test_apply_on_the_cpu_layout_equals_rotating_each_block(
    neox: bool, buffer_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-place rotation along the transposed CPU key layout, one layer per group or all
    layers in one group, matches the reference rotation and leaves values and other blocks."""
    import span_vllm.rotation as rotation

    monkeypatch.setattr(rotation, "BUFFER_BYTES", buffer_bytes)
    torch.manual_seed(2)
    rotator, layout = RopeRotator.from_base(100000.0, D, neox), CpuKeyLayout(D)
    caches = [torch.randn(6, HEADS, BS, 2 * D) for _ in range(3)]
    before = [c.clone() for c in caches]
    moves = [(4, 300), (1, -17), (2, 5)]
    ids = torch.tensor([b for b, _ in moves])
    rotator.apply(caches, layout, moves)
    for cache, old in zip(caches, before, strict=True):
        expected = rotator.rotate(layout.gather(old, ids), torch.tensor([300.0, -17.0, 5.0]))
        assert torch.allclose(layout.gather(cache, ids), expected, atol=1e-5)
        values = cache.view(6, HEADS, 2, D * BS)[:, :, 1]
        assert torch.equal(values, old.view(6, HEADS, 2, D * BS)[:, :, 1])
        assert torch.equal(cache[[0, 3, 5]], old[[0, 3, 5]])


def test_apply_keeps_a_half_precision_cache_in_its_dtype() -> None:
    torch.manual_seed(3)
    rotator, layout = RopeRotator.from_base(10000.0, D), PagedKeyLayout(D, num_blocks=4)
    cache = _paged(4).to(torch.bfloat16)
    reference = rotator.rotate(layout.gather(cache, torch.tensor([2])), torch.tensor([40.0]))
    rotator.apply([cache], layout, [(2, 40)])
    assert cache.dtype == torch.bfloat16
    assert torch.allclose(layout.gather(cache, torch.tensor([2])).float(), reference.float(),
                          atol=2e-2)


def test_quantized_bytes_are_never_rotated_as_numbers() -> None:
    rotator, layout = RopeRotator.from_base(10000.0, D), PagedKeyLayout(D, num_blocks=4)
    cache = torch.zeros(4, HEADS, BS, 2 * D, dtype=torch.uint8)
    with pytest.raises(TypeError, match="quantized"):
        rotator.apply([cache], layout, [(1, 5)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_same_step_copy_is_the_source_block_moved_and_leaves_the_rest_alone(dtype) -> None:
    """:func:`span_vllm.worker.copy_in_layer` on a CPU-layout cache: the copy block holds the
    source's values and its keys rotated by the delta (computed in float32, as
    :meth:`RopeRotator.apply` rotates); the source and every other block are unchanged; with
    nothing staged it does nothing."""
    from types import SimpleNamespace

    from span_vllm import worker

    torch.manual_seed(0)
    layout, rotator = CpuKeyLayout(D), RopeRotator.from_base(10000.0, D)
    cache = torch.randn(8, HEADS, BS, 2 * D).to(dtype)
    rotation = worker.WorkerRotation(rotator, layout, (cache,), None, None, "CPU_ATTN")
    runner = SimpleNamespace(_span_rotation=rotation)
    before = cache.clone()
    worker.stage_copies(runner, [(1, 5, 3 * BS), (2, 6, 0)])
    worker.copy_in_layer(cache)
    worker.stage_copies(runner, [])
    values = cache.view(8, HEADS, 2, D * BS)[:, :, 1]
    old_values = before.view(8, HEADS, 2, D * BS)[:, :, 1]
    assert torch.equal(values[5], old_values[1]) and torch.equal(values[6], old_values[2])
    moved = rotator.rotate(layout.gather(before, torch.tensor([1])), torch.tensor([3.0 * BS]))
    assert torch.equal(layout.gather(cache, torch.tensor([5])), moved)
    applied = before.clone()
    rotator.apply([applied], layout, [(1, 3 * BS)])
    assert torch.equal(cache[5], applied[1])  # what a rotation in place gives, bit for bit
    assert torch.equal(cache[6], before[2])  # delta 0: a plain copy
    untouched = [0, 1, 2, 3, 4, 7]
    assert torch.equal(cache[untouched], before[untouched])
    worker.copy_in_layer(cache)  # nothing staged any more
    assert torch.equal(cache[untouched], before[untouched])
