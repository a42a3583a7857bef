"""The attention-locality rewrite (tournament of small judges) on trees; no engine."""

from __future__ import annotations

from collections import Counter

import pytest

from span_workflows.compiler.locality import judge_parts, rounds, tournament
from span_workflows.compiler.optimize import optimize
from span_workflows.query.builders import assistant, cross, g, judge_generator, plus, system, user
from span_workflows.query.ir import (
    MESSAGE_TYPES,
    Cross,
    Generate,
    Plus,
    iter_nodes,
)

JUDGE = "Which name do the texts mention? Answer with the name only."


def _judge(n: int, *, drafts: bool = True) -> Generate:
    cands = [
        g(user(f"Repeat exactly: text {i}"), max_tokens=16, temperature=0.0) if drafts
        else assistant(f"text {i}")
        for i in range(n)
    ]
    return g(cross(system("Find the name."), plus(*cands), user(JUDGE)), max_tokens=8,
             temperature=0.0)


def _judges(node) -> list[Generate]:
    """Every G that judges (its input holds a plus or another G), each object once."""
    seen: dict[int, Generate] = {}
    for n in iter_nodes(node):
        if isinstance(n, Generate) and isinstance(n.input, Cross) and any(
            isinstance(c, (Plus, Generate)) for c in n.input.children
        ):
            seen.setdefault(id(n), n)
    return list(seen.values())


def _count_judge_calls(node) -> int:
    """Judge calls as the engine runs them (a shared subtree runs once per path)."""
    return sum(
        1 for n in iter_nodes(node)
        if isinstance(n, Generate) and isinstance(n.input, Cross)
        and any(isinstance(c, (Plus, Generate)) for c in n.input.children)
    )


def _candidates(node) -> Counter:
    """The candidates the round-1 judges read, as a multiset."""
    found: Counter = Counter()
    for n in iter_nodes(node):
        if isinstance(n, Plus):
            for c in n.children:
                found[_strip(c)] += 1
    return found


def _strip(c):
    import dataclasses

    return dataclasses.replace(c, inline_prompt=False) if isinstance(c, Generate) else c


def test_eight_candidates_fanin_two_is_three_rounds_of_seven_judges():
    q = _judge(8)
    t = tournament(q, 2)
    assert rounds(q) == 1
    assert rounds(t) == 3
    assert _count_judge_calls(t) == 7
    # round 1 judges read two candidates each under a plus; later rounds read G's in order
    pluses = [n for n in iter_nodes(t) if isinstance(n, Plus)]
    assert len(pluses) == 4 and all(len(p.children) == 2 for p in pluses)
    assert isinstance(t, Generate) and isinstance(t.input, Cross)
    kids = t.input.children
    assert kids[0] == system("Find the name.") and kids[-1] == user(JUDGE)
    assert [type(k) for k in kids[1:-1]] == [Generate, Generate]


def test_fanin_four_is_two_rounds():
    t = tournament(_judge(8), 4)
    assert rounds(t) == 2
    assert _count_judge_calls(t) == 3
    pluses = [n for n in iter_nodes(t) if isinstance(n, Plus)]
    assert sorted(len(p.children) for p in pluses) == [4, 4]


def test_uneven_count_gets_a_bye():
    t = tournament(_judge(7), 2)
    # round 1: 3 judges + a bye for the 7th; round 2: 2 judges; round 3: the final one
    assert _count_judge_calls(t) == 6
    assert rounds(t) == 3
    assert sum(_candidates(t).values()) == 6  # the 7th candidate skips round 1's plus
    drafts = [n for n in iter_nodes(t) if isinstance(n, Generate) and not judge_parts(n)
              and isinstance(n.input, type(user("x")))]
    assert len(drafts) == 7


@pytest.mark.parametrize("n", [1, 2])
def test_fewer_than_three_candidates_unchanged(n):
    q = _judge(n)
    assert tournament(q, 2) is q
    assert optimize(q, locality_fanin=2) == optimize(q)


def test_plus_no_larger_than_fanin_unchanged():
    q = _judge(4)
    assert tournament(q, 4) is q


def test_leaves_preserved_and_context_copied():
    q = _judge(8, drafts=False)
    t = tournament(q, 2)
    assert _candidates(t) == Counter(assistant(f"text {i}") for i in range(8))
    for j in _judges(t):
        assert j.input.children[0] == system("Find the name.")
        assert j.input.children[-1] == user(JUDGE)
        assert (j.max_tokens, j.temperature, j.model) == (q.max_tokens, q.temperature, q.model)


def test_order_of_candidates_does_not_matter():
    a = [assistant(f"text {i}") for i in range(8)]
    q1 = g(cross(system("s"), plus(*a), user(JUDGE)))
    q2 = g(cross(system("s"), plus(*reversed(a)), user(JUDGE)))
    assert optimize(q1, locality_fanin=2) == optimize(q2, locality_fanin=2)


def test_off_by_default_and_through_optimize():
    q = judge_generator(8, "Write a haiku.", JUDGE)
    plain = optimize(q)
    assert rounds(plain) == 1
    assert plain == optimize(q, locality_fanin=None)
    local = optimize(q, locality_fanin=2)
    assert rounds(local) == 3 and _count_judge_calls(local) == 7
    # normal form: drafts under round-1 pluses are inline; winners in order are not
    for p in (n for n in iter_nodes(local) if isinstance(n, Plus)):
        assert all(c.inline_prompt for c in p.children if isinstance(c, Generate))
    assert all(not j.inline_prompt for j in _judges(local))
    assert optimize(local, locality_fanin=2) == local
    assert optimize(local) == local


def test_optimize_idempotent_without_option():
    q = judge_generator(8, "Write a haiku.", JUDGE)
    once = optimize(q)
    assert optimize(once) is once


def test_nested_messages_only_candidates_and_other_shapes_untouched():
    two_plus = g(cross(plus(user("a"), user("b"), user("c")), plus(user("d"), user("e"),
                                                                     user("f"))))
    assert tournament(two_plus, 2) is two_plus
    no_cross = g(plus(user("a"), user("b"), user("c")))
    assert tournament(no_cross, 2) is no_cross
    rag_like = g(cross(system("s"), plus(*(user(str(i)) for i in range(5))), user("q")))
    t = tournament(rag_like, 2)
    assert all(isinstance(c, MESSAGE_TYPES) for c in _candidates(t))


@pytest.mark.parametrize("bad", [0, 1, True, 2.0, "2"])
def test_bad_fanin(bad):
    with pytest.raises(ValueError):
        tournament(_judge(8), bad)
    with pytest.raises(ValueError):
        optimize(_judge(8), locality_fanin=bad)


# -- the locality benchmark's pure parts ------------------------------------------------------


def test_bench_scoring_and_intervals():
    from span_workflows.apps.bench.locality import exact_match, token_f1, wilson

    assert exact_match(" Marigold.", "Marigold")
    # a restatement of the question before the name is dropped, anything else counts
    assert exact_match("The secret name is Marigold.", "Marigold")
    assert exact_match('The secret name in the texts is "Marigold"', "Marigold")
    assert not exact_match("The secret name is the library.", "Marigold")
    assert not exact_match("Marigold is the secret name.", "Marigold")
    assert token_f1("Marigold is the secret name.", "Marigold") == pytest.approx(2 / 5)
    assert token_f1("Percival", "Marigold") == 0.0
    low, high = wilson(8, 8)
    assert high == 1.0 and 0.6 < low < 0.7
    low, high = wilson(0, 8)
    assert low == 0.0 and 0.3 < high < 0.4


def test_bench_trials_place_one_needle():
    import random

    from span_workflows.apps.bench.locality import NEUTRAL, make_trial, passage

    text = passage(random.Random(1), 400, "NEEDLE.", "end")
    assert text.endswith("NEEDLE.") and 400 <= len(text) < 520
    assert passage(random.Random(1), 400, "NEEDLE.", "start").startswith("NEEDLE.")
    assert passage(random.Random(1), 0, "NEEDLE.", "middle") == "NEEDLE."
    query, name = make_trial(random.Random(3), 200, "middle")
    drafts = optimize(query).input.children[1].children
    assert len(drafts) == 8
    texts = [d.input.text for d in drafts]
    assert sum(f"The secret name is {name}." in t for t in texts) == 1
    assert sum(NEUTRAL in t for t in texts) == 7
    assert rounds(optimize(query, locality_fanin=2)) == 3
