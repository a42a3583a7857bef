"""Where a benchmark row comes from: commit, model and adapters (with checksums), machine.

Every committed table in ``benchmarks/results`` should say what produced it; the benches add
:func:`provenance` to each row they write (``reps`` is the bench's own repetition count).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from span_workflows import build_info
from span_workflows.apps.bench.options import REPOSITORY, RESULTS

#: The fields :func:`provenance` adds that tables printed to a terminal leave out.
QUIET_FIELDS = ("commit", "machine", "model_dir", "adapters")

#: The machine a row was measured on (CPU, cores, torch and vLLM versions), in one line.
machine = build_info.machine


def commit() -> str:
    """The repository's commit, ``+dirty`` when tracked files other than the results
    (``benchmarks/results``, which benchmarks run one after another rewrite) differ from it;
    ``unknown`` outside a git checkout."""
    return build_info.commit((str(RESULTS.relative_to(REPOSITORY)),))


def provenance(engine: Any = None, *, reps: int | None = None,
               model: str | None = None) -> dict[str, Any]:
    """Fields to add to a results row: ``commit``, ``machine``, ``reps`` when given and, with
    an ``engine``, its ``model`` (the name asked), ``model_dir`` (the cached directory, whose
    suffix is the checkpoint's checksum) and ``adapters`` (name → SHA-256 of its files).

    Without an engine, ``model`` names the model whose stored answers the bench read (a
    bench whose every answer was in its answers file starts none): ``model`` and
    ``model_dir`` then come from the model cache, resolved without loading the weights."""
    fields: dict[str, Any] = {"commit": commit(), "machine": machine()}
    if reps is not None:
        fields["reps"] = reps
    if engine is not None:
        fields["model"] = engine.model_name
        fields["model_dir"] = Path(engine.model_dir).name
        fields["adapters"] = {name: adapter.digest
                              for name, adapter in engine.router.adapters.items()}
    elif model is not None:
        from span_workflows.compiler.model import resolve_model

        fields["model"] = model
        fields["model_dir"] = resolve_model(model, progress=False).name
    return fields


def stamp(rows: list[dict[str, Any]], engine: Any = None, *,
          reps: int | None = None, model: str | None = None) -> list[dict[str, Any]]:
    """``rows`` with :func:`provenance` added to each (a row's own ``reps`` is kept: some
    benches repeat cells differently; ``model`` names the model of engines this process did
    not start itself)."""
    fields = provenance(engine, reps=reps, model=model)
    return [{**fields, **row} for row in rows]
