"""Shared fixtures. One real SmolLM2-135M engine serves every test of a pytest run: vLLM's
in-process engine cannot be started twice in one process; one span server serves the HTTP
test modules that need no settings of their own."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not the tests/gpu folder name
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine():
    """The embedded engine (span plugin active), shared by the whole session."""
    from span_workflows.engine import Engine

    eng = Engine(kv_cache_gib=2)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (converts the bundled GGUF on first use)."""
    from transformers import AutoTokenizer

    from span_workflows.model import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(progress=False)))


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory):
    """The span server of :mod:`shared_server`, started on first use, stopped at the end."""
    from shared_server import shared_server_process

    with shared_server_process(tmp_path_factory.mktemp("shared-server") / "server.log") as s:
        yield s
