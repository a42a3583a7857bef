"""Plans without an engine: which prepares run, how steps are counted, how plans merge."""

from __future__ import annotations

from span_vllm.contract import ANCHORED
from span_workflows.compiler.compile import SpanPrompt
from span_workflows.runtime.plan import Probe, StepCount, _StageLog, drive, gather, missing


def test_a_prompt_another_prepare_starts_with_is_not_run_alone() -> None:
    prefix = SpanPrompt((1, 2, 3, 4))
    span = SpanPrompt((1, 2, 3, 4, 9, 9), ((4, ANCHORED),))
    other = SpanPrompt((1, 2, 3, 4, 7, 7), ((4, ANCHORED),))
    assert missing([prefix, span, other], [False] * 3) == [span, other]
    # cached ones and duplicates drop out; a lone prefix still runs
    assert missing([prefix, span, span], [False, True, True]) == [prefix]
    # same tokens under other segments are not the same prompt
    plain = SpanPrompt((1, 2, 3, 4, 9))
    assert missing([SpanPrompt((1, 2, 3, 4), ((0, ANCHORED),)), plain],
                   [False, False]) == [SpanPrompt((1, 2, 3, 4), ((0, ANCHORED),)), plain]


def test_stage_steps_add_up_to_the_final_first_token() -> None:
    log = _StageLog([["p1", "p2"], ["l1"], ["final"]])
    counts = [[1, 1], [2, 2], [1, 1], [3, 9]]
    # the prepares end after 2 steps (the slower one), links after 1, the answer's first
    # token 3 steps later; its last token 9 steps after it arrived
    assert log.totals(counts) == (6, 12)
    assert log.totals([None, None, None, [1, 4]]) == (1, 4)  # unknown counts are 0


def test_step_counts_are_asked_once_for_plans_in_lockstep() -> None:
    def plan(name: str):
        cached = yield Probe([SpanPrompt((1,))])
        assert cached == [True]
        counts = yield StepCount([f"{name}-a", f"{name}-b"])
        return (name, counts)

    asked: list[list[str]] = []

    def steps(step: StepCount) -> list:
        asked.append(list(step.tags))
        return [[len(t), len(t)] for t in step.tags]

    results = drive([plan("x"), plan("yy")], lambda reqs: [], lambda p: [True] * len(
        p.sequences), steps)
    assert asked == [["x-a", "x-b", "yy-a", "yy-b"]]
    assert results == [("x", [[3, 3], [3, 3]]), ("yy", [[4, 4], [4, 4]])]
    # without a step counter every count is unknown
    merged = gather([plan("z")])
    assert isinstance(next(merged), Probe)
    assert merged.send([True]) == StepCount(["z-a", "z-b"])
