"""span_workflows.commutativity.lint: verdicts, the order check's runs and figures,
@commutative(check=True).

The order check's plumbing is tested against a recording backend (it answers from a table, so
each rule of the verdict can be driven both ways); the real engine runs it at the end."""

from __future__ import annotations

import asyncio
import json
import math
import random
import warnings
from dataclasses import dataclass, field

import pytest

from span_workflows import CommutativityWarning, commutative, lint, to_json
from span_workflows.commutativity.lint import (
    KL_MIN,
    OrderCheck,
    agreement,
    answers_agree,
    child_orders,
    greedy,
    respace,
)
from span_workflows.commutativity.rules import plus_sites, text_of
from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import fragment, g, system, user
from span_workflows.query.ir import Generate, Plus, Repeat, iter_nodes

DOCS = ["The Gull Rock lighthouse was built in 1871.",
        "Keeper Ada Lind kept the light for forty-two winters.",
        "The foghorn sounds twice every thirty seconds."]
STEPS = ["Step 1: Preheat the oven.", "Step 2: Put the dough in a tin.", "Step 3: Bake it."]


def _rag(texts: list[str], max_tokens: int = 64) -> Generate:
    return g([system("Answer."), Plus(tuple(fragment(t) for t in texts)), user("Who?")],
             max_tokens=max_tokens, temperature=0.7)


@dataclass
class _Result:
    text: str
    first_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass
class Recorder:
    """A backend that records each call and answers with ``answer(query)``."""

    answer: object
    calls: list[tuple[list, bool, int | None]] = field(default_factory=list)

    def execute_many(self, queries, *, span_mode=True, logprobs=None):
        self.calls.append((list(queries), span_mode, logprobs))
        return [self.answer(q) for q in queries]


def _plus_texts(query) -> tuple[str, ...]:
    return plus_sites(query)[0].texts


# -- static verdicts and reports ----------------------------------------------------------------


def test_static_verdicts_exit_codes_and_json() -> None:
    flagged, clean = lint(_rag(STEPS)), lint(_rag(DOCS))
    assert (flagged.verdict, flagged.exit_code, len(flagged.flagged)) == ("flagged", 1, 1)
    assert (clean.verdict, clean.exit_code, clean.pluses[0].findings) == ("clean", 0, [])
    data = json.loads(json.dumps(flagged.to_dict()))
    [plus] = data["pluses"]
    assert plus["path"] == "input.cross[1]" and plus["verdict"] == "flagged"
    assert plus["findings"][0]["rule"] == "sibling-numbering"
    assert plus["order_check"] is None and data["trials"] == 0
    warned = lint(_rag(["Mara found a key.", "She opened the chest."]))
    assert (warned.verdict, warned.exit_code) == ("warning", 0)


def test_lint_reads_json_and_names_the_bad_node() -> None:
    assert lint(to_json(_rag(STEPS))).verdict == "flagged"
    with pytest.raises(SpanQueryError) as err:
        lint('{"g": {"input": {"cross": [{"user": "a"}, {"plux": []}]}}}')
    assert "input.cross[1]" in str(err.value)


def test_a_query_without_a_plus_is_clean() -> None:
    report = lint(g(user("hi")))
    assert report.pluses == [] and report.verdict == "clean" and report.exit_code == 0


# -- the order check's runs ---------------------------------------------------------------------


def test_child_orders_are_given_reversed_then_distinct_random() -> None:
    orders = child_orders(4, 5, random.Random(0))
    assert orders[:2] == [(0, 1, 2, 3), (3, 2, 1, 0)]
    assert len(set(orders)) == 5
    assert child_orders(2, 5, random.Random(0)) == [(0, 1), (1, 0)]  # 2! orders only
    assert child_orders(1, 3, random.Random(0)) == [(0,)]


def test_respace_changes_only_whitespace() -> None:
    for trial in range(1, 6):
        text = respace("The foghorn sounds twice.", trial, 3)
        assert text != "The foghorn sounds twice." and text.split() == [
            "The", "foghorn", "sounds", "twice."]


def test_greedy_caps_every_generation() -> None:
    q = g([Plus((g(user("draft"), max_tokens=0, temperature=0.9),)), user("judge")],
          max_tokens=200, temperature=0.7)
    gens = [n for n in iter_nodes(greedy(q, 24)) if isinstance(n, Generate)]
    assert [(x.temperature, x.max_tokens) for x in gens] == [(0.0, 24), (0.0, 24)]
    # the answer stops after its first sentence; the draft the judge reads does not
    assert "\n" in gens[0].sampling.stop and gens[1].sampling.stop == ()


def test_one_call_per_plus_in_stock_mode_orders_then_controls() -> None:
    backend = Recorder(lambda q: _Result("Ada Lind.", {1: -0.1, 2: -2.5}))
    report = lint(_rag(DOCS, max_tokens=64), backend, trials=3, answer_tokens=12)
    [(queries, span_mode, logprobs)] = backend.calls
    assert span_mode is False and logprobs == 20 and len(queries) == 3 + 2
    orders = [_plus_texts(q) for q in queries[:3]]
    assert orders[0] == tuple(DOCS) and orders[1] == tuple(reversed(DOCS))
    assert len(set(orders)) == 3 and all(sorted(o) == sorted(DOCS) for o in orders)
    for control in queries[3:]:  # same order, same words, other whitespace
        texts = _plus_texts(control)
        assert texts != tuple(DOCS)
        assert [t.split() for t in texts] == [d.split() for d in DOCS]
        assert text_of(control.input.children[2]) == "Who?"  # the question is untouched
    assert all(q.max_tokens == 12 and q.temperature == 0.0 for q in queries)
    [plus] = report.pluses
    assert plus.check is not None and plus.verdict == "clean" and report.trials == 3
    assert (plus.check.agreement, plus.check.control_agreement, plus.check.kl) == (1.0, 1.0, 0.0)


def _answering(by_first_text: dict[str, str], logprobs: dict[str, dict[int, float]] | None = None,
               control: str | None = None):
    """Answer by the plus's first child; whitespace controls (a text with a doubled space or
    a trailing newline) answer ``control`` when given."""
    def answer(query):
        first = plus_sites(query)[0].texts[0]
        key = " ".join(first.split())
        is_control = first != key
        text = control if (is_control and control is not None) else by_first_text[key]
        lp = (logprobs or {}).get("control" if is_control else key, {1: -0.1, 2: -2.4})
        return _Result(text, lp)
    return answer


def test_answers_that_follow_the_order_confirm_a_warning_and_say_by_how_much() -> None:
    texts = ["Preheat the oven.", "Put the dough in a tin.", "Bake it."]  # instructions
    answers = {"Preheat the oven.": "Preheat the oven.", "Put the dough in a tin.":
               "Put the dough in a tin.", "Bake it.": "Bake it for an hour."}
    report = lint(_rag(texts), Recorder(_answering(answers, control="Preheat the oven.")),
                  trials=3)
    [plus] = report.pluses
    assert [f.rule for f in plus.findings] == ["order-sensitive", "instructions"]
    assert plus.check.agreement == 0.0 and plus.check.control_agreement == 1.0
    assert plus.check.answers_moved and plus.confirmed
    assert plus.verdict == "flagged" and report.exit_code == 1
    assert plus.findings[0].severity == "error"
    assert "0/3 pairs of orders vs 3/3 of whitespace controls (-100 points)" in (
        plus.findings[0].evidence)


def test_the_models_sensitivity_alone_is_a_warning_not_a_flag() -> None:
    """Documents that commute move a small model's answer too (position bias): without
    static evidence an order-sensitive plus is reported, not flagged."""
    answers = dict(zip(DOCS, ("Ada Lind kept it.", "It was built in 1871.",
                              "The foghorn sounds twice."), strict=True))
    report = lint(_rag(DOCS), Recorder(_answering(answers, control="Ada Lind kept it.")),
                  trials=3)
    [plus] = report.pluses
    assert plus.check.order_sensitive and not plus.confirmed
    assert plus.verdict == "warning" and report.exit_code == 0
    assert (plus.findings[0].rule, plus.findings[0].severity) == ("order-sensitive", "warning")
    assert "no static evidence" in plus.findings[0].evidence


def test_noise_the_control_shows_too_is_not_order_dependence() -> None:
    answers = {d: f"answer {i}" for i, d in enumerate(DOCS)}  # every run says something else
    report = lint(_rag(DOCS), Recorder(_answering(answers, control="yet another thing")),
                  trials=3)
    [plus] = report.pluses
    assert plus.check.agreement == 0.0 and plus.check.control_agreement < 0.5
    assert not plus.check.order_sensitive and plus.verdict == "clean"


def test_the_first_token_is_evidence_only_when_some_answers_differ() -> None:
    sharp, flat = {1: math.log(0.9), 2: math.log(0.1)}, {1: math.log(0.2), 2: math.log(0.8)}
    logprobs = {DOCS[0]: sharp, DOCS[1]: flat, DOCS[2]: flat, "control": sharp}
    same = {d: "Ada Lind." for d in DOCS}
    report = lint(_rag(DOCS), Recorder(_answering(same, logprobs)), trials=3)
    check = report.pluses[0].check
    assert check.agreement == check.control_agreement == 1.0 and check.control_kl == 0.0
    assert check.kl >= KL_MIN and not check.first_token_moved and not check.order_sensitive
    assert report.verdict == "clean"
    # the same distributions when one order answers otherwise: the first token decides
    moved = OrderCheck(3, 3, 1 / 3, 1 / 3, check.kl, 0.0, 0.5, ("a",) * 3, ("a",) * 3, 0.0)
    assert moved.first_token_moved and not moved.answers_moved and moved.order_sensitive
    calm = OrderCheck(3, 3, 1 / 3, 1 / 3, check.kl, check.kl / 2, 0.5, ("a",) * 3, ("a",) * 3,
                      0.0)
    assert not calm.order_sensitive  # less than KL_FACTOR times the control's


def test_the_order_check_confirms_or_clears_a_warning() -> None:
    texts = ["Mara found a key.", "She opened the chest.", "Inside was a map."]
    same = Recorder(_answering({t: "A key." for t in texts}))
    cleared = lint(_rag(texts), same, trials=3).pluses[0]
    assert cleared.verdict == "clean" and cleared.cleared
    assert [f.severity for f in cleared.findings] == ["warning"]
    moved = Recorder(_answering({texts[0]: "A key.", texts[1]: "She opened it.",
                                 texts[2]: "A map was inside."}, control="A key."))
    confirmed = lint(_rag(texts), moved, trials=3).pluses[0]
    assert confirmed.verdict == "flagged" and not confirmed.cleared


def test_pluses_the_check_cannot_reorder_are_skipped_with_the_reason() -> None:
    backend = Recorder(lambda q: _Result("x"))
    one = lint(_rag(["Only one."]), backend).pluses[0]
    copies = lint(g([Repeat(3, g(user("w"), temperature=0.8)), user("best?")]),
                  backend).pluses[0]
    top = lint(Plus((g(user("a")), g(user("b")))), backend).pluses[0]
    assert backend.calls == []
    assert "one child" in one.skipped and "copies" in copies.skipped
    assert "top-level" in top.skipped and top.check is None


def test_options_and_backends_are_checked() -> None:
    class NoStock:
        def execute_many(self, queries, *, optimize_query=True):
            return []

    with pytest.raises(TypeError, match="span_mode"):
        lint(_rag(DOCS), NoStock())
    with pytest.raises(SpanQueryError, match="trials"):
        lint(_rag(DOCS), Recorder(lambda q: _Result("x")), trials=1)


def test_answers_agree_on_their_first_sentences_words() -> None:
    assert answers_agree("The customer wants a bigger size.", "The customer wants a larger size")
    assert not answers_agree("The customer wants a larger size.",
                             "The customer wants to return their shoes.")
    assert answers_agree("Lima. Then more text.", "lima")
    assert agreement(["a b", "a b", "c d"]) == pytest.approx(1 / 3)
    assert agreement(["only"]) == 1.0


def test_order_check_summary_reports_both_figures() -> None:
    check = OrderCheck(3, 3, 1 / 3, 1.0, 0.2, 0.01, 0.5, ("a",) * 3, ("a",) * 3, 0.1)
    assert check.answers_moved and check.first_token_moved
    text = check.summary()
    assert "1/3 pairs of orders vs 3/3" in text and "-67 points" in text and "20.0×" in text


# -- @commutative(check=True) ----------------------------------------------------------------


def test_check_warns_once_on_the_first_call() -> None:
    @commutative(check=True)
    def steps() -> list[str]:
        return STEPS

    with pytest.warns(CommutativityWarning, match=r"steps\(\).*sibling-numbering"):
        steps()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(steps(), Plus)  # checked once: no second warning


def test_check_is_quiet_on_documents_and_off_by_default() -> None:
    @commutative(check=True)
    def search() -> list[str]:
        return DOCS

    @commutative
    def unchecked() -> list[str]:
        return STEPS

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        search()
        unchecked()


def test_check_on_named_parameters_reads_the_returned_query() -> None:
    @commutative("turns", check=True)
    def reply(turns) -> Generate:
        return g([system("Reply to the last message."), turns])

    with pytest.warns(CommutativityWarning, match=r"input\.cross\[1\]: speaker-turns"):
        reply(["Alice: Did you feed the cat?", "Bob: Yes.", "Alice: Then why is it hungry?"])

    @commutative("docs", check=True)
    async def answer_later(docs) -> str:
        return "not a query"

    with pytest.warns(CommutativityWarning, match="split-table"):
        asyncio.run(answer_later(["| a | b |\n|---|---|\n| 1 | 2 |", "| 3 | 4 |"]))


def test_check_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="check"):
        commutative(check="yes")


# -- on the real engine --------------------------------------------------------------------------


@pytest.mark.engine
def test_lint_on_the_engine_one_call_per_plus(engine) -> None:
    """A story told in parts moves the first answer token when reordered, a plus of
    translations does not; and a checked @commutative query runs on the engine after its
    warning."""

    class Counting:
        def __init__(self) -> None:
            self.calls: list[int] = []
            self.model_name = engine.model_name

        def execute_many(self, queries, *, span_mode=True, logprobs=None):
            self.calls.append(len(queries))
            return engine.execute_many(queries, span_mode=span_mode, logprobs=logprobs)

    counting = Counting()
    story = g([system("Answer the question about the story. Be brief."),
               Plus((fragment("Mara found a key in the sand."),
                     fragment("She used it to open an old chest."),
                     fragment("Inside the chest was her grandfather's map."))),
               user("What did Mara do first?")], max_tokens=24, temperature=0.0)
    drafts = _rag(["The cat sleeps on the warm windowsill.",
                   "On the warm windowsill, the cat is sleeping.",
                   "The cat is asleep on the sunny windowsill."])
    flagged, clean = (lint(q, counting, trials=3) for q in (story, drafts))
    assert counting.calls == [5, 5]  # 3 orders + 2 controls, one call per plus
    assert flagged.model == engine.model_name and flagged.trials == 3
    check = flagged.pluses[0].check
    assert flagged.pluses[0].findings[-1].rule == "dangling-pronoun"  # the static warning
    assert check.order_sensitive and flagged.exit_code == 1, check.summary()
    assert all(a for a in check.answers)
    assert clean.pluses[0].check is not None and clean.exit_code == 0, (
        clean.pluses[0].check.summary())

    @commutative("docs", check=True)
    def ask(docs) -> Generate:
        return g([system("Answer briefly."), docs, user("What is the price of a fig?")],
                 max_tokens=8, temperature=0.0)

    with pytest.warns(CommutativityWarning, match="split-table"):
        query = ask(["| fruit | price |\n|---|---|\n| apple | 1.20 |", "| fig | 3.40 |"])
    assert engine.execute(query).text
