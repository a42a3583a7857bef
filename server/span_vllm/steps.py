"""Engine steps per request: the figure that sets a span hit's TTFT on a GPU.

On a GPU an engine step costs milliseconds whatever it computes (scheduling, input
preparation, kernel launches, sampling), so how many steps a query waits for, not its FLOPs,
sets its time to first token. The scheduler counts its steps (one per ``schedule()`` that
schedules work); a request whose ``extra_args`` carry a *step tag*
(:data:`span_vllm.contract.TAG_KEY`) has the step it arrived after, the step that produced its
first token and the last step it was scheduled in recorded under its tag. ``steps(tag)`` is
then ``(to_first_token, to_end)``: steps run from its arrival to its first token, and to its
last scheduled step. Requests sampled ``n`` times share their tag; the first sample counts.

Records are kept for the most recent :data:`MAX_RECORDS` tags (a tag nobody asks for is
dropped in time, never leaked).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from span_vllm.contract import TAG_KEY

MAX_RECORDS = 65536


@dataclass
class _Record:
    arrived: int
    first: int | None = None
    last: int | None = None


@dataclass
class StepClock:
    """The scheduler's step counter and the tagged requests' records."""

    step: int = 0
    records: OrderedDict[str, _Record] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def arrive(self, request: Any) -> None:
        """Note a request's arrival (``EngineCore.add_request``)."""
        tag = request_tag(request)
        if tag is None:
            return
        with self._lock:
            if tag not in self.records:
                self.records[tag] = _Record(self.step)
                while len(self.records) > MAX_RECORDS:
                    self.records.popitem(last=False)

    def scheduled(self, requests: dict[str, Any], num_scheduled: dict[str, int]) -> None:
        """Count one step that schedules ``num_scheduled`` tokens per request id; note first
        tokens (a request whose prompt is fully computed after this step samples its first
        token in it) and last steps of tagged requests."""
        if not num_scheduled:
            return
        with self._lock:
            self.step += 1
            for request_id in num_scheduled:
                request = requests.get(request_id)
                tag = request_tag(request) if request is not None else None
                record = self.records.get(tag) if tag is not None else None
                if record is None:
                    continue
                record.last = self.step
                if record.first is None and (request.num_computed_tokens
                                             >= request.num_prompt_tokens):
                    record.first = self.step

    def steps(self, tags: Iterable[str]) -> list[list[int] | None]:
        """``[to_first_token, to_end]`` for each tag (``None``: unknown or not scheduled)."""
        out: list[list[int] | None] = []
        with self._lock:
            for tag in tags:
                record = self.records.get(tag)
                if record is None or record.first is None or record.last is None:
                    out.append(None)
                else:
                    out.append([record.first - record.arrived, record.last - record.arrived])
        return out


def request_tag(request: Any) -> str | None:
    """The step tag a request's ``extra_args`` carry, if any."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    tag = extra.get(TAG_KEY)
    return tag if isinstance(tag, str) and tag else None


CLOCK = StepClock()

__all__ = ["CLOCK", "MAX_RECORDS", "StepClock", "request_tag"]
