"""One local Ray for the session's in-process Ray tests (``test_ray``'s Serve application on
stand-in replicas, ``test_ray_bulk``'s Ray Data bulk): each ``ray.init`` costs seconds.
(``test_ray_engine`` runs ``span-workflows serve --replicas 2``, which starts its own, as a
user's command does.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def local_ray() -> Iterator[None]:
    """``ray.init`` on this machine (2 CPUs, no dashboard), with the environment span engines
    need forwarded to its workers; shut down at the end of the session."""
    ray = pytest.importorskip("ray")
    from span_workflows.scaleout.bulk import forwarded_env

    monkeypatch = pytest.MonkeyPatch()
    # a shared machine: Ray's memory monitor would kill workers for others' memory use
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": forwarded_env()})
    try:
        yield
    finally:
        ray.shutdown()
        monkeypatch.undo()
