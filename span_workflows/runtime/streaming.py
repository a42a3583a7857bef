"""Answers as they are generated: ordered text deltas while a query runs, its result at the end.

* :class:`PartStream` is the producer side, shared by the embedded engine's loop and the HTTP
  app: it turns the cumulative texts of the answer's *parts* (the final generations of a
  top-level join, numbered by :attr:`span_workflows.runtime.plan.Request.part`) into deltas, in part
  order, so they concatenate to exactly the answer's ``text``.
* :class:`TextStream` / :class:`AsyncTextStream` are what
  :meth:`~span_workflows.runtime.backend.QueryBackend.stream` and ``astream`` return: iterators of
  the
  deltas whose ``result`` is the query's :class:`~span_workflows.runtime.result.Result` once they
  are exhausted (``None`` before).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from span_workflows.runtime.plan import PART_SEPARATOR
from span_workflows.runtime.result import Result


class PartStream:
    """Orders the deltas of an answer's parts: part ``k`` is emitted live once parts
    ``0..k-1`` are finished (its earlier output is buffered until then), and every part after
    the first starts with :data:`~span_workflows.runtime.plan.PART_SEPARATOR`, as the joined answer
    does. ``emit`` receives each non-empty delta, in order."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit_delta = emit
        self._seen: dict[int, int] = {}
        self._started: set[int] = set()
        self._buffers: dict[int, list[str]] = {}
        self._done: set[int] = set()
        self._current = 0

    def update(self, part: int, text: str) -> None:
        """Part ``part``'s text so far (cumulative, as vLLM reports it)."""
        seen = self._seen.get(part, 0)
        if len(text) > seen:
            self._seen[part] = len(text)
            self._emit(part, text[seen:])

    def update_output(self, part: int, output: Any) -> None:
        """Part ``part``'s vLLM ``CompletionOutput`` so far (cumulative); only the first
        output (``index`` 0) is streamed."""
        if output.index == 0:
            self.update(part, output.text)

    def finish(self, part: int) -> None:
        """Part ``part`` generated its last token."""
        self._emit(part, "")
        self._done.add(part)
        while self._current in self._done:
            self._current += 1
            for delta in self._buffers.pop(self._current, []):
                self._put(delta)

    def _emit(self, part: int, delta: str) -> None:
        if part not in self._started:
            self._started.add(part)
            if part > 0:
                delta = PART_SEPARATOR + delta
        if not delta:
            return
        if part == self._current:
            self._put(delta)
        else:
            self._buffers.setdefault(part, []).append(delta)

    def _put(self, delta: str) -> None:
        if delta:
            self._emit_delta(delta)


class ChoiceStream:
    """Streams every output of an answer on its own, as OpenAI's ``choices`` (and spnl's
    ``index``) keep them apart, instead of joining them into one text.

    Fed like a :class:`PartStream` (by :class:`~span_workflows.runtime.vllm_io.RequestRun`), it
    calls ``emit(index, delta)`` with each non-empty delta of choice ``index`` = part +
    output index: the ``n`` outputs of a single G (part 0), or the parts of a map or repeat
    (one output each). It records each choice's vLLM ``finish_reason`` (``"stop"``,
    ``"length"``, ...) in :attr:`finish_reasons`. ``emit`` may be ``None`` to only record
    them."""

    def __init__(self, emit: Callable[[int, str], None] | None = None) -> None:
        self._emit = emit
        self._seen: dict[int, int] = {}
        self.finish_reasons: dict[int, str] = {}

    def update(self, part: int, text: str) -> None:
        """Part ``part``'s first output so far (cumulative)."""
        self._update(part, text)

    def update_output(self, part: int, output: Any) -> None:
        """Part ``part``'s vLLM ``CompletionOutput`` so far (cumulative text)."""
        index = part + int(output.index)
        self._update(index, output.text)
        if getattr(output, "finish_reason", None):
            self.finish_reasons[index] = str(output.finish_reason)

    def _update(self, index: int, text: str) -> None:
        seen = self._seen.get(index, 0)
        if len(text) > seen:
            self._seen[index] = len(text)
            if self._emit is not None:
                self._emit(index, text[seen:])

    def finish(self, part: int) -> None:
        """Part ``part`` generated its last token (nothing to flush: no output waits)."""


class TextStream(Iterator[str]):
    """The deltas of one answer, in order; ``result`` once they are all read.

    ``items`` yields the deltas (``str``) and, last, the :class:`Result`. :meth:`close` (or
    leaving the ``with`` block) stops the query if it still runs.
    """

    def __init__(self, items: Iterator[str | Result]) -> None:
        self._items = items
        self.result: Result | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        while True:
            item = next(self._items)
            if isinstance(item, Result):
                self.result = item
                continue
            return item

    def close(self) -> None:
        """Stop reading (the producer is closed, which ends the query if it still runs)."""
        close = getattr(self._items, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTextStream(AsyncIterator[str]):
    """Async :class:`TextStream`."""

    def __init__(self, items: AsyncIterator[str | Result]) -> None:
        self._items = items
        self.result: Result | None = None

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        while True:
            item = await self._items.__anext__()
            if isinstance(item, Result):
                self.result = item
                continue
            return item

    async def aclose(self) -> None:
        """Stop reading (the producer is closed, which ends the query if it still runs)."""
        close = getattr(self._items, "aclose", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["AsyncTextStream", "ChoiceStream", "PartStream", "TextStream"]
