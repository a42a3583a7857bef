"""``model=`` of the framework models chooses what the process's default engine serves; a
second, different model in one process is refused with a message naming both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from span_workflows import frameworks
from span_workflows.compiler.model import DEFAULT_MODEL_NAME


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A process whose default engine already serves the model at /models/a."""
    engine = SimpleNamespace(model_name="/models/a")
    monkeypatch.setattr(frameworks, "_default_engine", engine)
    return engine


def test_the_loaded_model_is_served_to_whoever_asks_for_it_or_for_none(loaded) -> None:
    assert frameworks.default_engine("/models/a") is loaded
    assert frameworks.default_engine(None) is loaded


def test_another_model_is_refused_naming_both(loaded) -> None:
    with pytest.raises(ValueError, match=r"already runs an engine for '/models/a'.*"
                                         r"model '/models/b' cannot be loaded too"):
        frameworks.default_engine("/models/b")
    with pytest.raises(ValueError, match=f"not the default model '{DEFAULT_MODEL_NAME}'"):
        frameworks.default_engine(DEFAULT_MODEL_NAME)
