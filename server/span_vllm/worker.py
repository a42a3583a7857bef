"""Finds the RoPE parameters and the KV layout of a loaded model runner (worker side)."""

from __future__ import annotations

from typing import Any

from span_vllm.rotation import CpuKeyLayout, GpuKeyLayout, KeyLayout, RopeRotator


def rotator_for(runner: Any) -> tuple[RopeRotator, KeyLayout]:
    """The rotator and key layout for ``runner`` (cached on it after the first call)."""
    cached = getattr(runner, "_span_rotator", None)
    if cached is not None:
        return cached
    rope = _find_rope(runner.model)
    base = float(rope.base)
    rotator = RopeRotator.from_base(base, int(rope.rotary_dim), bool(rope.is_neox_style))
    head_dim = runner.model_config.get_head_size()
    cache = runner.kv_caches[0]
    if cache.device.type == "cpu":
        layout: KeyLayout = CpuKeyLayout(head_dim)
    elif cache.dim() == 5 and cache.shape[0] == 2:
        layout = GpuKeyLayout()
    else:
        raise RuntimeError(f"span mode: unsupported KV cache layout {tuple(cache.shape)}")
    runner._span_rotator = (rotator, layout)
    return rotator, layout


def _find_rope(model: Any) -> Any:
    for module in model.modules():
        rope = getattr(module, "rotary_emb", None)
        if rope is not None and hasattr(rope, "base") and hasattr(rope, "rotary_dim"):
            if type(rope).__name__ != "RotaryEmbedding":
                raise RuntimeError(
                    f"span mode: RoPE variant {type(rope).__name__} is not supported yet"
                )
            return rope
    raise RuntimeError("span mode: the model has no RoPE layer to reposition keys with")
