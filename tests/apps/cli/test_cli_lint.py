"""``span-workflows lint``, run as a user runs it (a separate process): the table, --json, the
exit status (0 clean, 1 flagged, 2 a user error); and --trials on the real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from span_workflows import to_json
from span_workflows.query.builders import fragment, g, system, user
from span_workflows.query.ir import Plus

CLI = [sys.executable, "-m", "span_workflows.apps.cli.main"]
STEPS = ["Step 1: Preheat the oven to 200 °C.", "Step 2: Put the dough in a tin.",
         "Step 3: Bake for forty minutes."]
DOCS = ["The Gull Rock lighthouse was built in 1871 and is painted red and white.",
        "Keeper Ada Lind kept the Gull Rock light burning for forty-two winters.",
        "The Gull Rock foghorn sounds twice every thirty seconds in thick weather."]


def _query(texts: list[str], question: str) -> str:
    return to_json(g([system("Answer the question using only the texts. Be brief."),
                      Plus(tuple(fragment(t) for t in texts)), user(question)],
                     max_tokens=24, temperature=0.0))


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {"steps": tmp_path / "steps.json", "docs": tmp_path / "docs.json"}
    paths["steps"].write_text(_query(STEPS, "What is the last step?"))
    paths["docs"].write_text(_query(DOCS, "Who kept the Gull Rock light?"))
    return paths


def test_a_flagged_plus_exits_1_with_its_path_rule_and_evidence(files) -> None:
    done = _run("lint", str(files["steps"]), str(files["docs"]))
    assert done.returncode == 1, done.stderr[-2000:]
    out = done.stdout
    assert "input.cross[1]" in out and "sibling-numbering" in out and "flagged" in out
    assert "step 1" in out and "steps.json" in out and "docs.json" in out
    assert "2 pluses, 1 flagged" in out and "Traceback" not in done.stderr


def test_a_clean_query_exits_0_and_json_is_for_programs(files) -> None:
    done = _run("lint", str(files["docs"]), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    [report] = json.loads(done.stdout)
    assert report["file"] == str(files["docs"]) and report["verdict"] == "clean"
    assert report["pluses"][0]["path"] == "input.cross[1]" and report["trials"] == 0


@pytest.mark.parametrize("args, where", [
    (["--trials", "1"], "--trials"),
    (["--answer-tokens", "0", "--trials", "2"], "--answer-tokens"),
])
def test_bad_options_are_one_line_and_exit_2(files, args: list[str], where: str) -> None:
    done = _run("lint", str(files["docs"]), *args)
    assert done.returncode == 2 and where in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_bad_json_and_a_missing_file_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"g": {"input": {"cross": [{"user": "a"}, {"plux": []}]}}}')
    done = _run("lint", str(bad))
    assert done.returncode == 2 and "input.cross[1]" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    done = _run("lint", str(tmp_path / "nope.json"))
    assert done.returncode == 2 and "nope.json" in done.stderr


@pytest.mark.engine
def test_trials_run_the_order_check_on_the_engine(files, engine, monkeypatch, capsys) -> None:
    """In this process, on the session's engine (a second vLLM engine cannot start here): the
    command's own code from the options to the JSON."""
    from span_workflows.apps.cli.main import main

    class SessionEngine:
        """What ``lint --trials`` starts, answered by the session's engine."""

        def __init__(self, *args, **kwargs) -> None:
            self.args = args

        def __getattr__(self, name: str):
            return getattr(engine, name)

        def close(self) -> None:  # the session's engine outlives the command
            pass

    monkeypatch.setattr("span_workflows.runtime.engine.Engine", SessionEngine)
    code = main(["lint", str(files["steps"]), str(files["docs"]), "--trials", "2",
                 "--answer-tokens", "12", "--json"])
    steps, docs = json.loads(capsys.readouterr().out)
    assert code == 1
    for report in (steps, docs):
        assert report["trials"] == 2 and report["model"] == engine.model_name
        check = report["pluses"][0]["order_check"]
        assert check["orders"] == 2 and check["controls"] == 2 and all(check["answers"])
        assert set(check) >= {"agreement", "control_agreement", "kl", "control_kl",
                              "order_sensitive", "seconds"}
    assert steps["verdict"] == "flagged"  # the static error stands whatever the check says
