"""A quiet, helpful command line: help for every option, the API key out of ``ps``, and one
line for a user mistake, found before the engine starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from span_workflows.apps.cli import main as cli
from span_workflows.compiler.model import DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parents[3]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_option_has_help_text() -> None:
    parser = cli._parser()
    for name, sub in {"": parser, **_subparsers(parser)}.items():
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"span-workflows {name}: {action.dest} has no help text"


def test_bench_help_lists_the_benchmarks_and_their_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name in ("rag", "nested", "reposition", "compile", "locality"):
        assert f"\n  {name} " in out
    for option in ("--docs", "--doc-tokens", "--fanout", "--blocks", "--hay-chars", "--reps"):
        assert option in out


@pytest.mark.parametrize("variable", ["SPAN_WORKFLOWS_API_KEY", "VLLM_API_KEY"])
def test_serve_reads_the_api_key_from_the_environment_and_keeps_it_off_argv(
        monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    started: dict = {}

    class Started(Exception):
        pass

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.update(argv=argv, env=env)
        raise Started

    monkeypatch.delenv("SPAN_WORKFLOWS_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv(variable, "k-from-env")
    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(Started):
        cli.main(["serve", "--port", "8123"])
    assert "--api-key" not in started["argv"] and "k-from-env" not in started["argv"]
    assert started["env"]["VLLM_API_KEY"] == "k-from-env"
    assert DEFAULT_MODEL_NAME in started["argv"]  # served under its short name too


def test_a_query_over_the_context_is_one_line_before_the_engine_starts(tmp_path: Path) -> None:
    query = tmp_path / "long.json"
    query.write_text(json.dumps({"g": {"input": {"user": "word " * 9000}, "max_tokens": 8}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "server"), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "span_workflows.apps.cli.main", "run", str(query)],
                          capture_output=True, text=True, env=env, timeout=600)
    elapsed = time.perf_counter() - started
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"span-workflows: error: {query}: input: query is 9031 tokens (+8 to "
                     "generate), longer than the model's context of 8192 tokens"], done.stderr
    assert done.stdout == ""
    print(f"\nover-long query refused in {elapsed:.1f} s (no engine started)")
