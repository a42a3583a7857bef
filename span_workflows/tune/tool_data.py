"""Training data that keeps a tuned model calling tools: agent turns of its own.

RAG examples alone teach a model to answer from its context at once; an agent's model must
instead call a tool when the facts are not in its context yet, and answer once the results
are. These examples are single turns of tool-using conversations, in the engine's tool
answer format (:mod:`span_workflows.query.sampling`): the tools offered, the question, the calls
made so far with their results, and as target either the calls still needed
(``{"tool_calls": [...]}``) or the answer (``{"content": ...}``) once every needed result is
in.

Held out from every test and benchmark: the tools (town facts such as a mayor or an
elevation; the agent tests ask for a weather and a population), the towns (the invented names
of :func:`span_workflows.tune.data.make_facts`), the question phrasings and the system
prompts are this module's own.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from span_workflows.query.sampling import ToolSpec, render_calls, render_content, render_tool_result
from span_workflows.tune.data import Fact, make_facts


@dataclass(frozen=True, slots=True)
class _Tool:
    """An invented tool about a town: its name and description, the question that needs it,
    and its result (``{town}`` and ``{value}`` filled in)."""

    name: str
    description: str
    argument: str
    question: str
    result: str


_TOOLS: tuple[_Tool, ...] = (
    _Tool("get_mayor", "Who the mayor of a town is.", "town",
          "Who is the mayor of {town}?", "The mayor of {town} is {value}."),
    _Tool("get_elevation", "How high a town lies, in metres.", "town",
          "How high above sea level is {town}?", "{town} lies {value} metres above sea level."),
    _Tool("get_founding_year", "The year a town was founded.", "town",
          "When was {town} founded?", "{town} was founded in {value}."),
    _Tool("get_area", "The area of a town in square kilometres.", "place",
          "How large is {town}?", "{town} covers {value} square kilometres."),
    _Tool("get_river", "The river a town stands on.", "place",
          "Which river runs through {town}?", "{town} stands on the river {value}."),
    _Tool("get_next_train", "When the next train leaves a town's station.", "station",
          "When does the next train leave {town}?", "The next train from {town} leaves at "
                                                    "{value}."),
    _Tool("get_market_day", "The weekday of a town's market.", "town",
          "On which day is the market in {town}?", "The market in {town} is on {value}."),
    _Tool("get_twin_town", "The twin town of a town.", "name",
          "What is the twin town of {town}?", "The twin town of {town} is {value}."),
)
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
_JOINERS = (" Also, {q}", " And {q}", " {Q}", " I would also like to know: {q}")
_SYSTEMS = (
    "",
    "You are an assistant with tools. Look facts up before you answer.",
    "Answer the user's question. Call tools when you need facts you do not have.",
    "You help travellers. Use the tools, then reply briefly.",
)
_NO_TOOL = (  # requests no tool helps with: answered at once
    ("Hello!", "Hello! How can I help you?"),
    ("Thank you, that is all.", "You are welcome."),
    ("Say the word yes.", "Yes."),
    ("What is two plus three?", "Two plus three is five."),
)


@dataclass(frozen=True, slots=True)
class ToolExample:
    """One agent turn: the chat ``messages`` so far (``(role, text)``; roles system, user,
    assistant, tool), the ``tools`` offered, those already ``used`` this turn (described but
    not callable, as ``tool_once_per_turn`` sends them) and the target ``answer`` in the tool
    answer format."""

    messages: tuple[tuple[str, str], ...]
    tools: tuple[ToolSpec, ...]
    used: tuple[str, ...]
    answer: str


def _spec(tool: _Tool) -> ToolSpec:
    schema = {"properties": {tool.argument: {"title": tool.argument.title(), "type": "string"}},
              "required": [tool.argument], "type": "object"}
    return ToolSpec(tool.name, tool.description, json.dumps(schema, separators=(",", ":")))


def _value(tool: _Tool, rng: random.Random, other: Fact) -> str:
    """The invented value a tool returns: a person, a number, a time, a day, or another
    invented entity's name (a river) or town (a twin town)."""
    if tool.name == "get_mayor":
        return other.person
    if tool.name == "get_elevation":
        return str(rng.randint(3, 1900))
    if tool.name == "get_founding_year":
        return str(rng.randint(800, 1900))
    if tool.name == "get_area":
        return str(rng.randint(2, 240))
    if tool.name == "get_next_train":
        return f"{rng.randint(5, 22)}:{rng.choice(('05', '20', '35', '50'))}"
    if tool.name == "get_market_day":
        return rng.choice(_WEEKDAYS)
    if tool.name == "get_river":
        return other.name
    return other.town


def _lower_first(text: str) -> str:
    return text[0].lower() + text[1:]


def make_tool_examples(count: int, seed: int = 0) -> list[ToolExample]:
    """``count`` agent turns (deterministic for ``seed``). Each question needs one to three
    tools about one town (or, rarely, none); one or two tools it does not need are offered
    too. The turn is drawn from the conversation that answers it: before any call, after
    some calls (made one per turn or all in one turn) or after all of them."""
    rng = random.Random(seed)
    examples: list[ToolExample] = []
    for _ in range(count):
        here, other = make_facts(2, rng)
        town = here.town
        needed_n = rng.choices((0, 1, 2, 3), weights=(1, 9, 7, 3))[0]
        offered = rng.sample(_TOOLS, min(len(_TOOLS), max(needed_n, 1) + rng.randint(0, 2)))
        needed = offered[:needed_n]
        rng.shuffle(offered)
        system = rng.choice(_SYSTEMS)
        messages: list[tuple[str, str]] = [("system", system)] if system else []
        if not needed:
            question, reply = rng.choice(_NO_TOOL)
            examples.append(ToolExample((*messages, ("user", question)),
                                        tuple(_spec(t) for t in offered), (),
                                        render_content(reply)))
            continue
        question = needed[0].question.format(town=town)
        for tool in needed[1:]:
            q = tool.question.format(town=town)
            question += rng.choice(_JOINERS).format(q=_lower_first(q), Q=q)
        messages.append(("user", question))
        results = {t.name: t.result.format(town=town, value=_value(t, rng, other))
                   for t in needed}
        one_per_turn = rng.random() < 0.5
        turns = [[t] for t in needed] if one_per_turn else [list(needed)]
        done = rng.randint(0, len(turns))  # how many calling turns came before this one
        called: list[str] = []
        for turn in turns[:done]:
            messages.append(("assistant", render_calls(
                [(t.name, {t.argument: town}) for t in turn])))
            messages.extend(("tool", render_tool_result(t.name, results[t.name]))
                            for t in turn)
            called += [t.name for t in turn]
        remaining = [t for t in needed if t.name not in called]
        if remaining:
            answer = render_calls([(t.name, {t.argument: town}) for t in remaining])
        else:
            answer = render_content(" ".join(results[t.name] for t in needed))
        used = tuple(called) if rng.random() < 0.5 else ()
        examples.append(ToolExample(tuple(messages), tuple(_spec(t) for t in offered), used,
                                    answer))
    return examples


__all__ = ["ToolExample", "make_tool_examples"]
