"""The plugin's block-alignment logits processor on its own (vLLM's batch-update protocol, a
tiny vocabulary); the real engine runs it in tests/span_workflows/runtime/test_engine_align.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from span_vllm import contract
from span_vllm.align import BlockAlignLogitsProcessor, parse_spec

BS, VOCAB, PAD, STOP, END = 4, 8, 5, 6, 2


def _processor() -> BlockAlignLogitsProcessor:
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS))
    return BlockAlignLogitsProcessor(config, torch.device("cpu"), False)


def _params(budget: int = 10, bias: dict | None = None, aligned: bool = True):
    extra = contract.align_args(PAD, STOP, [END], budget, bias) if aligned else {}
    return SimpleNamespace(extra_args=extra)


def _add(proc, *requests) -> None:
    proc.update_state(BatchUpdate(batch_size=len(requests), removed=[], moved=[],
                                  added=list(requests)))


def _step(proc, rows: int, logits: torch.Tensor | None = None) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB) if logits is None else logits.clone()
    proc.update_state(None)
    return proc.apply(logits)


def _forced(row: torch.Tensor) -> int | None:
    finite = torch.isfinite(row).nonzero().flatten().tolist()
    return finite[0] if len(finite) == 1 else None


def test_the_text_runs_free_then_pads_fill_the_block_and_the_stop_token_ends_it() -> None:
    proc = _processor()
    out: list[int] = []
    _add(proc, (0, _params(), [9, 9, 9], out))  # a 3-token prompt
    row = _step(proc, 1)[0]
    assert row[STOP] == float("-inf") and torch.isfinite(row[:STOP]).all()  # text: no stop
    out += [1, 3, END]  # the text ends: prompt + output = 6 tokens, the block ends at 8
    assert _forced(_step(proc, 1)[0]) == PAD  # position 6
    out.append(PAD)
    assert _forced(_step(proc, 1)[0]) == PAD  # position 7
    out.append(PAD)
    assert _forced(_step(proc, 1)[0]) == STOP  # position 8 starts a block: 0..7 computed


def test_a_text_that_fills_its_block_gets_the_stop_token_at_once() -> None:
    proc = _processor()
    out = [1, 1, 1, END]  # 4-token prompt + 4 = two whole blocks
    _add(proc, (0, _params(), [9, 9, 9, 9], out))
    assert _forced(_step(proc, 1)[0]) == STOP


def test_a_text_that_reaches_its_budget_is_filled_too() -> None:
    proc = _processor()
    out = [1, 1]
    _add(proc, (0, _params(budget=3), [9], out))
    assert _forced(_step(proc, 1)[0]) is None
    out.append(1)  # budget reached, no end token: positions 4.. are fill
    assert _forced(_step(proc, 1)[0]) == STOP  # 1 + 3 = 4: the block is whole


def test_only_requests_with_the_key_are_touched_and_moves_keep_their_state() -> None:
    proc = _processor()
    aligned, plain = [1, END], [1, END]
    _add(proc, (0, _params(aligned=False), [9], plain), (1, _params(), [9], aligned))
    logits = torch.randn(2, VOCAB)
    after = _step(proc, 2, logits)
    assert torch.equal(after[0], logits[0])
    assert _forced(after[1]) == PAD  # 1 + 2 = 3: one pad to the block end
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[],
                                  moved=[(0, 1, MoveDirectionality.SWAP)]))
    after = proc.apply(logits.clone())
    assert _forced(after[0]) == PAD and torch.equal(after[1], logits[1])
    proc.update_state(BatchUpdate(batch_size=1, removed=[0], added=[], moved=[]))
    assert not proc.requests


def test_the_bias_raises_an_ending_that_fills_the_block_and_lowers_one_just_after() -> None:
    bias = {"boost": 3.0, "min_prob": 0.2, "window": 2}
    proc = _processor()
    out = [1, 1]  # prompt 1 + 2: the token sampled now is at position 3, the block's last
    _add(proc, (0, _params(bias=bias), [9], out))
    likely = torch.zeros(1, VOCAB)
    likely[0, END] = 2.0  # p(end) ~ 0.5 >= 0.2: raised
    assert _step(proc, 1, likely)[0, END] == pytest.approx(5.0)
    unlikely = torch.zeros(1, VOCAB)
    unlikely[0, END] = -5.0  # p(end) < 0.2: left alone
    assert _step(proc, 1, unlikely)[0, END] == pytest.approx(-5.0)
    out.append(1)  # position 4: first of a block, inside the window: lowered
    assert _step(proc, 1, likely)[0, END] == pytest.approx(-1.0)
    out += [1, 1]  # position 6: past the window, not a block end: untouched
    assert _step(proc, 1, likely)[0, END] == pytest.approx(2.0)


def test_malformed_specs_are_refused_by_name() -> None:
    good = contract.align_args(PAD, STOP, [END], 4)[contract.ALIGN_KEY]
    assert parse_spec(good)["budget"] == 4
    for broken, word in [({**good, "pad": "x"}, "pad"), ({**good, "ends": []}, "ends"),
                         ({**good, "stop": END}, "stop"), ({**good, "bias": {"boost": 1}},
                                                           "bias")]:
        with pytest.raises(ValueError, match=word):
            parse_spec(broken)
    params = SimpleNamespace(extra_args={contract.ALIGN_KEY: good}, ignore_eos=True,
                             stop_token_ids=[1])
    with pytest.raises(ValueError, match="stop_token_ids"):
        BlockAlignLogitsProcessor.validate_params(params)
