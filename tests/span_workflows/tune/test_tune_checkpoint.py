"""A tuning run's checkpoint: what is restored equals what was saved (the moments to bfloat16's
precision), training goes on as if never stopped, the recipe's checkpoint fits 40 MB, and a
checkpoint of another format is refused; SIGTERM and Ctrl-C ask for a stop at the next step."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from span_workflows.errors import SpanQueryError
from span_workflows.tune import checkpoint as ckpt
from span_workflows.tune.train import TARGET_MODULES, TuneConfig, _lr_lambda, _StopRequest


def _run(config_model, rank: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A fresh peft model on a base built from ``config_model`` (its weights drawn from
    ``seed``), its optimizer and schedule."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(config_model)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=list(TARGET_MODULES),
                                            task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(TuneConfig(examples=80, accumulate=8)))
    return model, params, optimizer, schedule


def _tiny_llama():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _step(model, params, optimizer, schedule, seed: int) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, 12), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)


def test_a_restored_run_goes_on_as_if_never_stopped(tmp_path: Path) -> None:
    config = {"examples": 80}
    model, params, optimizer, schedule = _run(_tiny_llama(), rank=4)
    for seed in range(3):
        _step(model, params, optimizer, schedule, seed)
    progress = ckpt.RunState(examples=24, losses=[3.0, 2.5, 2.0], seconds=12.5,
                             segments=[{"examples": [0, 24]}], dev=[{"examples": 24}])
    ckpt.save(tmp_path / "checkpoint", model, optimizer, schedule, config, None, progress)
    after_save = torch.rand(4)  # the random state moves on; the restored one starts over

    # a new process: the same frozen base (loaded from the same weights), a fresh adapter
    fresh, fresh_params, fresh_optimizer, fresh_schedule = _run(_tiny_llama(), rank=4)
    with torch.no_grad():
        for param in fresh_params:
            param.add_(torch.randn_like(param))
    loaded = ckpt.load_state(tmp_path / "checkpoint", config, None)
    assert loaded == progress
    ckpt.restore(tmp_path / "checkpoint", fresh, fresh_optimizer, fresh_schedule)
    assert torch.equal(torch.rand(4), after_save)
    for mine, theirs in zip(params, fresh_params, strict=True):
        assert torch.equal(mine, theirs)  # the weights as trained, float32
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    for index, entry in saved["state"].items():
        again = restored["state"][index]
        assert float(again["step"]) == float(entry["step"]) == 3.0
        for name in ("exp_avg", "exp_avg_sq"):  # bfloat16: 8 bits of mantissa
            assert again[name].dtype == torch.float32
            torch.testing.assert_close(again[name], entry[name], rtol=2 ** -8, atol=0.0)
    assert fresh_schedule.state_dict() == schedule.state_dict()
    # the next step of both runs lands on the same weights, to the moments' precision: a step
    # moves a weight by up to the learning rate (1e-2), bfloat16 moments change that by at
    # most 2**-7 of it (a step from another state differs by the whole step)
    _step(model, params, optimizer, schedule, 3)
    _step(fresh, fresh_params, fresh_optimizer, fresh_schedule, 3)
    for mine, theirs in zip(params, fresh_params, strict=True):
        torch.testing.assert_close(theirs, mine, rtol=0.0, atol=1e-4)


def test_the_recipe_checkpoint_fits_forty_megabytes(tmp_path: Path) -> None:
    """Rank 16 on the seven projections of SmolLM2-135M's 30 layers (shapes from the bundled
    model's config), after an optimizer step: the committed checkpoint is at most 40 MB."""
    from transformers import AutoConfig, LlamaConfig

    from span_workflows.compiler.model import BASE_MODEL_NAME, resolve_model
    from span_workflows.tune.train import RECIPES

    real = AutoConfig.from_pretrained(str(resolve_model(BASE_MODEL_NAME, progress=False)))
    shapes = LlamaConfig(vocab_size=64, hidden_size=real.hidden_size,
                         intermediate_size=real.intermediate_size,
                         num_hidden_layers=real.num_hidden_layers,
                         num_attention_heads=real.num_attention_heads,
                         num_key_value_heads=real.num_key_value_heads)
    model, params, optimizer, schedule = _run(shapes, rank=RECIPES["default"].rank)
    _step(model, params, optimizer, schedule, 0)
    ckpt.save(tmp_path / "checkpoint", model, optimizer, schedule, {}, None, ckpt.RunState())
    size = sum(f.stat().st_size for f in (tmp_path / "checkpoint").iterdir())
    trained = sum(p.numel() for p in params)
    assert trained > 4_500_000  # the recipe's adapter, not a toy
    assert 6 * trained < size <= 40_000_000


def test_a_checkpoint_of_another_format_or_config_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text(json.dumps({"config": {}, "examples": 8}))
    with pytest.raises(SpanQueryError) as refused:
        ckpt.load_state(checkpoint, {}, None)
    assert refused.value.path == "--out" and "format 1" in str(refused.value)
    model, _, optimizer, schedule = _run(_tiny_llama(), rank=2)
    ckpt.save(checkpoint, model, optimizer, schedule, {"examples": 8}, None, ckpt.RunState())
    with pytest.raises(SpanQueryError, match="other settings"):
        ckpt.load_state(checkpoint, {"examples": 9}, None)
    assert ckpt.load_state(tmp_path / "none", {}, None) is None


def test_sigterm_and_ctrl_c_ask_for_a_stop_and_a_second_one_stops_at_once() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with _StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs in the main thread between bytecodes
        assert stop.requested  # and the process lives on
        with pytest.raises(KeyboardInterrupt):  # a second signal: Ctrl-C's own behaviour
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_run_whose_examples_changed_is_not_resumed(tmp_path: Path) -> None:
    from span_workflows.tune.train import _check_same_data

    log = tmp_path / "training_log.json"
    _check_same_data(log, "a" * 64)  # no log yet: a fresh run
    log.write_text(json.dumps({"data_sha256": "a" * 64}))
    _check_same_data(log, "a" * 64)
    with pytest.raises(SpanQueryError, match="other examples") as refused:
        _check_same_data(log, "b" * 64)
    assert refused.value.path == "--out"
