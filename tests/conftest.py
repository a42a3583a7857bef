"""Shared fixtures. One real SmolLM2-135M engine serves every test of a pytest run: vLLM's
in-process engine cannot be started twice in one process; one span server serves the HTTP
test modules that need no settings of their own."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
from startups import StartupCounter

from span_vllm.contract import START_LOG_ENV

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every vLLM engine core this run starts, in any process, appends a line here (the plugin)
_LOG = Path(tempfile.gettempdir()) / f"span-vllm-starts-{os.getpid()}-{time.time_ns()}.log"
os.environ[START_LOG_ENV] = str(_LOG)
# the suite's own training lock: a training run on this machine never holds up its benchmarks
os.environ["SPAN_WORKFLOWS_TUNE_LOCK"] = str(
    Path(tempfile.gettempdir()) / f"span-tests-tune-{os.getpid()}.lock")
STARTUPS = StartupCounter(_LOG)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    before = STARTUPS.count()
    yield
    STARTUPS.attribute(item.nodeid, before)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    STARTUPS.add_time(report.nodeid, report.duration)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("vLLM start-ups")
    for line in STARTUPS.summary_lines():
        terminalreporter.write_line(line)
    report = os.environ.get("SPAN_TEST_REPORT")
    if report:
        STARTUPS.write_report(Path(report))
        terminalreporter.write_line(f"report written to {report} "
                                    f"(python tests/timing_report.py {report})")
    _LOG.unlink(missing_ok=True)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


#: The modules that fill the small pool, then the one that kills that server and restarts it
#: in the shared settings (``shared_server``): they run first, in this order, so that the
#: session starts its HTTP server twice, not three times.
SMALL_POOL_FIRST = ("reliability/test_cache_pressure.py", "reliability/test_isolation_http.py",
                    "reliability/test_faults.py")


def _small_pool_rank(item: pytest.Item) -> int:
    path = item.path.as_posix()
    for rank, module in enumerate(SMALL_POOL_FIRST):
        if path.endswith("/" + module):
            return rank
    return len(SMALL_POOL_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_small_pool_rank)  # stable: every other test keeps its place
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not the tests/gpu folder name
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine():
    """The embedded engine (span plugin active), shared by the whole session."""
    from span_workflows.runtime.engine import Engine

    eng = Engine(kv_cache_gib=2)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (converts the bundled GGUF on first use)."""
    from span_workflows.compiler.model import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def attention_reference():
    """The Hugging Face model of the default weights with span attention masks
    (:class:`attention_reference.AttentionReference`, the tests' own), loaded once."""
    from attention_reference import AttentionReference

    return AttentionReference()


@pytest.fixture(scope="session")
def server_slot(tmp_path_factory: pytest.TempPathFactory):
    """The session's span server slot (:class:`shared_server.ServerSlot`), stopped at the end."""
    from shared_server import ServerSlot

    slot = ServerSlot(tmp_path_factory.mktemp("server"))
    yield slot
    slot.stop()


@pytest.fixture(scope="module")
def shared_server(server_slot):
    """The session's server in the shared settings (:data:`shared_server.SHARED`)."""
    from shared_server import SHARED

    return server_slot.use(SHARED).shared


@pytest.fixture(scope="session")
def tiny_tune_run(tmp_path_factory: pytest.TempPathFactory):
    """The session's tiny tuning run and its merged checkpoint (:mod:`tiny_tune`)."""
    from tiny_tune import run_tiny_tune

    return run_tiny_tune(tmp_path_factory.mktemp("tiny-tune"))
