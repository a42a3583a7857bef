"""The reliability modules' shared small-pool server (see ``dev_server.SmallPoolServer``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dev_server import SmallPoolServer


@pytest.fixture(scope="session")
def small_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallPoolServer]:
    """One small-pool server for the session, started when a test first asks for it."""
    server = SmallPoolServer(tmp_path_factory.mktemp("small-pool"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
