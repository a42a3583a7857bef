"""Every notebook in notebooks/ runs top to bottom without errors.

The notebooks on the embedded engine run one after the other in **one** IPython shell inside
this process, as a user working through them in one kernel does: each asks for
``default_engine()``, which here is the session's shared engine (the ``engine`` fixture), so
they start no vLLM of their own. ``05_server`` is about calling a server: it runs in a real
Jupyter kernel (nbclient, the venv's ``python3`` kernel spec) against the session's shared
server, which it is pointed at with ``SPAN_WORKFLOWS_SERVER`` (a user without one set gets a
server the notebook starts and stops itself).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from shared_server import API_KEY

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 180
#: Notebooks that run in a Jupyter kernel of their own, against the shared server.
IN_A_KERNEL = {"05_server.ipynb"}

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def shell(engine: Any) -> Any:
    """One IPython shell for the notebooks on the embedded engine, whose
    ``default_engine()`` is the session's engine."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from span_workflows.frameworks import set_default_engine

    set_default_engine(engine)
    config = Config()
    config.HistoryManager.enabled = False  # no history database in the user's home
    return InteractiveShell(config=config)  # a shell of its own, not the process-wide one


def _code_cells(path: Path) -> list[str]:
    import nbformat

    book = nbformat.read(path, as_version=4)
    return [cell.source for cell in book.cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    names = {p.name for p in PATHS}
    assert {"01_quickstart.ipynb", "04_judge_generator.ipynb", "05_server.ipynb"} <= names


@pytest.mark.parametrize("path", [p for p in PATHS if p.name not in IN_A_KERNEL],
                         ids=lambda p: p.stem)
def test_notebook_runs(path: Path, request: pytest.FixtureRequest,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    shell = request.getfixturevalue("shell")
    monkeypatch.chdir(path.parent)  # as Jupyter starts a notebook's kernel
    started = time.perf_counter()
    for number, source in enumerate(_code_cells(path), start=1):
        result = shell.run_cell(source, store_history=False, silent=False)
        error = result.error_before_exec or result.error_in_exec
        assert result.success, f"{path.name}, code cell {number}: {error!r}"
    print(f"{path.name}: {time.perf_counter() - started:.0f} s")


def test_the_server_notebook_runs_in_a_kernel(shared_server: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    path = NOTEBOOKS / "05_server.ipynb"
    monkeypatch.setenv("SPAN_WORKFLOWS_SERVER", shared_server.url)  # the kernel inherits it
    monkeypatch.setenv("SPAN_WORKFLOWS_API_KEY", API_KEY)
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [out for cell in book.cells if cell.cell_type == "code"
               for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    printed = "".join(out.get("text", "") for out in outputs)
    assert f"using the server at {shared_server.url}" in printed
    assert "span_" in printed  # the span counters of /metrics
    keep = os.environ.get("NOTEBOOK_OUTPUT_DIR")  # to look at the executed notebook
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(book, Path(keep) / path.name)


def test_notebooks_are_committed_small() -> None:
    """Outputs cleared, or at least small: no notebook over 100 kB in the repository."""
    for path in PATHS:
        assert path.stat().st_size < 100_000, f"{path.name} is large: clear its outputs"
