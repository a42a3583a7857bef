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

from span_workflows.apps.cli import main
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
    run = subprocess.run([sys.executable, "-m", "span_workflows.apps.cli", "run", str(query),
                          "--model", str(merged), "--json"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    [answer] = json.loads(run.stdout)
    assert answer["metrics"]["generated_tokens"] >= 1 and answer["text"].strip()
    # its engine took the options the model records: no link blocks (the base's default
    # links the second document)
    assert answer["metrics"]["prepare_requests"] == 2 and answer["metrics"]["link_requests"] == 0
