"""The default engine takes its span store from ``SPAN_WORKFLOWS_SPAN_STORE`` (the engine
itself is stood in for: only the arguments it is built with are checked here; the store on
the real engine is ``tests/span_workflows/runtime/test_engine_store.py``)."""

from __future__ import annotations

import pytest

import span_workflows.runtime.engine as engine_module
from span_workflows import frameworks


@pytest.mark.parametrize(("value", "expected"), [("/data/spans", "/data/spans"), ("", None),
                                                 (None, None)])
def test_the_default_engine_reads_its_span_store_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, value: str | None, expected: str | None) -> None:
    built: dict = {}

    class Recorder:
        model_name = "smollm2-135m-instruct"

        def __init__(self, model=None, **kwargs) -> None:
            built.update(model=model, **kwargs)

    monkeypatch.setattr(engine_module, "Engine", Recorder)
    monkeypatch.setattr(frameworks, "_default_engine", None)
    if value is None:
        monkeypatch.delenv(frameworks.SPAN_STORE_ENV, raising=False)
    else:
        monkeypatch.setenv(frameworks.SPAN_STORE_ENV, value)
    assert isinstance(frameworks.default_engine(), Recorder)
    assert built == {"model": None, "span_store": expected}
