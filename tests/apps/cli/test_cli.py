"""The ``span-workflows`` command line, run as a user runs it (a separate process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from process_leaks import REPORT_AFTER_CLI, leaked_since, shm_names

from span_workflows import rag, to_json

ROOT = Path(__file__).resolve().parents[3]
CLI = [sys.executable, "-m", "span_workflows.apps.cli.main"]
DOCS = [
    "The lighthouse on Gull Rock was built in 1871 and painted red and white.",
    "Keeper Ada Lind kept the Gull Rock light burning for forty-two winters.",
    "The Gull Rock foghorn sounds twice every thirty seconds in thick weather.",
]


def _run(*args: str, timeout: int = 600, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.engine
def test_run_json_shows_the_cache_hit_quietly_and_leaves_nothing_behind(
        tmp_path: Path, tiny_tune_run) -> None:  # type: ignore[no-untyped-def]
    """Two RAG queries in one ``run`` on a model of the user's own (``--model DIR``: the
    checkpoint the session's tiny tuning run merged, ``tiny_tune.py``): the second finds the
    first's documents in another order; the engine takes the span options the model records
    (no link blocks); stderr is one progress line (no vLLM log). Once the command has
    returned, its engine is shut down: no child process is left, no shared memory mapped or
    left in /dev/shm (the process reports on itself, ``process_leaks.REPORT_AFTER_CLI``)."""
    a = _write(tmp_path, "a.json", to_json(rag("Answer briefly.", DOCS, "Who kept the light?",
                                               max_tokens=12)))
    b = _write(tmp_path, "b.json", to_json(rag("Answer briefly.", DOCS[::-1],
                                               "When was it built?", max_tokens=12)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "server"), os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_LOGGING_LEVEL", None)  # what a user's shell has: the CLI quiets vLLM itself
    report = tmp_path / "after.json"
    shm_before = shm_names()
    done = subprocess.run([sys.executable, "-c", REPORT_AFTER_CLI, str(report), "run", str(a),
                           str(b), "--model", str(tiny_tune_run.merged), "--json"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == ["span-workflows: starting the engine..."]
    after = json.loads(report.read_text())
    assert after == {"children_after": [], "shm_mapped_after": []}, after
    assert not leaked_since(shm_before)
    results = json.loads(done.stdout)
    assert [set(r["metrics"]) >= {"ttft_s", "prompt_tokens", "cached_tokens",
                                  "generated_tokens"} for r in results] == [True, True]
    first, second = (r["metrics"] for r in results)
    # The first query computes its documents in prepare requests; the second finds them all.
    assert first["prepare_requests"] == len(DOCS) and second["prepare_requests"] == 0
    # the model records no link blocks (the library's default links every span but the first)
    assert first["link_requests"] == second["link_requests"] == 0
    assert second["cached_tokens"] >= 0.8 * second["prompt_tokens"]
    assert all(r["text"] for r in results)


#: After the command line has set up its logging, vLLM configures its logging as an engine
#: start does (from the environment) and its logger says one line at INFO.
_LOG_PROBE = """
import sys
from span_workflows.apps.cli.main import main
main(sys.argv[1:])
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger
configure_logging_if_needed(LoggingConfig())
init_logger("vllm.probe").info("probe line from vLLM's logger")
"""


def test_vllms_log_lines_show_only_with_verbose(tmp_path: Path) -> None:
    """The command sets vLLM's log level before vLLM is imported: its INFO lines reach stderr
    with ``--verbose`` only (the quiet case on a real engine start is the test above; this
    one needs no engine). The two commands run side by side (each imports vLLM)."""
    query = _write(tmp_path, "q.json", to_json(rag("Answer briefly.", DOCS, "Who?")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    probes = {verbose: subprocess.Popen(
        [sys.executable, "-c", _LOG_PROBE, "compile", str(query),
         *(["--verbose"] if verbose else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for verbose in (False, True)}
    for verbose, probe in probes.items():
        _, stderr = probe.communicate(timeout=300)
        assert probe.returncode == 0, stderr[-2000:]
        assert ("probe line from vLLM's logger" in stderr) is verbose, verbose


def test_compile_prints_the_tree_and_token_form(tmp_path: Path) -> None:
    q = _write(tmp_path, "q.json", to_json(rag("sys", DOCS[:2], "q?")))
    done = _run("compile", str(q))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "+" in done.stdout and "plus" in done.stdout and "cross" in done.stdout


def test_bad_json_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    bad = _write(tmp_path, "bad.json", '{"g": {"input": {"cross": [{"user": "a"}, '
                                       '{"system": "b"}, {"plux": []}]}}}')
    done = _run("run", str(bad))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "input.cross[2]" in done.stderr and "plux" in done.stderr


def test_unavailable_model_is_a_clear_error(tmp_path: Path) -> None:
    q = _write(tmp_path, "q.json", json.dumps(
        {"g": {"model": "spnl/ibm-granite/granite-3.3-2b-instruct", "input": {"user": "hi"},
               "max_tokens": 4, "temperature": 0.0}}))
    done = _run("run", str(q))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not available" in done.stderr and "--model" in done.stderr


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    done = _run("run", str(tmp_path / "nope.json"))
    assert done.returncode == 2 and "nope.json" in done.stderr and "Traceback" not in done.stderr
