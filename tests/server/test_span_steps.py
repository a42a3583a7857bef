"""The engine-step clock of tagged requests (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

from span_vllm.contract import tag_args
from span_vllm.steps import MAX_RECORDS, StepClock


def _request(tag: str | None, prompt: int = 64) -> SimpleNamespace:
    extra = tag_args(tag) if tag else None
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra),
                           num_computed_tokens=0, num_prompt_tokens=prompt)


def test_steps_run_from_arrival_to_the_first_token_and_to_the_last_step() -> None:
    clock = StepClock()
    other = _request(None)
    clock.scheduled({"o": other}, {"o": 8})  # a step before the request arrives
    req = _request("t")
    clock.arrive(req)
    requests = {"r": req, "o": other}
    clock.scheduled(requests, {"o": 8})  # waits one step
    req.num_computed_tokens = 32
    clock.scheduled(requests, {"r": 32})  # first chunk of its prompt
    req.num_computed_tokens = 64
    clock.scheduled(requests, {"r": 32})  # the rest: its first token is sampled here
    req.num_computed_tokens = 65
    clock.scheduled(requests, {"r": 1})  # one decode step
    assert clock.steps(["t", "unknown"]) == [[3, 4], None]
    assert clock.step == 5


def test_untagged_requests_are_not_recorded_and_records_are_bounded() -> None:
    clock = StepClock()
    clock.arrive(_request(None))
    assert not clock.records
    for i in range(MAX_RECORDS + 3):
        clock.arrive(_request(f"tag-{i}"))
    assert len(clock.records) == MAX_RECORDS and "tag-0" not in clock.records
    clock.scheduled({}, {})  # nothing scheduled: no step
    assert clock.step == 0
