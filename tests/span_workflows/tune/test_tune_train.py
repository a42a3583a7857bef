"""``span-workflows tune`` on a tiny budget: the loss falls, a stopped run resumes where it
stopped, the adapter loads, and the merged model is a plain checkpoint the engine serves."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from span_workflows.apps.cli.main import main
from span_workflows.tune.train import ExampleStream, TuneConfig, item_loss, load_base

pytestmark = pytest.mark.engine

TINY = ["--examples", "12", "--accumulate", "3", "--max-doc-tokens", "96", "--max-docs", "3",
        "--rank", "4", "--learning-rate", "2e-3", "--seed", "5"]


def _config() -> TuneConfig:
    return TuneConfig(examples=12, accumulate=3, rank=4, alpha=8, learning_rate=2e-3, seed=5,
                      doc_tokens=(64, 96), docs_per_prompt=(2, 3))


def _mean_loss(model, stream: ExampleStream, items: range) -> float:
    with torch.no_grad():
        return statistics.fmean(float(item_loss(model, stream.item(i))) for i in items)


def test_tune_learns_resumes_merges_and_the_merged_model_serves(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["tune", "--out", str(out), *TINY, "--stop-after", "6"]) == 0
    said = capsys.readouterr().out
    assert "stopped at 6 of 12" in said and "min per 1k examples" in said
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["examples"] == 6 and len(state["losses"]) == 2
    assert not (out / "adapter").exists()
    merged = tmp_path / "merged"
    assert main(["tune", "--out", str(out), *TINY, "--merge", str(merged)]) == 0
    said = capsys.readouterr().out
    assert f"adapter: {out / 'adapter'}" in said and "trained 6 examples" in said
    log = json.loads((out / "adapter" / "training_log.json").read_text())
    assert log["examples"] == 12 and log["losses"][:2] == state["losses"]  # resumed, not redone

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
    # for; the engine serves it (another process)
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    from span_workflows.model import span_defaults

    assert span_defaults(merged) == {"attend": "prefix", "link_blocks": 0}
    query = tmp_path / "q.json"
    docs = [{"user": "The Plyack Mill was built in 1788. " * 3},
            {"user": "The Jueng Library has four reading rooms. " * 3}]
    query.write_text(json.dumps({"g": {"input": [{"system": "Answer briefly."},
                                                 {"plus": docs},
                                                 {"user": "When was the mill built?"}],
                                       "max_tokens": 4, "temperature": 0.0}}))
    run = subprocess.run([sys.executable, "-m", "span_workflows.apps.cli.main", "run", str(query),
                          "--model", str(merged), "--json"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    [answer] = json.loads(run.stdout)
    assert answer["metrics"]["generated_tokens"] >= 1 and answer["text"].strip()
    # its engine took the options the model records: no link blocks (the base's default
    # links the second document)
    assert answer["metrics"]["prepare_requests"] == 2 and answer["metrics"]["link_requests"] == 0


def test_an_agent_turn_is_trained_on_the_prompt_the_engine_runs_for_it(engine) -> None:
    from span_workflows.fragments import lift_messages
    from span_workflows.sampling import Sampling
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
