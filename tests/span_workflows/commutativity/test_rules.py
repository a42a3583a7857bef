"""The static checks of span_workflows.commutativity.rules: each rule fires on its evidence, names
the node it saw it in, and stays quiet on the near misses a retrieved document is full of."""

from __future__ import annotations

import pytest

from span_workflows.commutativity.rules import (
    check_site,
    plus_sites,
    replace_at,
    static_findings,
    with_children_of_site,
)
from span_workflows.query.builders import assistant, fragment, g, system, user
from span_workflows.query.ir import Cross, Generate, Map, Plus, Repeat, Retrieve, User, walk
from span_workflows.query.sampling import render_calls, render_tool_result


def _rag(texts: list[str]) -> Generate:
    return g([system("Answer."), Plus(tuple(fragment(t) for t in texts)), user("Q?")],
             max_tokens=8, temperature=0.0)


def _findings(texts: list[str]) -> list[tuple[str, str, str]]:
    [(site, found)] = static_findings(_rag(texts))
    assert site.path == "input.cross[1]"
    return [(f.rule, f.severity, f.path) for f in found]


def _rules(texts: list[str]) -> set[tuple[str, str]]:
    return {(rule, severity) for rule, severity, _ in _findings(texts)}


# -- numbering and order words -------------------------------------------------------------------


def test_numbering_across_siblings_is_an_error_naming_the_plus() -> None:
    found = _findings(["Step 1: Preheat the oven.", "Step 2: Mix the flour.",
                       "Step 3: Bake it."])
    assert ("sibling-numbering", "error", "input.cross[1]") in found
    [(site, [finding])] = static_findings(_rag(["1. Unplug it.", "2. Wait.", "3. Plug it in."]))
    assert finding.rule == "sibling-numbering" and "input.cross[1].plus[2]" in finding.evidence


def test_a_numbered_list_split_between_two_children_is_an_error() -> None:
    assert ("sibling-numbering", "error") in _rules(
        ["To plant a tree:\n1. Dig a hole.\n2. Set the tree in it.", "3. Fill it.\n4. Water."])


def test_lists_that_each_start_at_one_are_independent() -> None:
    assert _rules(["Reset:\n1. Hold the button.\n2. Wait.", "Update:\n1. Download.\n2. Upload.",
                   "The router has four ports."]) == set()


def test_ordinal_words_inside_a_document_are_no_evidence() -> None:
    assert _rules(["The Iron Bridge was the first arch bridge made of cast iron.",
                   "First Avenue Bridge opened in 1820.",
                   "The next solar eclipse over Lisbon is in 2026.",
                   "Mina broke the previous record by two seconds.",
                   "In step 3 of the setup, the poles are clipped on."]) == set()


def test_one_child_numbered_from_above_one_is_a_warning_on_that_child() -> None:
    found = _findings(["Chapter 12 tells how the railway came.", "The market is on Thursday."])
    assert found == [("sibling-numbering", "warning", "input.cross[1].plus[0]")]


def test_a_mention_of_a_siblings_label_is_an_error() -> None:
    found = _findings(["Step 2: Mix the flour.", "Knead what you mixed in step 2 for a minute."])
    assert ("sibling-reference", "error", "input.cross[1].plus[1]") in found


def test_sequence_openers() -> None:
    assert ("sequence-opener", "error") in _rules(
        ["First, pour the water.", "Then switch the kettle on.", "Finally, pour the tea."])
    assert _findings(["Tom planted a seed.", "The next morning, a shoot appeared."]) == [
        ("sequence-opener", "warning", "input.cross[1].plus[1]")]
    assert _rules(["Next generation sequencing reads DNA fast.",
                   "Later versions of the tool are faster."]) == set()


# -- continuations, references, cut sentences ---------------------------------------------------


def test_continuation_markers() -> None:
    assert ("continuation", "error") in _rules(["The sailor left. (continued)", "He slept."])
    assert ("continuation", "error") in _rules(["Continued from the previous page: he slept.",
                                                "The inn was warm."])
    assert _rules(["The war continued for years.", "Trade continued from 1820 to 1900."]) == set()


def test_back_references_are_warnings() -> None:
    found = _findings(["I need a gift.", "Maybe the previous answer was better."])
    assert found == [("back-reference", "warning", "input.cross[1].plus[1]")]
    assert ("back-reference", "warning") in _rules(["As I said, she hikes.", "A map then."])


def test_a_sentence_cut_at_the_span_boundary_is_an_error() -> None:
    assert ("sentence-cut", "error") in _rules(
        ["Once upon a time a fox lived near the old", "mill by the river."])
    assert _findings(["The mill stood by the river.", "and the fox lived there."]) == [
        ("sentence-cut", "warning", "input.cross[1].plus[1]")]
    # a source line without a full stop, next to complete documents
    assert _rules(["Tide tables are published in March.\nSource: Port Elwin Gazette",
                   "High tide is at noon."]) == set()


# -- tables, lists, speakers, pronouns ---------------------------------------------------------


def test_a_table_split_across_children() -> None:
    found = _findings(["| fruit | price |\n|---|---|\n| apple | 1.20 |", "| fig | 3.40 |"])
    assert found == [("split-table", "error", "input.cross[1].plus[1]")]
    assert ("split-table", "error") in _rules(["name,age,city\nAna,34,Lisbon", "Cai,41,Lima"])
    assert ("split-table", "error") in _rules(["station\tarrival\nLeeds\t09:10", "York\t09:40"])
    assert _rules(["| fruit | price |\n|---|---|\n| apple | 1.20 |",
                   "| city | rain |\n|---|---|\n| Oslo | 760 |"]) == set()
    # prose with commas is no table
    assert not any(r == "split-table" for r, _ in _rules(
        ["We met Ana, Ben, Cai and Dee in Lisbon.", "The weather was fine."]))


def test_a_list_split_after_its_colon() -> None:
    found = _findings(["For the pancakes you will need:", "- two eggs\n- flour"])
    assert found == [("split-list", "error", "input.cross[1].plus[0]")]
    assert _findings(["You will need:", "Eggs are cheap."]) == [
        ("split-list", "warning", "input.cross[1].plus[0]")]


def test_speaker_turns() -> None:
    assert ("speaker-turns", "error") in _rules(
        ["Alice: Did you feed the cat?", "Bob: Yes.", "Alice: Then why is it hungry?"])
    assert ("speaker-turns", "error") in _rules(["Q: Capital of Peru?", "A: Lima."])
    assert _rules(["Summary: Vela found ice.", "Summary: Rhea is a moon."]) == set()
    assert _rules(["Paris: 18 °C.", "Rome: 24 °C."]) == {("speaker-turns", "warning")}
    assert _rules(["Step 1: Preheat.", "Step 2: Bake."]) == {("sibling-numbering", "error")}


def test_connective_openers_and_instructions_are_warnings() -> None:
    assert _findings(["I want to return my shoes.", "Actually, make it an exchange."]) == [
        ("connective-opener", "warning", "input.cross[1].plus[1]")]
    assert _findings(["Pour the milk into a pan.", "Heat it until it steams.",
                      "Stir in the cocoa."]) == [("instructions", "warning", "input.cross[1]")]
    # one imperative among documents is no procedure
    assert _rules(["Stay dry with this rain jacket.", "The jacket weighs 200 grams.",
                   "A light jacket that folds into its pocket."]) == set()


def test_a_dangling_pronoun_is_a_warning() -> None:
    assert _findings(["Mara found a key.", "She opened the chest with it."]) == [
        ("dangling-pronoun", "warning", "input.cross[1].plus[1]")]
    assert _rules(["This guide explains the router.", "These ports are fast."]) == set()


# -- structure --------------------------------------------------------------------------------


def test_user_and_assistant_turns_in_one_plus() -> None:
    q = g([system("Reply."), Plus((user("Book a table?"), assistant("For when?"),
                                   user("Eight.")))], temperature=0.0)
    [(site, found)] = static_findings(q)
    assert [(f.rule, f.severity, f.path) for f in found] == [
        ("dialogue-turns", "error", "input.cross[1]")]
    drafts = g([Plus((assistant("Draft one."), assistant("Draft two."))), user("Best?")])
    assert check_site(plus_sites(drafts)[0]) == []


def _agent(results: list[tuple[str, str]], earlier: list, last: list) -> Generate:
    turns = [assistant(render_calls(c)) for c in earlier]
    return g(Cross((user("Book the cheapest flight."), *turns, assistant(render_calls(last)),
                    Plus(tuple(user(render_tool_result(n, t)) for n, t in results)))))


def test_tool_results_of_different_turns() -> None:
    q = _agent([("search", "SK123 at 89 EUR."), ("book", "Booked.")],
               earlier=[[("search", {"to": "Oslo"})]], last=[("book", {"id": "SK123"})])
    [(site, found)] = static_findings(q)
    assert [(f.rule, f.path) for f in found] == [("tool-turns", "input.cross[3]")]
    assert "input.cross[3].plus[0] answers search, called at input.cross[1]" in found[0].evidence
    one_turn = _agent([("weather", "Paris: 18 °C."), ("weather", "Rome: 24 °C.")],
                      earlier=[], last=[("weather", {"c": "Paris"}), ("weather", {"c": "Rome"})])
    assert check_site(plus_sites(one_turn)[0]) == []


def test_prompts_of_generations_are_read_alone() -> None:
    """A map's inputs and the prompts of nested G's are each read alone: no sentence runs on
    from one into another; what they say still counts."""
    q = g(Cross((Map(("write about one", "two more lines")), user("Best?"))))
    assert check_site(plus_sites(q)[0]) == []
    steps = g(Cross((Map(("Step 1: write the intro.", "Step 2: write the end.")),
                     user("Join them."))))
    assert [f.rule for f in check_site(plus_sites(steps)[0])] == ["sibling-numbering"]


def test_notes_for_pluses_that_do_nothing() -> None:
    single = _rag(["Only one document."])
    assert [f.rule for f in check_site(plus_sites(single)[0])] == ["single-child"]
    twice = _rag(["Same text.", "Same text.", "Other text."])
    [note] = check_site(plus_sites(twice)[0])
    assert (note.rule, note.severity) == ("duplicate-children", "note")
    assert "input.cross[1].plus[0], input.cross[1].plus[1]" in note.evidence
    greedy = g([Repeat(3, g(user("Write a line."), temperature=0.0)), user("Best?")])
    [note] = check_site(plus_sites(greedy)[0])
    assert (note.rule, note.path) == ("greedy-nested-g", "input.cross[0].repeat.g")
    sampled = g([Plus((g(user("Write."), temperature=0.7),) * 2), user("Best?")])
    assert check_site(plus_sites(sampled)[0]) == []
    nested = g([Plus((g(user("Write a haiku."), temperature=0.0),
                      g(user("Write a limerick."), temperature=0.0))), user("Best?")])
    notes = check_site(plus_sites(nested)[0])
    assert {(f.rule, f.severity) for f in notes} == {("greedy-nested-g", "note")}
    assert [f.path for f in notes] == ["input.cross[0].plus[0]", "input.cross[0].plus[1]"]


# -- sites and paths -------------------------------------------------------------------------------


def test_every_commutative_join_is_a_site_with_the_validators_paths() -> None:
    q = g(Cross((system("s"), Retrieve("q", (fragment("a"), fragment("b"))),
                 Plus((g(user("x"), temperature=0.5), user("y"))),
                 Map(("one", "two")), user("Q?"))))
    sites = plus_sites(q)
    assert [(s.path, s.kind) for s in sites] == [
        ("input.cross[1]", "retrieve"), ("input.cross[2]", "plus"), ("input.cross[3]", "map")]
    paths = {p for p, _ in walk(q)}
    assert set(sites[0].child_paths) == {"input.cross[1].retrieve.fragments[0]",
                                         "input.cross[1].retrieve.fragments[1]"} <= paths
    assert sites[1].child_paths[0] in paths and sites[1].texts == ("x", "y")
    assert sites[2].child_paths == ("input.cross[3].map.inputs[0]",
                                    "input.cross[3].map.inputs[1]")


@pytest.mark.parametrize("which", [0, 1, 2])
def test_replace_at_rebuilds_only_the_way_to_the_site(which: int) -> None:
    q = g(Cross((system("s"), Retrieve("q", (fragment("a"), fragment("b"))),
                 Plus((user("x"), user("y"))), Map(("one", "two")), user("Q?"))))
    site = plus_sites(q)[which]
    swapped = with_children_of_site(site, list(reversed(site.children)))
    new = replace_at(q, site.index, swapped)
    again = plus_sites(new)[which]
    assert again.texts == tuple(reversed(site.texts)) and again.kind == site.kind
    kids, new_kids = q.input.children, new.input.children
    assert all(a is b for i, (a, b) in enumerate(zip(kids, new_kids, strict=True))
               if i != which + 1)
    assert isinstance(new_kids[-1], User)
