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


def test_install_points_the_cpu_wrapper_at_the_grouped_ops():
    from vllm.lora.punica_wrapper import punica_cpu

    saved = {name: getattr(punica_cpu, name) for name in lora_cpu.OPS}
    try:
        assert lora_cpu.install()
        assert all(getattr(punica_cpu, name) is getattr(lora_cpu, name)
                   for name in lora_cpu.OPS)
    finally:
        for name, op in saved.items():
            setattr(punica_cpu, name, op)
