"""Every engine core that starts appends one line to the start log (how the suite counts
vLLM start-ups, in any process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from span_vllm.contract import START_LOG_ENV, note_start


def test_each_start_is_one_line_naming_its_process_and_model(tmp_path: Path,
                                                             monkeypatch) -> None:
    log = tmp_path / "starts.log"
    monkeypatch.setenv(START_LOG_ENV, str(log))
    note_start("model-a")
    note_start("model-b")
    assert log.read_text().splitlines() == [f"{os.getpid()}\tmodel-a", f"{os.getpid()}\tmodel-b"]
    monkeypatch.delenv(START_LOG_ENV)
    note_start("model-c")  # no log asked for: nothing written anywhere
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.engine
def test_the_in_process_engine_core_noted_its_start(engine) -> None:
    lines = Path(os.environ[START_LOG_ENV]).read_text().splitlines()
    mine = [line for line in lines if line.split("\t")[0] == str(os.getpid())]
    assert len(mine) == 1 and str(engine.model_dir) in mine[0]
