"""Grouped LoRA matmuls for vLLM's CPU punica wrapper (``PunicaWrapperCPU``).

vLLM 0.32's torch LoRA ops (``vllm.lora.ops.torch_ops``), which the CPU build uses, gather one
full copy of the adapter's weights *per token* (``weights[indices]``, then a batched einsum):
a 1,200-token prefill of SmolLM2 with a rank-16 adapter on q/k/v/o and the MLP takes about 6x
the base model's time, decode about 2x. They also read index ``-1`` ("no LoRA") as the last
adapter slot, so in a batch that mixes base and adapter requests with every slot in use, the
base requests' tokens get that adapter's update.

The ops here compute the same products grouped by adapter: one plain matmul per distinct
adapter index in the batch (usually one), and nothing for tokens with index ``-1``. Same
signatures and output semantics as vLLM's (``add_inputs``, slices, the single-row broadcast of
``bgmv_expand``); :func:`install` puts them where ``PunicaWrapperCPU`` looks them up.
"""

from __future__ import annotations

from typing import Any

import torch

#: The op names ``vllm.lora.punica_wrapper.punica_cpu`` imports and :func:`install` replaces.
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
       "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def grouped_lora_matmul(inputs: torch.Tensor, weights: torch.Tensor,
                        indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = weights[indices[t]] @ inputs[t]`` for every token ``t`` with an adapter
    (``indices[t] >= 0``), zeros where ``indices[t] == -1``; ``weights`` is
    ``[slots, out, in]`` (or ``[slots, 1, out, in]``), the result ``[tokens, out]`` in
    ``dtype``."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    rows = inputs.shape[0]
    indices = indices[:rows]
    present = torch.unique(indices).tolist()
    if len(present) == 1 and present[0] >= 0 and indices.shape[0] == rows:
        return inputs @ weights[present[0]].to(dtype).t()
    out = inputs.new_zeros((rows, weights.shape[1]))
    for slot in present:
        if slot < 0:
            continue
        where = (indices == slot).nonzero().squeeze(1)
        out[where] = inputs[where] @ weights[slot].to(dtype).t()
    return out


def bgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor,
                output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                scaling: float = 1.0) -> None:
    """``output = scaling * (x @ A_i^T)`` per token (vLLM's ``bgmv_shrink``)."""
    outputs = grouped_lora_matmul(inputs, lora_a_weights, lora_indices_tensor,
                                  output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                add_inputs: bool = True) -> None:
    """``output (+)= x @ B_i^T`` per token (vLLM's ``bgmv_expand``)."""
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor,
                                  output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    width = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :width] += outputs[:limit, :width]
    else:
        output_tensor[:, :width] = outputs[:limit, :width]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                      output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    """:func:`bgmv_expand` into columns ``slice_offset:slice_offset + slice_size``."""
    outputs = grouped_lora_matmul(inputs, lora_b_weights, lora_indices_tensor,
                                  output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


def _per_token(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor,
                output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, scaling: float) -> None:
    """Prefill form of :func:`bgmv_shrink`: one adapter index per sequence."""
    del b_seq_start_loc, batches, max_seq_length, token_nums
    bgmv_shrink(inputs, lora_a_weights, output_tensor,
                _per_token(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int,
                add_inputs: bool = False) -> None:
    """Prefill form of :func:`bgmv_expand`."""
    del b_seq_start_loc, batches, max_seq_length, token_nums
    bgmv_expand(inputs, lora_b_weights, output_tensor,
                _per_token(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                      output_tensor: torch.Tensor, b_seq_start_loc: torch.Tensor,
                      seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      batches: int, max_seq_length: int, token_nums: int,
                      slice_offset: int, slice_size: int, add_inputs: bool = False) -> None:
    """Prefill form of :func:`bgmv_expand_slice`."""
    del b_seq_start_loc, batches, max_seq_length, token_nums
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor,
                      _per_token(lora_indices_tensor, seq_len_tensor), slice_offset,
                      slice_size, add_inputs)


def install() -> bool:
    """Point ``PunicaWrapperCPU`` at these ops (idempotent); ``False`` if this vLLM has no CPU
    punica wrapper or it no longer imports the ops by name."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # pragma: no cover - a vLLM build without LoRA
        return False
    module: Any = punica_cpu
    if not all(hasattr(module, name) for name in OPS):
        return False
    for name in OPS:
        setattr(module, name, globals()[name])
    return True


__all__ = ["OPS", "grouped_lora_matmul", "install", *OPS]
