"""One local Ray for every Ray test (``test_ray``'s Serve application on stand-in replicas,
``test_ray_bulk``'s Ray Data bulk, and ``test_ray_engine``'s ``span-workflows serve
--ray-address``, which joins it): each ``ray.init`` costs seconds. It is shut down once this
package's tests are done (idle, it would still take about 5 % of a core)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package")
def local_ray() -> Iterator[None]:
    """``ray.init`` on this machine (2 CPUs, no dashboard), with the environment span engines
    need forwarded to its workers; shut down after this package's tests."""
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
