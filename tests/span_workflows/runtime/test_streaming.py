"""Ordered deltas of an answer's parts, and the text streams backends return."""

from __future__ import annotations

import asyncio

from span_workflows.runtime.plan import PART_SEPARATOR
from span_workflows.runtime.result import Metrics, Result
from span_workflows.runtime.streaming import AsyncTextStream, PartStream, TextStream

RESULT = Result("ab", Metrics(0.0, 1, 0, 1), ["ab"])


def test_parts_stream_in_order_and_concatenate_to_the_joined_text() -> None:
    out: list[str] = []
    stream = PartStream(out.append)
    stream.update(1, "wor")       # part 1 runs ahead: buffered
    stream.update(0, "hel")
    stream.update(0, "hello")     # cumulative text: only the new part goes out
    stream.update(1, "world")
    assert out == ["hel", "lo"]
    stream.finish(0)              # part 1's buffer follows part 0
    stream.finish(1)
    assert "".join(out) == "hello" + PART_SEPARATOR + "world"


def test_a_text_stream_yields_deltas_and_keeps_the_result() -> None:
    stream = TextStream(iter(["a", "b", RESULT]))
    assert stream.result is None
    assert list(stream) == ["a", "b"]
    assert stream.result is RESULT


def test_closing_a_text_stream_closes_its_producer() -> None:
    closed = []

    def items():
        try:
            yield "a"
            yield "b"
        finally:
            closed.append(True)

    with TextStream(items()) as stream:
        assert next(stream) == "a"
    assert closed == [True] and stream.result is None


def test_an_async_text_stream_yields_deltas_and_keeps_the_result() -> None:
    async def items():
        for item in ("a", "b", RESULT):
            yield item

    async def read() -> tuple[list[str], Result | None]:
        async with AsyncTextStream(items()) as stream:
            return [d async for d in stream], stream.result

    assert asyncio.run(read()) == (["a", "b"], RESULT)
