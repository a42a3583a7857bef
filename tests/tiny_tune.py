"""One tiny ``span-workflows tune`` run for the session: a first segment ended by its time budget
(``--hours``: at its first optimizer step, 3 of 12 examples), then resumed to the end with
``--merge``. ``tune/test_tune_train.py`` checks the run; the CLI's
``run`` test serves the merged checkpoint, so one engine start covers both."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TINY = ["--examples", "12", "--accumulate", "3", "--max-doc-tokens", "96", "--max-docs", "3",
        "--rank", "4", "--learning-rate", "2e-3", "--seed", "5"]


@dataclass(frozen=True)
class TinyTuneRun:
    """What the two commands returned and said, and what the stop left behind."""

    out: Path
    merged: Path
    stopped_code: int
    stopped_said: str
    stopped_state: dict[str, Any]
    adapter_after_stop: bool
    finished_code: int
    finished_said: str


def run_tiny_tune(root: Path) -> TinyTuneRun:
    """Train into ``root/run`` (a segment out of time after 3, resumed, merged into
    ``root/merged``)."""
    from span_workflows.apps.cli.main import main

    out, merged = root / "run", root / "merged"
    with redirect_stdout(io.StringIO()) as stopped:
        stopped_code = main(["tune", "--out", str(out), *TINY, "--hours", "1e-9"])
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    adapter_after_stop = (out / "adapter").exists()
    with redirect_stdout(io.StringIO()) as finished:
        finished_code = main(["tune", "--out", str(out), *TINY, "--merge", str(merged)])
    return TinyTuneRun(out, merged, stopped_code, stopped.getvalue(), state, adapter_after_stop,
                       finished_code, finished.getvalue())
