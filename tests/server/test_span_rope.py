"""Every RoPE variant span mode accepts is moved exactly: re-rotating a key computed at ``p``
by ``q - p`` gives the key the model's own rotary module computes at ``q`` (no engine; modules
built with vLLM's ``get_rope`` from real model configs). Variants that are not linear in the
position are refused."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from span_vllm.rope import UnsupportedRopeError, model_rope, rope_spec

HEADS = 2

#: (head_size, max_position, rope_parameters, is_neox_style) of real model families.
CONFIGS = {
    "llama-3.1-8b": (128, 131072, {"rope_theta": 500000.0, "rope_type": "llama3",
                                   "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}, True),
    "qwen2.5-7b-yarn": (128, 131072, {"rope_theta": 1000000.0, "rope_type": "yarn",
                                      "factor": 4.0,
                                      "original_max_position_embeddings": 32768}, True),
    "partial-rotary-0.5": (128, 8192, {"rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5}, True),
    "gptj-pairs": (64, 4096, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, False),
    "smollm2": (64, 8192, {"rope_theta": 100000.0}, True),
    "linear": (64, 4096, {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}, True),
    "ntk": (64, 4096, {"rope_theta": 10000.0, "rope_type": "ntk", "factor": 2.0}, True),
    "dynamic-ntk": (64, 4096, {"rope_theta": 10000.0, "rope_type": "dynamic",
                               "factor": 2.0}, True),
}


@pytest.fixture(scope="module", autouse=True)
def _vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _module(name: str, dtype: torch.dtype):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    head, max_pos, params, neox = CONFIGS[name]
    return get_rope(head, max_pos, is_neox_style=neox, rope_parameters=params, dtype=dtype)


def _keys_at(module, raw: torch.Tensor, start: int) -> torch.Tensor:
    """The model's keys for ``raw`` ``[tokens, heads*head]`` at ``start, start+1, ...``."""
    positions = torch.arange(start, start + raw.shape[0])
    _, key = module.forward_native(positions, raw.clone(), raw.clone())
    return key.view(raw.shape[0], HEADS, -1).transpose(0, 1)[None]  # [1, heads, T, head]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rotating_by_the_delta_equals_the_model_computing_at_the_new_position(name) -> None:
    torch.manual_seed(0)
    module = _module(name, torch.float32)
    head = module.head_size
    raw = torch.randn(16, HEADS * head)
    p, q = 300, min(12345, module.cos_sin_cache.shape[0] - raw.shape[0])
    moved = rope_spec(module).rotator().rotate(_keys_at(module, raw, p), torch.tensor([q - p]))
    want = _keys_at(module, raw, q)
    # vLLM's float32 cos/sin cache rounds the angle p·θ: ~ q·θmax·2^-24 radians.
    scale = want.abs().max()
    assert (moved - want).abs().max() <= 4 * q * 2.0 ** -24 * scale + 1e-5
    assert (moved - _keys_at(module, raw, p)).abs().max() > 0.1  # the move did something
    if module.rotary_dim < head:  # the non-rotated channels are left as they are
        assert torch.equal(moved[..., module.rotary_dim:], want[..., module.rotary_dim:])


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b-yarn", "partial-rotary-0.5"])
def test_bf16_models_move_within_bf16_rounding(name) -> None:
    torch.manual_seed(1)
    module = _module(name, torch.bfloat16)
    raw = torch.randn(16, HEADS * module.head_size).to(torch.bfloat16)
    p, q = 40, 3000
    moved = rope_spec(module).rotator().rotate(_keys_at(module, raw, p), torch.tensor([q - p]))
    want = _keys_at(module, raw, q).float()
    # keys at p and at q each carry bf16 rounding of cos/sin and of the result (2^-8 each)
    assert (moved.float() - want).abs().max() <= 6 * 2.0 ** -8 * want.abs().max()


def test_yarn_attention_factor_is_kept_not_applied_again() -> None:
    module = _module("qwen2.5-7b-yarn", torch.float32)
    assert module.mscale != 1.0
    spec = rope_spec(module)
    raw = torch.randn(4, HEADS * module.head_size)
    keys = _keys_at(module, raw, 10)
    moved = spec.rotator().rotate(keys, torch.tensor([0]))
    assert torch.allclose(moved, keys)  # a rotation by 0 is the identity: no extra mscale


def test_multimodal_rope_is_refused() -> None:
    from vllm.model_executor.layers.rotary_embedding import get_rope

    mrope = get_rope(128, 4096, rope_parameters={"rope_theta": 1e6,
                                                 "mrope_section": [16, 24, 24]})
    with pytest.raises(UnsupportedRopeError, match="MRoPE"):
        rope_spec(mrope)


def test_a_rope_with_several_scaling_factors_is_refused() -> None:
    from vllm.model_executor.layers.rotary_embedding import LinearScalingRotaryEmbedding

    module = LinearScalingRotaryEmbedding(64, 64, 2048, 10000.0, True, [1.0, 4.0],
                                          torch.float32)
    with pytest.raises(UnsupportedRopeError, match="scaling factor"):
        rope_spec(module)


def test_angles_that_are_not_position_times_frequency_are_refused() -> None:
    """A variant that switches frequencies past a length (what seq-length-dependent
    "dynamic" scaling does) keeps RotaryEmbedding's forward: the cache check catches it."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    class SwitchingRope(RotaryEmbedding):
        def _compute_cos_sin_cache(self) -> torch.Tensor:
            inv_freq = self._compute_inv_freq(self.base)
            t = torch.arange(self.max_position_embeddings, dtype=torch.float)
            t = torch.where(t < 1024, t, 1024 + (t - 1024) / 4)  # slower past 1024
            freqs = torch.einsum("i,j -> ij", t, inv_freq)
            return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    with pytest.raises(UnsupportedRopeError, match="position 1025"):
        rope_spec(SwitchingRope(64, 64, 4096, 10000.0, True, torch.float32))


def test_a_buffer_rounded_by_other_kernels_is_served_and_logged(caplog) -> None:
    """The buffer vLLM built may come from other float kernels than the check's (another
    vector width, a reduced-precision math mode): the same rotation, rounded differently."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    module = RotaryEmbedding(64, 64, 4096, 10000.0, True, torch.float32)
    buffer = module.cos_sin_cache
    module.cos_sin_cache = buffer + 1e-4 * torch.sign(buffer)  # ~ 800 float32 ulps
    with caplog.at_level("WARNING", logger="span_vllm.rope"):
        spec = rope_spec(module)
    assert spec.rotary_dim == 64
    assert "off the float32 rotation" in caplog.text


def test_a_buffer_holding_another_rotation_is_refused() -> None:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    module = RotaryEmbedding(64, 64, 4096, 10000.0, True, torch.float32)
    module.cos_sin_cache = module.cos_sin_cache.roll(1, dims=0)  # every row one position off
    with pytest.raises(UnsupportedRopeError, match="buffer .* is not the rotation"):
        rope_spec(module)


def _model(ropes: list) -> nn.Module:
    """A model tree like vLLM's: each ``self_attn`` owns ``attn`` and ``rotary_emb``."""
    layers = nn.ModuleList()
    for i, rope in enumerate(ropes):
        owner = nn.Module()
        owner.attn = nn.Module()
        owner.attn.layer_name = f"layers.{i}.self_attn.attn"
        if rope is not None:
            owner.rotary_emb = rope
        layers.append(owner)
    return types.SimpleNamespace(modules=layers.modules)


def test_model_rope_is_the_one_rope_of_every_layer() -> None:
    rope = _module("smollm2", torch.float32)
    names = [f"layers.{i}.self_attn.attn" for i in range(3)]
    spec = model_rope(_model([rope, rope, rope]), names)
    assert spec.rotary_dim == 64
    with pytest.raises(UnsupportedRopeError, match=r"layers\.1"):
        model_rope(_model([rope, None, rope]), names)  # a NoPE layer
    other = _module("linear", torch.float32)
    with pytest.raises(UnsupportedRopeError, match="different RoPE"):
        model_rope(_model([rope, other, rope]), names)
    with pytest.raises(UnsupportedRopeError, match="draft"):
        model_rope(_model([rope] * 3), [*names, "drafter.layers.0.attn"])
