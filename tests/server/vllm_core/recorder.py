"""pytest plugin for vLLM's own core tests run by :mod:`run`: activates the span plugin the
way vLLM would (``span_vllm.register()``, inert unless ``SPAN_VLLM=1``) and records each
test's outcome — and, for a failure, whether it is span mode refusing the model at start —
to the JSON file named by ``SPAN_CORE_RECORD``."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest

_results: dict[str, dict[str, Any]] = {}

#: Frames of span mode's start-time checks (file, function): refusing there is "at start".
START_FRAMES = {("patches.py", "__init__"), ("patches.py", "_tracker"),
                ("worker.py", "build_rotation")}
#: Frames that mean a request is being served: a refusal there is too late.
REQUEST_FRAMES = {"allocate_slots", "schedule", "_update_states", "update_requests",
                  "execute_model", "get_computed_blocks"}


def pytest_configure(config: pytest.Config) -> None:
    import span_vllm

    span_vllm.register()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # vLLM's conftest tears the distributed state and torch.compile down after every test
    # unless told not to; these CPU unit tests need neither (both runs skip it alike).
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


def _refusal(excinfo: pytest.ExceptionInfo) -> dict[str, Any] | None:
    exc = excinfo.value
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    refusal = next((e for e in chain if type(e).__name__ == "UnsupportedModelError"), None)
    if refusal is None:
        return None
    frames = traceback.extract_tb(refusal.__traceback__)
    names = {(Path(f.filename).name, f.name) for f in frames}
    functions = {f.name for f in frames}
    return {"stage": getattr(refusal, "stage", ""),
            "problems": list(getattr(refusal, "problems", [])),
            "at_start": bool(names & START_FRAMES) and not functions & REQUEST_FRAMES}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        entry: dict[str, Any] = {"outcome": report.outcome}
        if call.excinfo is not None and report.failed:
            entry["error"] = call.excinfo.typename
            entry["message"] = str(call.excinfo.value).splitlines()[0][:300] if str(
                call.excinfo.value) else ""
            entry["refusal"] = _refusal(call.excinfo)
        _results[item.nodeid] = entry


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("SPAN_CORE_RECORD")
    if path:
        Path(path).write_text(json.dumps(_results, indent=1, sort_keys=True))
