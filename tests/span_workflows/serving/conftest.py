"""Fixtures of the serving tests that talk to the session's shared server (``shared_server``
in ``tests/conftest.py``): its URL and a client signed in with its API key."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serving_fixtures import signed_in
from shared_server import API_KEY


@pytest.fixture(scope="module")
def server(shared_server) -> str:  # type: ignore[no-untyped-def]
    """The shared server's URL."""
    return shared_server.url


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    """A client of the shared server, signed in."""
    with signed_in(server, API_KEY) as client:
        yield client
