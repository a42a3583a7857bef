"""The labelled set of span_workflows.apps.bench.lint_set and what the static checks make of it
(the order check on it is the benchmark's, `span-workflows bench lint`)."""

from __future__ import annotations

from collections import Counter

from span_workflows.apps.bench.lint_set import COMMUTING_KINDS, ORDERED_KINDS, labelled_set
from span_workflows.commutativity.lint import lint
from span_workflows.query.ir import Plus, walk
from span_workflows.query.validate import validate

CASES = labelled_set()
HELD_OUT = [c for c in labelled_set(held_out=True) if c.held_out]


def test_the_set_has_twenty_of_each_label_over_every_kind() -> None:
    labels = Counter(c.commutes for c in CASES)
    assert labels[True] >= 20 and labels[False] >= 20
    kinds = Counter(c.kind for c in CASES)
    assert set(kinds) == set(COMMUTING_KINDS) | set(ORDERED_KINDS)
    assert all(kinds[k] >= 2 for k in kinds)
    assert all((c.kind in COMMUTING_KINDS) == c.commutes for c in CASES)
    assert len({c.name for c in CASES}) == len(CASES)


def test_each_case_holds_its_plus_at_its_path() -> None:
    for case in CASES:
        validate(case.query)
        nodes = dict(walk(case.query))
        assert isinstance(nodes[case.path], Plus), case.name
        assert len(nodes[case.path].children) >= 2, case.name


def _static(case) -> str:
    [plus] = [p for p in lint(case.query).pluses if p.path == case.path]
    return plus.verdict


def test_static_checks_flag_most_ordered_pluses_and_no_commuting_one() -> None:
    verdicts = {c.name: (c, _static(c)) for c in CASES}
    ordered = [v for c, v in verdicts.values() if not c.commutes]
    commuting = [v for c, v in verdicts.values() if c.commutes]
    assert sum(v == "flagged" for v in ordered) / len(ordered) >= 0.8
    assert sum(v == "flagged" for v in commuting) / len(commuting) <= 0.1
    # the ordered pluses without a telling word are left to the order check, not called clean
    # by mistake; a warning on a commuting plus is one the order check must clear
    assert verdicts["mara's journey"][1] == "clean" and verdicts["mara's key"][1] == "warning"
    assert verdicts["cocoa"][1] == "warning" and verdicts["town history"][1] == "warning"


def test_every_kind_of_ordered_plus_is_caught_by_some_static_rule() -> None:
    caught = {c.kind for c in CASES if not c.commutes and _static(c) == "flagged"}
    assert caught == set(ORDERED_KINDS)


def test_the_held_out_cases_are_apart_and_no_commuting_one_is_flagged() -> None:
    assert len(HELD_OUT) >= 12 and not {c.name for c in HELD_OUT} & {c.name for c in CASES}
    assert all(_static(c) != "flagged" for c in HELD_OUT if c.commutes)
