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

Linear layers (q/k/v/o, gate/up, down: nearly all the LoRA work) skip the per-slice ops:
:func:`add_lora_linear` replaces the wrapper's method with one shrink for all of a layer's
slices (their ``A`` matrices concatenated once, re-read when a slot is loaded anew) and one
``addmm_`` per slice into the output, for each group of tokens that share an adapter; the
groups are found once per engine step. On SmolLM2-135M (rank 16, 30 layers) that is about
half the time of the per-slice ops in prefill and a quarter in decode.

A step whose tokens all use one adapter (one user's query, its prepares, its decode) needs no
LoRA products at all: :func:`apply_sync` (``BaseLinearLayerWithLoRA._apply_sync``) runs such a
step on the layer's weights merged with that adapter's update, ``W + B·A``, one product as
fast as the base's, through the same CPU GEMM vLLM picks for the base
(``dispatch_cpu_unquantized_gemm``). The merged weights are built when a slot first serves a
step, rebuilt when the slot is loaded anew, and capped in memory (:data:`LORA_MERGE_ENV`,
default 1 GiB per process; beyond it, steps take the grouped path). Steps that mix adapters,
or the base and an adapter, take the grouped path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from span_vllm.contract import LORA_MERGE_ENV

#: MiB of merged one-adapter weights a process may hold unless :data:`LORA_MERGE_ENV` says.
DEFAULT_MERGE_BUDGET_MIB = 1024

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
    groups = token_groups(indices)
    if indices.shape[0] == rows and len(groups) == 1 and groups[0][1] is None:
        return inputs @ weights[groups[0][0]].to(dtype).t()
    out = inputs.new_zeros((rows, weights.shape[1]))
    for slot, where in groups:
        if where is None:  # every listed token has this slot (fewer indices than rows)
            where = torch.arange(indices.shape[0])
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


#: A token group: its adapter slot and its rows (``None``: every row of the batch).
TokenGroup = tuple[int, "torch.Tensor | None"]


def token_groups(indices: torch.Tensor) -> list[TokenGroup]:
    """The adapter slots present in ``indices`` (one per token), each with its rows; tokens
    with ``-1`` (no adapter) belong to no group. One group of every row when all tokens share
    one slot (the usual case), so callers can skip the gather."""
    present = torch.unique(indices).tolist()
    if len(present) == 1:
        return [] if present[0] < 0 else [(int(present[0]), None)]
    return [(int(slot), (indices == slot).nonzero().squeeze(1)) for slot in present
            if slot >= 0]


def _stacked_shrink(wrapper: Any, lora_a_stacked: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The layer's ``A`` matrices of every slice side by side, ``[slots, sum(rank), in]``,
    cached on the wrapper and rebuilt when any of them was written since (a slot loaded)."""
    cache: dict[int, tuple[tuple[int, ...], torch.Tensor]] = wrapper.__dict__.setdefault(
        "_span_stacked_a", {})
    key = id(lora_a_stacked[0])
    versions = tuple(a._version for a in lora_a_stacked) + tuple(
        a.data_ptr() for a in lora_a_stacked)
    held = cache.get(key)
    if held is None or held[0] != versions:
        joined = torch.cat([a.squeeze(1) if a.dim() == 4 else a for a in lora_a_stacked], dim=1)
        held = (versions, joined)
        cache[key] = held
    return held[1]


def add_lora_linear(self: Any, y: torch.Tensor, x: torch.Tensor,
                    lora_a_stacked: tuple[torch.Tensor, ...],
                    lora_b_stacked: tuple[torch.Tensor, ...], scale: float,
                    output_slices: tuple[int, ...], *, buffer: Any = None,
                    **kwargs: Any) -> None:
    """``PunicaWrapperCPU.add_lora_linear``: ``y[:, slice_i] += scale * x @ A_i^T @ B_i^T``
    for every token with an adapter, per slice ``i`` of ``output_slices`` (vLLM's contract),
    one shrink per token group for all slices together."""
    del buffer, kwargs
    assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
    rows = x.size(0)
    groups = _step_groups(self, rows)
    if not groups:
        return
    stacked = _stacked_shrink(self, lora_a_stacked)
    ranks = [a.size(-2) for a in lora_a_stacked]
    for slot, where in groups:
        inputs = x if where is None else x[where]
        shrunk = F.linear(inputs.to(stacked.dtype), stacked[slot])
        if scale != 1.0:
            shrunk.mul_(scale)
        column = start = 0
        for rank, width, b in zip(ranks, output_slices, lora_b_stacked, strict=True):
            weight = (b.squeeze(1) if b.dim() == 4 else b)[slot]
            part = shrunk[:, start: start + rank]
            target = y[:, column: column + width]
            if where is None:
                target.addmm_(part.to(y.dtype), weight.t().to(y.dtype))
            else:
                target.index_add_(0, where, (part @ weight.t()).to(y.dtype))
            column += width
            start += rank


def _slot_versions(layer: Any) -> tuple[int, ...]:
    """What changes when any slot of ``layer`` is written: its A and B tensors' versions and
    storage."""
    tensors = (*layer.lora_a_stacked, *layer.lora_b_stacked)
    return tuple(t._version for t in tensors) + tuple(t.data_ptr() for t in tensors)


def _base_weight(layer: Any) -> torch.Tensor | None:
    """The base layer's ``[out, in]`` weight. vLLM's CPU GEMM dispatch packs it away (the
    parameter left empty), so then it is read back through the packed product itself, as
    the identity's image (exact: each output is one weight times one)."""
    base = layer.base_layer
    out_features, in_features = sum(layer.output_slices), layer.lora_a_stacked[0].shape[-1]
    weight = getattr(base, "weight", None)
    if weight is not None and tuple(weight.shape) == (out_features, in_features):
        return weight.detach()
    linear = getattr(base, "cpu_linear", None)
    dtype = layer.lora_a_stacked[0].dtype
    if linear is None or weight is None or weight.dtype != dtype:
        return None
    image = linear(torch.eye(in_features, dtype=dtype), weight, None)
    if tuple(image.shape) != (in_features, out_features):
        return None
    return image.t().contiguous()


def _merge_budget() -> int:
    """Bytes of merged weights this process may still build."""
    if "budget" not in _MERGED:
        mib = int(os.environ.get(LORA_MERGE_ENV, DEFAULT_MERGE_BUDGET_MIB))
        _MERGED["budget"] = mib * 2**20
    return _MERGED["budget"]


def merges_built() -> int:
    """How many merged layer weights this process has built (each rebuilt one counted again)."""
    return _MERGED.get("built", 0)


def merged_linear(layer: Any, slot: int) -> Any:
    """A ``linear(x, bias)`` computing ``layer``'s base product plus adapter ``slot``'s
    update in one GEMM, or ``None`` where that cannot be built (no readable base weight, the
    memory budget spent). Cached on the layer per slot, the ``None`` too; looked at again
    after the slot is written."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    cache: dict[int, tuple[tuple[int, ...], Any, int]] = layer.__dict__.setdefault(
        "_span_merged", {})
    versions = _slot_versions(layer)
    held = cache.get(slot)
    if held is not None and held[0] == versions:
        return held[1]
    if held is not None:  # the slot was loaded anew: its old merge is given back
        _MERGED["budget"] = _merge_budget() + held[2]
        del cache[slot]
    a = layer.lora_a_stacked[0]
    size = sum(layer.output_slices) * a.shape[-1] * a.element_size()
    weight = _base_weight(layer) if size <= _merge_budget() else None
    if weight is None:
        cache[slot] = (versions, None, 0)
        return None
    update = torch.cat([(b.squeeze(1) if b.dim() == 4 else b)[slot]
                        @ (a.squeeze(1) if a.dim() == 4 else a)[slot]
                        for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked,
                                        strict=True)], dim=0)
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight + update.to(weight.dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    _MERGED["budget"] = _merge_budget() - size
    _MERGED["built"] = _MERGED.get("built", 0) + 1

    def linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return holder.cpu_linear(x, holder.weight, bias)

    cache[slot] = (versions, linear, size)
    return linear


def apply_sync(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``BaseLinearLayerWithLoRA._apply_sync`` on CPU: a step whose every token uses one
    adapter runs on the merged weights (:func:`merged_linear`); any other step as vLLM
    computes it (the base product, then :func:`add_lora_linear`)."""
    if x.ndim == 2:
        groups = _step_groups(self.punica_wrapper, x.size(0))
        if len(groups) == 1 and groups[0][1] is None:
            linear = merged_linear(self, groups[0][0])
            if linear is not None:
                return linear(x, bias)
    return _VLLMS["_apply_sync"](self, x, bias)


def _step_groups(wrapper: Any, rows: int) -> list[TokenGroup]:
    """:func:`token_groups` of this step's tokens, computed once per step (the wrapper's
    metadata update clears it) for the first ``rows`` tokens."""
    held = wrapper.__dict__.get("_span_groups")
    if held is None or held[0] != rows:
        held = (rows, token_groups(wrapper.token_lora_indices[:rows]))
        wrapper._span_groups = held
    return held[1]


def _clearing_groups(update: Any) -> Any:
    def update_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._span_groups = None
        return update(self, *args, **kwargs)

    update_metadata._span_wrapped = True  # type: ignore[attr-defined]
    update_metadata.__span_original__ = update  # type: ignore[attr-defined]
    return update_metadata


def install() -> bool:
    """Point ``PunicaWrapperCPU`` at these ops and :func:`add_lora_linear` (idempotent);
    ``False`` if this vLLM has no CPU punica wrapper or it no longer imports the ops by name.

    For the CPU platform only (the plugin calls it there alone): it also replaces
    ``BaseLinearLayerWithLoRA._apply_sync``, shared by every platform, whose per-step token
    groups only ``PunicaWrapperCPU.update_metadata`` clears."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # pragma: no cover - a vLLM build without LoRA
        return False
    module: Any = punica_cpu
    if not all(hasattr(module, name) for name in OPS):
        return False
    for name in OPS:
        setattr(module, name, globals()[name])
    wrapper = module.PunicaWrapperCPU
    if wrapper.add_lora_linear is not add_lora_linear:
        _VLLMS["add_lora_linear"] = wrapper.add_lora_linear
    wrapper.add_lora_linear = add_lora_linear
    if not getattr(wrapper.update_metadata, "_span_wrapped", False):
        wrapper.update_metadata = _clearing_groups(wrapper.update_metadata)
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    if BaseLinearLayerWithLoRA._apply_sync is not apply_sync:
        _VLLMS["_apply_sync"] = BaseLinearLayerWithLoRA._apply_sync
        BaseLinearLayerWithLoRA._apply_sync = apply_sync
    return True


def restore_vllms() -> None:
    """Put vLLM's own CPU LoRA ops and ``add_lora_linear`` back (to measure them side by side;
    a batch mixing base and adapter requests then has vLLM's ``-1`` defect again)."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in OPS:
        setattr(punica_cpu, name, getattr(torch_ops, name))
    if "add_lora_linear" in _VLLMS:
        punica_cpu.PunicaWrapperCPU.add_lora_linear = _VLLMS["add_lora_linear"]
    if "_apply_sync" in _VLLMS:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

        BaseLinearLayerWithLoRA._apply_sync = _VLLMS["_apply_sync"]


#: vLLM's methods that :func:`install` replaced, by name.
_VLLMS: dict[str, Any] = {}
#: ``budget``: bytes of merged weights this process may still build.
_MERGED: dict[str, int] = {}


__all__ = ["OPS", "add_lora_linear", "grouped_lora_matmul", "install", "restore_vllms",
           "token_groups", *OPS]
