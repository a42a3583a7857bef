"""Every notebook in notebooks/ runs top to bottom without errors (nbclient, the venv's kernel).

The notebooks on the embedded engine run one after the other in **one** kernel, as a user
working through them does: each asks for the kernel's ``default_engine()``, so vLLM starts
once for all of them (the first notebook pays it). ``05_server`` starts and stops a server of
its own, which is its point, so it gets a kernel of its own. Kernels are separate processes:
the session's shared engine is not touched. The ``python3`` kernel is the running
interpreter: jupyter_client launches the native kernel spec with ``sys.executable``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 180
#: Notebooks that need a kernel of their own (they start and stop a server: their point).
OWN_KERNEL = {"05_server.ipynb"}

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def shared_kernel():  # type: ignore[no-untyped-def]
    """One kernel for the notebooks on the embedded engine, shut down after the last."""
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(NOTEBOOKS))
    try:
        yield manager
    finally:
        manager.shutdown_kernel(now=True)


def test_there_are_notebooks():
    names = {p.name for p in PATHS}
    assert {"01_quickstart.ipynb", "04_judge_generator.ipynb", "05_server.ipynb"} <= names


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path: Path, request: pytest.FixtureRequest) -> None:
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    kernel = None if path.name in OWN_KERNEL else request.getfixturevalue("shared_kernel")
    client = NotebookClient(
        book, timeout=CELL_TIMEOUT_S, kernel_name="python3", km=kernel,
        resources={"metadata": {"path": str(path.parent)}},
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.perf_counter() - started
    errors = [
        out for cell in book.cells if cell.cell_type == "code"
        for out in cell.get("outputs", []) if out.get("output_type") == "error"
    ]
    assert not errors
    print(f"{path.name}: {elapsed:.0f} s")
    keep = os.environ.get("NOTEBOOK_OUTPUT_DIR")  # to look at the executed notebooks
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(book, Path(keep) / path.name)


def test_notebooks_are_committed_small() -> None:
    """Outputs cleared, or at least small: no notebook over 100 kB in the repository."""
    for path in PATHS:
        assert path.stat().st_size < 100_000, f"{path.name} is large: clear its outputs"
