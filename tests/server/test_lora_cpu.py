"""The plugin's grouped LoRA ops equal vLLM's torch ops wherever those are right, and keep
"no adapter" tokens on the base weights where vLLM's read them as the last adapter slot."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops import torch_ops as vllm_ops

from span_vllm import lora_cpu

SLOTS, RANK, HIDDEN, OUT = 2, 8, 48, 40


def _weights(seed: int, out: int, inner: int) -> torch.Tensor:
    return torch.randn(SLOTS, 1, out, inner, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("indices", [[0, 0, 0, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
def test_shrink_and_expand_equal_vllms_where_every_token_has_an_adapter(indices: list[int]):
    x = torch.randn(len(indices), HIDDEN, generator=torch.Generator().manual_seed(1))
    a, b = _weights(2, RANK, HIDDEN), _weights(3, OUT, RANK)
    idx = torch.tensor(indices)
    ours, theirs = torch.zeros(len(indices), RANK), torch.zeros(len(indices), RANK)
    lora_cpu.bgmv_shrink(x, a, ours, idx, 0.5)
    vllm_ops.bgmv_shrink(x, a, theirs, idx, 0.5)
    torch.testing.assert_close(ours, theirs)
    base = torch.randn(len(indices), OUT + 6, generator=torch.Generator().manual_seed(4))
    ours_out, theirs_out = base.clone(), base.clone()
    lora_cpu.bgmv_expand(ours, b, ours_out, idx, True)
    vllm_ops.bgmv_expand(theirs, b, theirs_out, idx, True)
    torch.testing.assert_close(ours_out, theirs_out)
    ours_slice, theirs_slice = base.clone(), base.clone()
    lora_cpu.bgmv_expand_slice(ours, b, ours_slice, idx, 3, OUT, False)
    vllm_ops.bgmv_expand_slice(theirs, b, theirs_slice, idx, 3, OUT, False)
    torch.testing.assert_close(ours_slice, theirs_slice)


def test_prefill_forms_expand_one_index_per_sequence():
    lengths = torch.tensor([3, 2, 4])
    seq_idx = torch.tensor([1, 0, 1])
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    a = _weights(6, RANK, HIDDEN)
    starts = torch.tensor([0, 3, 5])
    ours, theirs = torch.zeros(9, RANK), torch.zeros(9, RANK)
    lora_cpu.sgmv_shrink(x, a, ours, starts, lengths, seq_idx, 3, 4, 9, 1.0)
    vllm_ops.sgmv_shrink(x, a, theirs, starts, lengths, seq_idx, 3, 4, 9, 1.0)
    torch.testing.assert_close(ours, theirs)
    b = _weights(7, OUT, RANK)
    ours_out, theirs_out = torch.ones(9, OUT), torch.ones(9, OUT)
    lora_cpu.sgmv_expand(ours, b, ours_out, starts, lengths, seq_idx, 3, 4, 9, True)
    vllm_ops.sgmv_expand(theirs, b, theirs_out, starts, lengths, seq_idx, 3, 4, 9, True)
    torch.testing.assert_close(ours_out, theirs_out)


def test_tokens_without_an_adapter_stay_on_the_base_weights():
    """vLLM's torch op gives a ``-1`` token (a base request batched with adapter requests)
    the last slot's update; ours gives it none."""
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(8))
    a = _weights(9, RANK, HIDDEN)
    idx = torch.tensor([0, -1, 1, -1])
    theirs = torch.zeros(4, RANK)
    vllm_ops.bgmv_shrink(x, a, theirs, idx, 1.0)
    assert theirs[1].abs().sum() > 0  # the defect: slot -1 == the last adapter
    ours = torch.full((4, RANK), 7.0)
    lora_cpu.bgmv_shrink(x, a, ours, idx, 1.0)
    assert torch.equal(ours[1], torch.zeros(RANK)) and torch.equal(ours[3], torch.zeros(RANK))
    torch.testing.assert_close(ours[0], x[0] @ a[0, 0].t())
    torch.testing.assert_close(ours[2], x[2] @ a[1, 0].t())


def test_install_points_the_cpu_wrapper_at_the_grouped_ops_and_restore_undoes_it():
    from vllm.lora.punica_wrapper import punica_cpu

    assert lora_cpu.install()
    assert all(getattr(punica_cpu, name) is getattr(lora_cpu, name) for name in lora_cpu.OPS)
    try:
        lora_cpu.restore_vllms()
        assert all(getattr(punica_cpu, name) is getattr(vllm_ops, name)
                   for name in lora_cpu.OPS)
        assert punica_cpu.PunicaWrapperCPU.add_lora_linear is not lora_cpu.add_lora_linear
    finally:
        assert lora_cpu.install()
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is lora_cpu.add_lora_linear


class _Wrapper:
    """The part of ``PunicaWrapperCPU`` that :func:`lora_cpu.add_lora_linear` reads."""

    def __init__(self, indices: list[int]) -> None:
        self.token_lora_indices = torch.tensor(indices)


def _per_token_reference(y: torch.Tensor, x: torch.Tensor, a: tuple[torch.Tensor, ...],
                         b: tuple[torch.Tensor, ...], scale: float, slices: tuple[int, ...],
                         indices: list[int]) -> torch.Tensor:
    out = y.clone()
    for t, slot in enumerate(indices):
        if slot < 0:
            continue
        column = 0
        for a_i, b_i, width in zip(a, b, slices, strict=True):
            out[t, column: column + width] += scale * (x[t] @ a_i[slot, 0].t() @ b_i[slot, 0].t())
            column += width
    return out


@pytest.mark.parametrize("indices", [[0, 0, 0, 0, 0], [1, -1, 0, 1, -1], [-1, -1, -1, -1, -1]])
def test_fused_linear_lora_equals_the_per_token_formula(indices: list[int]):
    slices = (24, 8, 8)
    x = torch.randn(len(indices), HIDDEN, generator=torch.Generator().manual_seed(10))
    a = tuple(_weights(11 + i, RANK, HIDDEN) for i in range(3))
    b = tuple(_weights(21 + i, width, RANK) for i, width in enumerate(slices))
    y = torch.randn(len(indices), sum(slices), generator=torch.Generator().manual_seed(12))
    expected = _per_token_reference(y, x, a, b, 0.5, slices, indices)
    lora_cpu.add_lora_linear(_Wrapper(indices), y, x, a, b, 0.5, slices)
    torch.testing.assert_close(y, expected)


def test_fused_linear_lora_reads_a_slot_loaded_anew():
    """The concatenated ``A`` matrices are cached; writing a slot (an adapter loaded into it)
    must be seen by the next step."""
    wrapper, slices = _Wrapper([0, 0, 0]), (OUT,)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(13))
    a, b = (_weights(14, RANK, HIDDEN),), (_weights(15, OUT, RANK),)
    first = torch.zeros(3, OUT)
    lora_cpu.add_lora_linear(wrapper, first, x, a, b, 1.0, slices)
    a[0][0].copy_(_weights(16, RANK, HIDDEN)[0])
    second = torch.zeros(3, OUT)
    lora_cpu.add_lora_linear(wrapper, second, x, a, b, 1.0, slices)
    torch.testing.assert_close(second, _per_token_reference(torch.zeros(3, OUT), x, a, b, 1.0,
                                                            slices, [0, 0, 0]))
    assert not torch.allclose(first, second)


def test_token_groups_follow_each_metadata_update():
    """Groups are found once per step; the wrapper's metadata update (a new batch) drops them."""
    from vllm.lora.punica_wrapper import punica_cpu

    def new_batch(self: _Wrapper, indices: list[int]) -> None:
        self.token_lora_indices = torch.tensor(indices)

    update = lora_cpu._clearing_groups(new_batch)
    wrapper = _Wrapper([0, 0])
    assert lora_cpu._step_groups(wrapper, 2) == [(0, None)]
    update(wrapper, [-1, -1])
    assert lora_cpu._step_groups(wrapper, 2) == []
    update(wrapper, [1, -1])
    [(slot, rows)] = lora_cpu._step_groups(wrapper, 2)
    assert slot == 1 and rows is not None and rows.tolist() == [0]
    assert lora_cpu.install()
    assert getattr(punica_cpu.PunicaWrapperCPU.update_metadata, "_span_wrapped", False)
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is lora_cpu.add_lora_linear


class _Layer:
    """The part of a LoRA linear layer that :func:`lora_cpu.apply_sync` reads: a base layer
    whose weight vLLM's CPU GEMM dispatch packed away, stacked A/B and the wrapper."""

    def __init__(self, indices: list[int], slices: tuple[int, ...]) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        self.weight = torch.randn(sum(slices), HIDDEN, generator=torch.Generator().manual_seed(30))
        self.base_layer = torch.nn.Module()
        self.base_layer.weight = torch.nn.Parameter(self.weight.clone(), requires_grad=False)
        dispatch_cpu_unquantized_gemm(self.base_layer, remove_weight=True)
        self.output_slices = slices
        self.lora_a_stacked = tuple(_weights(31 + i, RANK, HIDDEN) for i in range(len(slices)))
        self.lora_b_stacked = tuple(_weights(41 + i, w, RANK) for i, w in enumerate(slices))
        self.punica_wrapper = _Wrapper(indices)


def test_the_base_weight_is_read_back_from_vllms_packed_gemm_exactly():
    layer = _Layer([0], (24, 8, 8))
    assert layer.base_layer.weight.numel() in (0, layer.weight.numel())
    assert torch.equal(lora_cpu._base_weight(layer), layer.weight)


def test_a_one_adapter_step_runs_on_merged_weights_equal_to_base_plus_lora(monkeypatch):
    """Every token on slot 1: one product with ``W + B·A``, equal (to rounding) to the base
    product plus the per-token LoRA formula; vLLM's path is not called."""
    slices = (24, 8, 8)
    layer = _Layer([1, 1, 1, 1], slices)
    monkeypatch.setitem(lora_cpu._VLLMS, "_apply_sync", lambda *a: pytest.fail("vLLM's path"))
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(32))
    expected = _per_token_reference(x @ layer.weight.t(), x, layer.lora_a_stacked,
                                    layer.lora_b_stacked, 1.0, slices, [1, 1, 1, 1])
    torch.testing.assert_close(lora_cpu.apply_sync(layer, x), expected, rtol=1e-4, atol=1e-4)
    first = lora_cpu.merged_linear(layer, 1)
    assert lora_cpu.merged_linear(layer, 1) is first  # built once per slot


def test_a_slot_loaded_anew_is_merged_anew_and_mixed_steps_take_vllms_path(monkeypatch):
    slices = (OUT,)
    layer = _Layer([0, 0], slices)
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(33))
    before = lora_cpu.apply_sync(layer, x)
    layer.lora_b_stacked[0][0].copy_(_weights(34, OUT, RANK)[0])  # another adapter in slot 0
    after = lora_cpu.apply_sync(layer, x)
    expected = _per_token_reference(x @ layer.weight.t(), x, layer.lora_a_stacked,
                                    layer.lora_b_stacked, 1.0, slices, [0, 0])
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after)
    calls = []
    monkeypatch.setitem(lora_cpu._VLLMS, "_apply_sync", lambda self, x, bias: calls.append(x))
    for indices in ([0, -1], [0, 1], [-1, -1]):  # mixed, two adapters, base only
        layer.punica_wrapper = _Wrapper(indices)
        layer.punica_wrapper._span_groups = None
        lora_cpu.apply_sync(layer, x)
    assert len(calls) == 3


def test_no_merge_beyond_the_memory_budget(monkeypatch):
    layer = _Layer([0, 0], (OUT,))
    monkeypatch.setitem(lora_cpu._MERGED, "budget", layer.weight.numel())  # < its bytes
    read = []
    monkeypatch.setattr(lora_cpu, "_base_weight", lambda layer: read.append(1))
    assert lora_cpu.merged_linear(layer, 0) is None
    assert lora_cpu.merged_linear(layer, 0) is None
    assert read == []  # over budget: the base weight is not even read back, step after step
    calls = []
    monkeypatch.setitem(lora_cpu._VLLMS, "_apply_sync", lambda self, x, bias: calls.append(1))
    lora_cpu.apply_sync(layer, torch.randn(2, HIDDEN))
    assert calls == [1]
