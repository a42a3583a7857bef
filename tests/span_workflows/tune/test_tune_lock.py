"""A training run holds the machine's training lock while it trains; benchmarks wait for a
live run and ignore (and remove) the lock of a dead one."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from span_workflows.tune import lock


@pytest.fixture
def lock_file(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("SPAN_WORKFLOWS_CACHE", str(tmp_path))
    monkeypatch.delenv("SPAN_WORKFLOWS_TUNE_LOCK", raising=False)  # (the suite's own lock)
    return tmp_path / lock.LOCK_NAME


def _trainer() -> subprocess.Popen:
    """A process whose command line says ``tune``, as a training run's does."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "tune"])


def test_a_run_holds_the_lock_while_it_trains_and_never_waits_for_itself(
        lock_file: Path, tmp_path: Path) -> None:
    with lock.holding(tmp_path / "run"):
        held = json.loads(lock_file.read_text())
        assert held["out"] == str((tmp_path / "run").resolve())
        assert lock.running() is None  # this process's own run
        assert lock.wait_for_training(poll=0.01, timeout=1.0) < 0.5
    assert not lock_file.exists()


def test_benchmarks_wait_for_a_live_run_and_not_for_a_dead_one(lock_file: Path) -> None:
    trainer = _trainer()
    try:
        lock_file.write_text(json.dumps({"pid": trainer.pid, "out": "/runs/a",
                                         "started": "2026-12-07T15:00:00+00:00"}))
        assert lock.running()["pid"] == trainer.pid
        said: list[str] = []
        assert lock.wait_for_training(said.append, poll=0.05, timeout=0.3) >= 0.3
        assert len(said) == 1 and "/runs/a" in said[0] and "--no-wait" in said[0]
        threading.Timer(0.3, trainer.kill).start()  # the segment ends
        waited = lock.wait_for_training(said.append, poll=0.05, timeout=20.0)
        assert 0.2 < waited < 20.0
    finally:
        trainer.kill()
        trainer.wait()
    assert not lock_file.exists()  # the dead run's lock went with it
    # a recycled process id that is no training run holds nothing
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_file.write_text(json.dumps({"pid": other.pid, "out": "/runs/b", "started": ""}))
        assert lock.running() is None
    finally:
        other.kill()
        other.wait()


def test_bench_waits_unless_told_not_to(lock_file: Path, monkeypatch) -> None:
    from span_workflows.apps.bench import run

    waited: list[bool] = []
    monkeypatch.setattr(lock, "wait_for_training", lambda: waited.append(True) or 0.0)
    monkeypatch.setattr("span_workflows.apps.bench.store.run_store", lambda argv: len(argv))
    assert run.run_bench("store", ["--no-wait", "--x"]) == 1 and waited == []
    assert run.run_bench("store", ["--x"]) == 1 and waited == [True]
    # asking for help measures nothing: it never waits for a run
    assert run.run_bench("store", ["--help"]) == 1 and waited == [True]
