"""The reliability modules' small pool: the session's server slot (``shared_server.ServerSlot``)
in the settings ``dev_server.SMALL_POOL``."""

from __future__ import annotations

import pytest
from dev_server import SMALL_POOL
from shared_server import ServerSlot


@pytest.fixture(scope="module")
def small_pool(server_slot: ServerSlot) -> ServerSlot:
    """The session's server, running with the small pool (started in it if it was not)."""
    return server_slot.use(SMALL_POOL)
