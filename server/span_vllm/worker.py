"""Worker side: what to rotate, how, and whether this worker can do it at all.

:func:`rotation_for` is called when a model runner (V1 ``GPUModelRunner``, its CPU subclass,
or Model Runner V2) has allocated its KV cache — at engine start — and refuses (raises
:class:`~span_vllm.support.UnsupportedModelError`) a configuration it cannot rotate exactly:
an attention backend whose key layout is not verified, a KV cache dtype without a decodable
format, or a RoPE that is not linear in the position (:mod:`span_vllm.rope`). The result is
kept on the runner; every step's moves then go to :meth:`WorkerRotation.apply`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from span_vllm.rope import RopeSpec, UnsupportedRopeError, model_rope
from span_vllm.rotation import (
    CpuKeyLayout,
    Fp8Keys,
    KeyLayout,
    PagedKeyLayout,
    RopeRotator,
    compute_dtype,
)
from span_vllm.support import kv_cache_problems, refuse

#: Attention backends whose KV layout the rotator is verified against, by device type.
#: CUDA backends read K as ``cache[..., :head_size]`` of vLLM 0.32's ``[B, H, N, 2D]`` view.
PAGED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
CPU_BACKENDS = ("CPU_ATTN",)
#: CPU attention kernels whose transposed-K block layout is verified (``cpu_attn.py`` isa).
CPU_ISAS = ("vec",)

_ATTR = "_span_rotation"


@dataclass(frozen=True)
class WorkerRotation:
    """Everything needed to apply a step's moves on one worker."""

    rotator: RopeRotator
    layout: KeyLayout
    caches: tuple[torch.Tensor, ...]
    fp8: Fp8Keys | None
    rope: RopeSpec
    backend: str

    def apply(self, moves: Sequence[tuple[int, int]]) -> None:
        """Rotate ``[(manager_block_id, delta), ...]`` in every layer, in place."""
        self.rotator.apply(self.caches, self.layout, moves, fp8=self.fp8)


def rotation_for(runner: Any) -> WorkerRotation:
    """The rotation of ``runner`` (built, checked and cached on the first call)."""
    cached = getattr(runner, _ATTR, None)
    if cached is not None:
        return cached
    rotation = build_rotation(runner)
    setattr(runner, _ATTR, rotation)
    return rotation


def build_rotation(runner: Any) -> WorkerRotation:
    """Check ``runner`` and build its :class:`WorkerRotation` (see the module doc)."""
    config = runner.kv_cache_config
    refuse(kv_cache_problems(config), "worker KV cache")
    group = config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    layer_names = list(group.layer_names)
    context = runner.vllm_config.compilation_config.static_forward_context
    layers = [context[name] for name in layer_names]
    caches = tuple(layer.kv_cache for layer in layers)
    if not caches or not all(isinstance(c, torch.Tensor) for c in caches):
        refuse(["the attention layers have no KV cache tensors bound"], "worker KV cache")
    device = caches[0].device
    backend = _backend_name(runner)
    layout, problems = _layout(device, backend, layers, spec.head_size, config.num_blocks)
    fp8, fp8_problems = _fp8(runner, spec, layers, device)
    problems += fp8_problems
    try:
        rope = model_rope(runner.get_model() if hasattr(runner, "get_model") else runner.model,
                          layer_names)
        if rope.head_size != spec.head_size:
            problems.append(f"RoPE head size {rope.head_size} != KV head size "
                            f"{spec.head_size}")
    except UnsupportedRopeError as exc:
        problems.append(str(exc))
        rope = None
    refuse(problems, "worker model check")
    assert rope is not None and layout is not None
    rotation = WorkerRotation(rope.rotator(), layout, caches, fp8, rope, backend)
    _ACTIVE[:] = [rotation]
    return rotation


@dataclass(frozen=True)
class StepCopies:
    """The same-step copies of the step being computed: blocks written in this forward pass
    and read elsewhere in it (:mod:`span_vllm.positions`), copied in each layer by
    :func:`copy_in_layer` once that layer's KV is written. The block ids and the rotation's
    cos/sin are made once per step, in :func:`stage_copies`."""

    rotation: WorkerRotation
    sources: torch.Tensor
    copies: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def stage_copies(runner: Any, copies: Sequence[tuple[int, int, int]]) -> None:
    """Make ``[(source_id, copy_id, delta), ...]`` the copies of the forward pass about to run
    on ``runner`` (an empty list: none)."""
    if not copies:
        _STAGED.clear()
        return
    rotation = rotation_for(runner)
    device = rotation.caches[0].device
    deltas = torch.tensor([d for _, _, d in copies], dtype=torch.float64)
    cos, sin = rotation.rotator.cos_sin(deltas, compute_dtype(rotation.caches[0].dtype), device)
    _STAGED[:] = [StepCopies(
        rotation,
        torch.tensor([s for s, _, _ in copies], dtype=torch.long, device=device),
        torch.tensor([c for _, c, _ in copies], dtype=torch.long, device=device),
        cos, sin,
    )]


def copy_in_layer(kv_cache: torch.Tensor) -> None:
    """Fill this step's copies in one layer's cache (just written by the forward pass): each
    copy block gets its source block's keys and values, keys rotated by its delta."""
    if not _STAGED:
        return
    step = _STAGED[0]
    step.rotation.rotator.copy_rotated(kv_cache, step.rotation.layout, step.sources,
                                       step.copies, step.cos, step.sin)


_STAGED: list[StepCopies] = []


def active_rotation() -> WorkerRotation | None:
    """The rotation of the model runner last checked in this process (the span store's
    loader rotates loaded blocks with it), if any."""
    return _ACTIVE[0] if _ACTIVE else None


_ACTIVE: list[WorkerRotation] = []


def _backend_name(runner: Any) -> str:
    names = {group.backend.get_name() for groups in getattr(runner, "attn_groups", [])
             for group in groups}
    return ",".join(sorted(names)) or "unknown"


def _layout(device: torch.device, backend: str, layers: Sequence[Any], head_size: int,
            num_blocks: int) -> tuple[KeyLayout | None, list[str]]:
    if device.type == "cpu":
        if backend not in CPU_BACKENDS:
            return None, [f"attention backend {backend} on CPU (supported: {CPU_BACKENDS})"]
        isas = {getattr(layer, "isa", None) for layer in layers}
        if not isas <= set(CPU_ISAS):
            return None, [f"CPU attention kernel {sorted(map(str, isas))}: the key layout "
                          f"is verified for {CPU_ISAS} only"]
        return CpuKeyLayout(head_size), []
    if device.type != "cuda":
        return None, [f"KV cache on {device.type}: only CUDA and CPU layouts are verified"]
    if backend not in PAGED_BACKENDS:
        return None, [f"attention backend {backend} (supported: {', '.join(PAGED_BACKENDS)}"
                      "; pick one with --attention-backend)"]
    layout = PagedKeyLayout(head_size, num_blocks)
    for layer in layers:
        cache = layer.kv_cache
        if cache.dim() != 4 or cache.shape[0] % num_blocks or cache.shape[-1] < 2 * head_size:
            return None, [f"KV cache view {tuple(cache.shape)} of {num_blocks} blocks is not "
                          "vLLM 0.32's [blocks, heads, tokens, 2*head_size]"]
    return layout, []


def _fp8(runner: Any, spec: Any, layers: Sequence[Any],
         device: torch.device) -> tuple[Fp8Keys | None, list[str]]:
    mode = getattr(spec.kv_quant_mode, "name", "NONE")
    if mode == "NONE":
        return None, []
    if device.type != "cuda":
        return None, [f"fp8 KV cache on {device.type}: its block layout is not verified"]
    cache_dtype = str(runner.vllm_config.cache_config.cache_dtype)
    if cache_dtype in ("fp8", "fp8_e4m3"):
        from vllm.platforms import current_platform

        fp8_dtype = current_platform.fp8_dtype()
    elif cache_dtype == "fp8_e5m2":
        fp8_dtype = torch.float8_e5m2
    else:
        return None, [f"KV cache dtype {cache_dtype}"]
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return None, [f"fp8 format {fp8_dtype} (supported: e4m3fn, e5m2)"]
    scales = [getattr(layer, "_k_scale", None) for layer in layers]
    if any(s is None for s in scales):
        return None, ["fp8 KV cache without per-layer key scales"]
    return Fp8Keys(fp8_dtype, scales), []
