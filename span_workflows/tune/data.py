"""Training data for making a model span-ready: invented-fact RAG examples of its own.

The benchmark's question set (:mod:`span_workflows.apps.bench.qa_set`) stays held out: these
examples share its *task* (answer a question from retrieved documents) and nothing else —

* **entity kinds**: mills, libraries, schools, gardens, theatres, mines, canals, chapels,
  breweries and ferries (the benchmark has lighthouses, workshops, ships, festivals,
  observatories and bridges);
* **names**: other syllables (onsets such as ``sk``, ``pl``, ``kr``; vowels such as ``ia``,
  ``oa``, ``y``), other first names, other town and surname endings, so no benchmark name can
  be generated;
* **documents**: sentence templates of their own, fact sentences shuffled among filler
  sentences, 64–512 tokens each, 2–10 documents per prompt (the benchmark: one paragraph
  template per kind, or the long form built from it, 4 or 8 documents);
* **questions**: other phrasings and six facts (who made it, when, where, how many, who keeps
  it now — a second person in the same document, so the model must pick the right one — and
  a colour), two-sentence answers (who, when and where at once), questions that need two
  documents, and questions whose answer is in none of them (answered "The documents do not
  say.");
* **system prompts**: several, none of them the benchmark's.

An :class:`Example` is one query (``system``, ``documents``, ``question``) with its target
``answer``; :func:`make_examples` draws them deterministically from a seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

_ONSETS = ("j", "y", "x", "sk", "pl", "st", "kr", "vl", "sh", "ch", "bl", "fl", "gl", "sn",
           "tr", "zh")
_VOWELS = ("y", "ia", "oa", "ue", "io", "ay", "ee", "o")
_CODAS = ("", "", "x", "ck", "sk", "lt", "ng", "v")
_FIRST_NAMES = (
    "Hedda", "Quentin", "Ottilie", "Lazlo", "Margit", "Evander", "Sunniva", "Radomir",
    "Clemence", "Ivo", "Beatrix", "Soren", "Henrike", "Casimir", "Aurelia", "Dmitri",
    "Philippa", "Barnaby", "Liesel", "Ignatius", "Solveig", "Rupert", "Teodora", "Ambrose",
)
_TOWN_ENDS = ("ton", "bury", "field", "minster", "wold", "combe", "ness", "gate", "dale",
              "port")
_SURNAME_ENDS = ("son", "man", "ridge", "worth", "hurst", "ington", "ow", "ick", "field",
                 "gard")


@dataclass(frozen=True, slots=True)
class _Kind:
    """An entity kind: how its title is written, who made it, what is counted."""

    title: str  # "the {name} Mill"
    noun: str
    role: str  # "the miller"
    made: str  # past participle: "built"
    make: str  # infinitive: "build"
    place: str  # "in the village of {town}"
    counted: str  # "millstones"


_KINDS: dict[str, _Kind] = {
    "mill": _Kind("the {name} Mill", "mill", "the miller", "built", "build",
                  "on the stream below {town}", "millstones"),
    "library": _Kind("the {name} Library", "library", "the scholar", "founded", "found",
                     "in the old square of {town}", "reading rooms"),
    "school": _Kind("the {name} School", "school", "the teacher", "opened", "open",
                    "at the edge of {town}", "classrooms"),
    "garden": _Kind("the {name} Garden", "garden", "the gardener", "laid out", "lay out",
                    "behind the town hall of {town}", "greenhouses"),
    "theatre": _Kind("the {name} Theatre", "theatre", "the actor", "opened", "open",
                     "on the main street of {town}", "balconies"),
    "mine": _Kind("the {name} Mine", "mine", "the surveyor", "opened", "open",
                  "in the hills north of {town}", "shafts"),
    "canal": _Kind("the {name} Canal", "canal", "the engineer", "dug", "dig",
                   "from the river to {town}", "locks"),
    "chapel": _Kind("the {name} Chapel", "chapel", "the mason", "built", "build",
                    "on the green of {town}", "bells"),
    "brewery": _Kind("the {name} Brewery", "brewery", "the brewer", "founded", "found",
                     "by the market of {town}", "copper kettles"),
    "ferry": _Kind("the {name} Ferry", "ferry", "the boatman", "started", "start",
                   "across the lake at {town}", "boats"),
}

_INTRO = (
    "{Title} is {place_phrase}.",
    "Few places in the district are as well loved as {title}.",
    "This is an account of {title}.",
    "{Title} has a long and quiet history.",
)
_FACT_WHO = (
    "It was {made} by {role} {person}.",
    "{Role} {person} {made} {title}.",
    "The person who {made} it was {role} {person}.",
    "{Person} {made} {title}, working as {role_plain} at the time.",
)
_FACT_WHEN = (
    "Work on it was finished in {year}.",
    "{Title} was {made} in the year {year}.",
    "Its first day was in {year}.",
    "The date {year} is carved above its door, the year it was {made}.",
)
_FACT_WHERE = (
    "It lies {place}.",
    "{Title} can be found {place}.",
    "Anyone looking for it should go {place}.",
)
_FACT_KEEPER = (
    "These days {keeper} keeps its keys and shows visitors round.",
    "{Keeper} now holds the keys of {title} and shows visitors round it.",
    "Visitors are shown round by {keeper}, who keeps the keys.",
)
_FACT_COLOUR = (
    "Its shutters are painted {colour}.",
    "The shutters of {title} are {colour}.",
    "Everyone knows {title} by its {colour} shutters.",
)
_COLOURS = ("crimson", "teal", "ochre", "violet", "amber", "slate grey", "olive", "indigo",
            "scarlet", "ivory", "mustard", "plum")
_FACT_COUNT = (
    "It has {count} {counted}.",
    "There are {count} {counted} in {title}.",
    "Over time it came to have {count} {counted}.",
)
_FILLER = (
    "Its walls have seen floods, fires and long dry summers.",
    "Older residents tell stories about it to anyone who will listen.",
    "The keys are kept by a caretaker who lives close by.",
    "Every spring the grounds are cleaned and the gates repainted.",
    "A wooden board near the entrance lists the rules for visitors.",
    "Travellers passing through often stop to rest there.",
    "It is mentioned in a number of letters kept in the district archive.",
    "The building is simple, with thick walls and small windows.",
    "Its roof was replaced once after a heavy winter.",
    "Some visitors come back year after year.",
    "A narrow lane leads up to it from the main road.",
    "The local council pays for part of its upkeep.",
    "Nobody remembers a year in which it was closed for long.",
    "There is a small shop nearby that sells maps and cards.",
    "It is at its busiest on market days.",
    "The surrounding fields are used for grazing sheep.",
    "Evening light gives its stone a warm colour.",
    "Its records are written in a neat and careful hand.",
    "A painting of it hangs in the district hall.",
    "People say it is quieter now than it used to be.",
    "The path around it is muddy after rain.",
    "An old iron lantern hangs by its door.",
    "Its history is taught in the district's schools.",
    "There is no charge to look around the outside.",
    "Its caretakers keep a visitors' book that goes back many decades.",
    "The nearest inn serves a soup named after it.",
    "On clear days it can be seen from the surrounding hills.",
    "Swallows return to it every summer.",
    "It was once the subject of a long dispute over land.",
    "Most of its original fittings are still in place.",
)
_QUESTIONS: dict[str, tuple[str, ...]] = {
    "who": ("Who {made} {title}?", "Whose work was {title}?",
            "Name the person who {made} {title}.", "Which person {made} {title}?",
            "{Title}: who {made} it?"),
    "when": ("When was {title} {made}?", "What year was {title} {made}?",
             "In what year did someone {make} {title}?", "{Title} dates from which year?"),
    "where": ("Where is {title}?", "Where can {title} be found?",
              "Which town is {title} near?", "Name the town of {title}."),
    "count": ("How many {counted} does {title} have?", "What number of {counted} has {title}?",
              "Count the {counted} of {title}."),
    "keeper": ("Who keeps the keys of {title} now?", "Who shows visitors round {title}?",
               "Which person holds the keys of {title} today?"),
    "colour": ("What colour are the shutters of {title}?",
               "Which colour are the shutters on {title} painted?",
               "{Title}: what colour are its shutters?"),
    "story": ("Who {made} {title}, when, and where is it?",
              "Say who {made} {title} and when, then where it lies.",
              "{Title}: who {made} it, in which year, and where?"),
}
_INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "who": ("", " Reply with just the name.", " Give the person's name."),
    "when": ("", " Reply with just the year.", " Give the year only."),
    "where": ("", " Reply with just the town.", " Name the place only."),
    "count": ("", " Reply with the number.", " Give the number only."),
    "keeper": ("", " Reply with just the name.", " Give the person's name."),
    "colour": ("", " Reply with just the colour.", " Name the colour only."),
    "story": ("", " Reply in two sentences.", " Two short sentences, please."),
}
SYSTEM_PROMPTS: tuple[str, ...] = (
    "Use the documents to answer. Keep it short.",
    "You answer questions from the given documents only.",
    "Read the documents and reply briefly.",
    "Answer from the context below. If it does not say, reply that the documents do not say.",
    "You are a helpful assistant. Answer using the provided documents.",
    "Reply in a few words, based on the documents.",
)
NOT_FOUND = "The documents do not say."


@dataclass(frozen=True, slots=True)
class Fact:
    """One invented entity of the training set."""

    kind: str
    name: str
    person: str
    year: int
    town: str
    count: int
    #: a second person of the same document: who keeps it now (never the one who made it)
    keeper: str = ""
    colour: str = ""

    @property
    def title(self) -> str:
        return _KINDS[self.kind].title.format(name=self.name)


@dataclass(frozen=True, slots=True)
class Example:
    """One training query and its target answer. ``needs`` counts the documents the answer
    draws on (0: the answer is in none of them)."""

    system: str
    documents: tuple[str, ...]
    question: str
    answer: str
    needs: int = 1
    #: a file name per document (for layouts with a source header above each)
    titles: tuple[str, ...] = ()


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables))


class UniqueNames:
    """Invented names, each used once: called with a maker of candidate words, it returns the
    first candidate of at least 4 letters not returned before (case-insensitively)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def __call__(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            word = make()
            if word.lower() not in self.used and len(word) >= 4:
                self.used.add(word.lower())
                return word
        raise RuntimeError("ran out of unique invented names")


def make_facts(count: int, rng: random.Random) -> list[Fact]:
    """``count`` entities with unique names, people and towns."""
    unique = UniqueNames()

    kinds = list(_KINDS)
    facts = []
    for _ in range(count):
        kind = rng.choice(kinds)
        name = unique(lambda: _word(rng, 2).capitalize())
        surname = unique(lambda: _word(rng, 1).capitalize() + rng.choice(_SURNAME_ENDS))
        town = unique(lambda: _word(rng, 1).capitalize() + rng.choice(_TOWN_ENDS))
        keeper = unique(lambda: _word(rng, 1).capitalize() + rng.choice(_SURNAME_ENDS))
        first, keeper_first = rng.sample(_FIRST_NAMES, 2)
        facts.append(Fact(kind, name, f"{first} {surname}", rng.randint(1650, 1990), town,
                          rng.randint(2, 19), f"{keeper_first} {keeper}",
                          rng.choice(_COLOURS)))
    return facts


def document(fact: Fact, rng: random.Random, tokens: int, *,
             count_tokens: Callable[[str], int] | None = None) -> str:
    """A document of about ``tokens`` tokens about ``fact``: an introduction, its fact
    sentences at random depths, filler sentences (which state no fact) around them."""
    measure = count_tokens or (lambda text: round(len(text) / 4.4))
    kind = _KINDS[fact.kind]
    values = {
        "title": fact.title, "Title": _cap(fact.title), "person": fact.person,
        "Person": fact.person, "role": kind.role, "Role": _cap(kind.role),
        "role_plain": kind.role.removeprefix("the "), "made": kind.made, "year": fact.year,
        "place": kind.place.format(town=fact.town), "count": fact.count,
        "counted": kind.counted, "place_phrase": kind.place.format(town=fact.town),
        "keeper": fact.keeper, "Keeper": fact.keeper, "colour": fact.colour,
    }
    facts = [rng.choice(group).format(**values)
             for group in (_FACT_WHO, _FACT_WHEN, _FACT_WHERE, _FACT_COUNT, _FACT_KEEPER,
                           _FACT_COLOUR)]
    intro = rng.choice(_INTRO).format(**values)
    rng.shuffle(facts)
    filler = list(_FILLER)
    rng.shuffle(filler)
    budget = tokens - measure(intro) - sum(measure(f) for f in facts)
    body: list[str] = []
    for sentence in filler:
        if budget <= 0:
            break
        body.append(sentence)
        budget -= measure(sentence) + 1
    while budget > 0:  # more filler than the pool holds: repeat it, reshuffled
        sentence = rng.choice(_FILLER)
        body.append(sentence)
        budget -= measure(sentence) + 1
    for f in facts:
        body.insert(rng.randint(0, len(body)), f)
    return " ".join([intro, *body])


def _question(fact: Fact, what: str, rng: random.Random) -> str:
    kind = _KINDS[fact.kind]
    text = rng.choice(_QUESTIONS[what]).format(
        title=fact.title, Title=_cap(fact.title), made=kind.made, make=kind.make,
        counted=kind.counted)
    return text + rng.choice(_INSTRUCTIONS[what])


def _answer(fact: Fact, what: str, rng: random.Random) -> str:
    kind = _KINDS[fact.kind]
    if what == "who":
        return rng.choice((f"{fact.person}.", f"{_cap(fact.title)} was {kind.made} by "
                                              f"{fact.person}."))
    if what == "when":
        return rng.choice((f"{fact.year}.", f"In {fact.year}."))
    if what == "where":
        return rng.choice((f"{fact.town}.", f"Near {fact.town}."))
    if what == "keeper":
        return rng.choice((f"{fact.keeper}.", f"{fact.keeper} keeps the keys."))
    if what == "colour":
        return rng.choice((f"{_cap(fact.colour)}.", f"The shutters are {fact.colour}."))
    if what == "story":
        return (f"{_cap(fact.title)} was {kind.made} by {fact.person} in {fact.year}. "
                f"The {kind.noun} lies {kind.place.format(town=fact.town)}.")
    return f"{fact.count}."


def make_examples(count: int, seed: int = 0, *, doc_tokens: tuple[int, int] = (64, 512),
                  docs_per_prompt: tuple[int, int] = (2, 10), two_doc_share: float = 0.1,
                  unanswerable_share: float = 0.1,
                  count_tokens: Callable[[str], int] | None = None) -> list[Example]:
    """``count`` examples (deterministic for ``seed``): each over a number of documents in
    ``docs_per_prompt`` (small counts more likely), of ``doc_tokens`` tokens (log-uniform, so
    short and long documents are both common), in random order; ``two_doc_share`` of the
    questions ask about two documents and ``unanswerable_share`` about an entity none of them
    describes."""
    rng = random.Random(seed)
    low, high = doc_tokens
    examples = []
    for _ in range(count):
        # fewer documents more often (a retriever's k is small more often than large)
        fewest, most = docs_per_prompt
        n_docs = fewest + int((most - fewest + 1) * rng.random() ** 2)
        facts = make_facts(n_docs + 1, rng)
        absent = facts.pop()
        docs = [document(f, rng, int(round(low * (high / low) ** rng.random())),
                         count_tokens=count_tokens) for f in facts]
        order = list(range(n_docs))
        rng.shuffle(order)
        roll = rng.random()
        what = rng.choice(list(_QUESTIONS))
        if roll < unanswerable_share:
            question, answer, needs = _question(absent, what, rng), NOT_FOUND, 0
        elif roll < unanswerable_share + two_doc_share and n_docs >= 2:
            first, second = rng.sample(facts, 2)
            kind_a, kind_b = _KINDS[first.kind], _KINDS[second.kind]
            question = (f"Who {kind_a.made} {first.title}, and who {kind_b.made} "
                        f"{second.title}?")
            answer = (f"{_cap(first.title)} was {kind_a.made} by {first.person}, and "
                      f"{second.title} by {second.person}.")
            needs = 2
        else:
            target = rng.choice(facts)
            question, answer, needs = _question(target, what, rng), _answer(target, what,
                                                                             rng), 1
        titles = [f"{f.name.lower()}-{f.kind}.txt" for f in facts]
        examples.append(Example(rng.choice(SYSTEM_PROMPTS),
                                tuple(docs[i] for i in order), question, answer, needs,
                                tuple(titles[i] for i in order)))
    return examples


def plain_passages(count: int, seed: int = 0) -> list[str]:
    """``count`` passages of plain English prose of about 160 words each (at most as many as
    there are), for a language-modelling loss that keeps the model's general text ability.

    They come from ``plain_text.json`` beside this module: paragraphs of the long descriptions
    of Python distributions (each passage names its source), prose only, never the standard
    library's documentation (the held-out text of the perplexity check). The file is committed
    so that a run trains on the same text on every machine, whatever is installed there;
    ``seed`` 0 keeps its order, another seed shuffles it."""
    import json
    from pathlib import Path

    path = Path(__file__).with_name("plain_text.json")
    passages = [p["text"] for p in json.loads(path.read_text(encoding="utf-8"))["passages"]]
    if seed:
        random.Random(seed).shuffle(passages)
    return passages[:count]


__all__ = ["Example", "Fact", "NOT_FOUND", "SYSTEM_PROMPTS", "UniqueNames", "document",
           "make_examples",
           "make_facts", "plain_passages"]
