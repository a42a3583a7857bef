"""``span-workflows tune`` on a tiny budget: the loss falls, a stopped run resumes where it
stopped, the adapter loads, and the merged model is a plain checkpoint (``test_cli`` serves
it)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from tiny_tune import TINY, TinyTuneRun

from span_workflows.apps.cli.main import main
from span_workflows.tune.train import (
    ExampleStream,
    TuneConfig,
    item_loss,
    load_base,
    training_loss,
)

pytestmark = pytest.mark.engine


def _config() -> TuneConfig:
    return TuneConfig(examples=12, accumulate=3, rank=4, alpha=8, learning_rate=2e-3, seed=5,
                      doc_tokens=(64, 96), docs_per_prompt=(2, 3))


def _mean_loss(model, stream: ExampleStream, items: range) -> float:
    with torch.no_grad():
        return statistics.fmean(float(item_loss(model, stream.item(i))) for i in items)


def test_tune_learns_resumes_and_merges(tiny_tune_run: TinyTuneRun, tmp_path: Path,
                                       capsys) -> None:
    run = tiny_tune_run
    out, merged = run.out, run.merged
    assert run.stopped_code == 0
    # out of time (--hours) at its first optimizer step: a checkpoint, no adapter yet
    assert "stopped at 3 of 12" in run.stopped_said and "min per 1k examples" in run.stopped_said
    progress = run.stopped_state["progress"]
    assert progress["examples"] == 3 and len(progress["losses"]) == 1
    assert not run.adapter_after_stop
    assert run.finished_code == 0
    said = run.finished_said
    assert f"adapter: {out / 'adapter'}" in said and "trained 9 examples" in said
    log = json.loads((out / "adapter" / "training_log.json").read_text())
    assert log["examples"] == 12 and log["losses"][:1] == progress["losses"]  # resumed
    assert [s["examples"] for s in log["segments"]] == [[0, 3], [3, 12]]
    # the same adapter on every machine: the base by its name, no model card of local paths
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct"
    assert not (out / "adapter" / "README.md").exists()

    # the loss on the examples it trained on fell; the adapter loads onto the base model
    from peft import PeftModel

    base, tokenizer, _ = load_base(None, "cpu")
    stream = ExampleStream(_config(), tokenizer)
    before = _mean_loss(base.eval(), stream, range(6))
    tuned = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    assert _mean_loss(tuned, stream, range(6)) < before - 0.1

    # further tuning starts from the adapter: a run over the first 3 of the same examples
    # begins at a lower loss than the fresh run did, and its log records the run it continued
    more = tmp_path / "more"
    further = [*TINY[2:], "--examples", "3", "--init-adapter", str(out / "adapter")]
    assert main(["tune", "--out", str(more), *further]) == 0
    capsys.readouterr()
    continued = json.loads((more / "adapter" / "training_log.json").read_text())
    assert continued["losses"][0] < log["losses"][0] - 0.1
    assert [c["examples"] for c in continued["continued"]] == [12]
    assert main(["tune", "--out", str(tmp_path / "other"), *further, "--rank", "8"]) == 2
    said = capsys.readouterr().err
    assert "--init-adapter" in said and "rank 4" in said

    # a run with other settings in the same directory is refused, naming the directory
    assert main(["tune", "--out", str(out), *TINY[:-2], "--seed", "6"]) == 2
    assert "--out" in capsys.readouterr().err

    # the merged checkpoint is a plain model that records the span options it was trained
    # for (tests/apps/cli/test_cli.py serves it: an engine on it takes those options)
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    from span_workflows.compiler.model import span_defaults

    assert span_defaults(merged) == {"attend": "prefix", "link_blocks": 0}


def test_an_agent_turn_is_trained_on_the_prompt_the_engine_runs_for_it(engine) -> None:
    from span_workflows.query.lift import lift_messages
    from span_workflows.query.sampling import Sampling
    from span_workflows.tune.tool_data import make_tool_examples
    from span_workflows.tune.train import TRAINED_OPTIONS

    config = TuneConfig(examples=40, seed=2, span_share=0.0, text_share=0.0, tool_share=1.0,
                        block_sizes=(engine.compiler.block_size,))
    stream = ExampleStream(config, engine.tokenizer)
    turns = make_tool_examples(40, seed=2)
    checked = 0
    for i in (0, 1, 2, 3, 4, 5):
        item, turn = stream.item(i), turns[i]
        query = lift_messages(turn.messages, max_tokens=len(item.answer_ids),
                              sampling=Sampling(tools=turn.tools, used_tools=turn.used))
        ran = engine.compile(query, span_options=dict(TRAINED_OPTIONS))
        assert item.form == "span" and item.query.token_ids == ran.token_ids
        assert engine.tokenizer.decode(item.answer_ids[:-1]) == turn.answer
        checked += "You can call these tools:" in engine.tokenizer.decode(ran.token_ids)
    assert checked == 6


def test_distillation_starts_at_zero_in_stock_form_and_teaches_span_form() -> None:
    """KL(base on the stock prompt || adapter) on the answer: a fresh adapter *is* the base, so
    a stock-form item's KL is 0 and its loss the weighted cross-entropy; a span-form item of
    the same stream reads its documents apart, so its KL is what distillation trains away."""
    from peft import LoraConfig, get_peft_model

    from span_workflows.tune.train import TARGET_MODULES

    config = TuneConfig(examples=24, seed=7, rank=4, alpha=8, doc_tokens=(64, 128),
                        docs_per_prompt=(3, 4), text_share=0.0, tool_share=0.0,
                        span_share=0.5, ce_weight=0.5, kl_weight=2.0)
    base, tokenizer, _ = load_base(None, "cpu")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=list(TARGET_MODULES),
                                            task_type="CAUSAL_LM")).eval()
    stream = ExampleStream(config, tokenizer)
    items = [stream.item(i) for i in range(len(stream))]
    stock = next(i for i in items if i.form == "stock")
    span = next(i for i in items if i.form == "span")
    assert stock.teacher_ids == stock.prompt_ids and len(span.teacher_ids) > 0
    with torch.no_grad():
        loss, ce, kl = training_loss(model, stock, config)
        assert abs(kl) < 1e-5 and abs(float(loss) - 0.5 * ce) < 1e-4
        loss, ce, kl = training_loss(model, span, config)
        assert kl > 1e-3 and abs(float(loss) - (0.5 * ce + 2.0 * kl)) < 1e-3
        assert abs(ce - float(item_loss(model, span))) < 1e-4
        # no teacher without a KL weight: the KL term is reported as 0
        plain = TuneConfig(**{**config.__dict__, "kl_weight": 0.0, "ce_weight": 1.0})
        assert training_loss(model, span, plain)[2] == 0.0


def test_a_recipe_run_logs_itself_and_resumes_its_log(tmp_path: Path, capsys) -> None:
    out = tmp_path / "recipe"
    small = ["--recipe", "default", "--examples", "6", "--accumulate", "3", "--max-docs", "3",
             "--max-doc-tokens", "96", "--rank", "4", "--seed", "3", "--dev-questions", "2"]
    assert main(["tune", "--out", str(out), *small, "--stop-after", "3"]) == 0
    first = json.loads((out / "training_log.json").read_text())
    assert first["recipe"] == "default" and first["examples"] == 3 and first["of"] == 6
    assert first["config"]["kl_weight"] == 1.0 and first["config"]["ce_weight"] == 0.5
    assert first["config"]["docs_per_prompt"] == [2, 3]  # a flag given overrides the recipe
    assert re.fullmatch(r"[0-9a-f]{64}", first["data_sha256"])
    commit = r"([0-9a-f]{12}(\+dirty)?|unknown)"
    assert re.fullmatch(commit, first["commit"])
    assert {"torch", "transformers", "peft"} <= set(first["packages"])
    assert len(first["losses"]) == len(first["ce"]) == len(first["kl"]) == 1
    assert first["seconds_per_1k"] > 0
    # the segment this process trained, and a point of the dev-set learning curve
    (segment,) = first["segments"]
    assert segment["examples"] == [0, 3] and 0 < segment["seconds"] <= first["seconds"]
    assert re.fullmatch(commit, segment["commit"]) and segment["machine"]
    (point,) = first["dev"]
    assert point["examples"] == 3 and point["questions"] == 2
    assert all(0 <= point[k] <= 1 for k in ("span", "base_stock", "base_span"))
    assert sum(total for _, total in point["span_by_layout"].values()) == 2
    base = json.loads((out / "dev_base.json").read_text())  # the base scored once per run
    assert (base["stock"], base["span"]) == (point["base_stock"], point["base_span"])
    capsys.readouterr()
    assert main(["tune", "--out", str(out), *small]) == 0
    log = json.loads((out / "adapter" / "training_log.json").read_text())
    assert log["examples"] == 6 and log["losses"][:1] == first["losses"]
    assert log["data_sha256"] == first["data_sha256"] and log["seconds"] > first["seconds"]
    assert log == json.loads((out / "training_log.json").read_text())
    assert [s["examples"] for s in log["segments"]] == [[0, 3], [3, 6]]
    assert log["segments"][0] == segment and [p["examples"] for p in log["dev"]] == [3, 6]
    assert log["dev"][1]["base_stock"] == point["base_stock"]
    capsys.readouterr()
    for bad, flag in ((["--kl-weight", "-1"], "--kl-weight"),
                      (["--kl-weight", "0", "--ce-weight", "0"], "--kl-weight")):
        assert main(["tune", "--out", str(tmp_path / "bad"), *small, *bad]) == 2
        assert flag in capsys.readouterr().err
