"""Shared data of the integration tests. The engine is the session fixture of tests/conftest.py
(one in-process engine per pytest process)."""

from __future__ import annotations

import pytest

#: A small corpus: three documents about the lighthouse of Varnholm (both questions below
#: retrieve all three, ranked differently), the rest about unrelated things.
CORPUS = [
    "The Varnholm lighthouse was built in 1871 by the engineer Ada Lindqvist, who designed "
    "its spiral stone stair of 212 steps.",
    "The Varnholm lighthouse keeper lit the lamp every night with whale oil until 1923, when "
    "the lamp was converted to electricity.",
    "The Varnholm lighthouse light can be seen from 40 kilometres away, and it flashes white "
    "twice every ten seconds.",
    "Sourdough bread rises because wild yeast and lactic acid bacteria ferment the flour.",
    "The violin has four strings tuned in perfect fifths: G, D, A and E.",
    "Honeybees communicate the direction of flowers with a waggle dance.",
    "Basalt columns form when thick lava flows cool slowly and contract into hexagons.",
    "The marathon distance of 42.195 kilometres was fixed at the 1908 London Olympics.",
]

QUESTION_1 = "Who built the Varnholm lighthouse and when?"
QUESTION_2 = "How far away can the Varnholm lighthouse light be seen?"


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)
