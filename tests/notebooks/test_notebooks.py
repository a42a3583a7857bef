"""Every notebook in notebooks/ runs top to bottom without errors (nbclient, the venv's kernel).

Each notebook starts its own engine (or server) in its kernel, a separate process, so this
does not touch the session's shared engine. The ``python3`` kernel is the running interpreter:
jupyter_client launches the native kernel spec with ``sys.executable``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 180

pytestmark = pytest.mark.engine


def test_there_are_notebooks():
    names = {p.name for p in PATHS}
    assert {"01_quickstart.ipynb", "04_judge_generator.ipynb", "05_server.ipynb"} <= names


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    client = NotebookClient(
        book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
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
