"""A dev set for the span-ready adapter's learning curve: invented catalogue records, held out
from the training data and from the quality benchmark.

Every document is a *catalogue card* of an invented item — an entry of a patent register, an
orchard survey card, a clock-tower inventory item, a museum card for a tapestry, a sheet of a
map collection — with labelled fields (``Registered by: ...``, ``Year planted: ...``) followed
by remarks that state no fact. The training generator (:mod:`span_workflows.tune.data`: mills,
libraries, schools, gardens, theatres, mines, canals, chapels, breweries, ferries, in prose)
and the benchmark (:mod:`span_workflows.apps.bench.qa_set`: lighthouses, workshops, ships,
festivals, observatories, bridges, one paragraph each) share neither the kinds nor the shape:

* **names** are built from syllables whose vowel is always one of ``au``, ``eu``, ``aa``,
  ``oe`` — letter pairs that neither of the other two generators can produce anywhere in a name
  (their vowels and endings never put these letters side by side) — so no name here can be one
  of theirs; the first names and the surname and town endings are this module's own too;
* **questions** ask for one field of one card (who made or registered it → the full name,
  which year → the year, which town → the town), phrased per kind, with an instruction the
  others do not use.

A :class:`DevQuestion` holds eight cards (about 120–250 tokens each, estimated at four
characters a token), exactly one of which answers it, and a *layout*: how a LangChain or
LlamaIndex user would put the cards in the chat messages (:data:`LAYOUTS`,
:meth:`DevQuestion.messages`). :func:`make_dev_set` cycles the layouts, so each is covered
equally, and the facts within each layout. :func:`is_correct` checks a generated answer.

>>> qs = make_dev_set(5, seed=1)
>>> [q.layout for q in qs], len(qs[0].documents), qs == make_dev_set(5, seed=1)
(['rag', 'system', 'user', 'numbered', 'sources'], 8, True)
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass

from span_workflows.tune.data import UniqueNames

#: How the cards reach the model (see :meth:`DevQuestion.messages`).
LAYOUTS: tuple[str, ...] = ("rag", "system", "user", "numbered", "sources")
#: The facts a question asks for.
FACTS: tuple[str, ...] = ("who", "when", "where")
#: Cards per question.
DOCS_PER_QUESTION = 8
#: A card's size in estimated tokens (characters / 4).
DOC_TOKENS: tuple[int, int] = (120, 250)

_ONSETS = ("", "k", "m", "d", "w", "n", "r", "t", "v", "l", "h", "b", "g", "s")
#: every syllable's vowel: pairs the other generators never produce (see the module docstring)
_VOWELS = ("au", "eu", "aa", "oe")
_CODAS = ("", "", "k", "n", "r", "t", "m", "s")
_FIRST_NAMES = (
    "Anouk", "Benedikt", "Cosima", "Dagny", "Eero", "Fenna", "Gesine", "Halvard", "Idun",
    "Joost", "Kaija", "Lauri", "Mirela", "Niamh", "Orla", "Pieter", "Rasmus", "Saskia",
    "Tjark", "Ulla", "Viggo", "Wiebke", "Yannick", "Zuzana",
)
_SURNAME_ENDS = ("kamp", "quist", "ega", "ovic", "aker", "enko", "hout", "ardt")
_TOWN_ENDS = ("stad", "heim", "ville", "dorp", "ach", "ingen", "rupt", "aken")


@dataclass(frozen=True, slots=True)
class _Kind:
    """A kind of catalogue record: its card (``{...}`` fields), its item's title, and its three
    questions (who, when, where)."""

    title: str
    card: str
    questions: tuple[str, str, str]
    things: tuple[str, ...] = ("",)


_KINDS: dict[str, _Kind] = {
    "patent": _Kind(
        "the {name} {thing}",
        "Patent register, entry {number}.\nInvention: {Title}.\nRegistered by: {person}.\n"
        "Year of registration: {year}.\nTown of registration: {town}.\n"
        "Claims: {count}.",
        ("Who registered {title}?", "In what year was {title} registered?",
         "In which town was {title} registered?"),
        ("seed drill", "rain gauge", "wick trimmer", "loom regulator", "butter churn",
         "sash pulley", "fruit press", "kettle valve"),
    ),
    "orchard": _Kind(
        "the {name} Orchard",
        "Orchard survey, card {number}.\nOrchard: {Title}.\nPlanted by: {person}.\n"
        "Year planted: {year}.\nNearest town: {town}.\nTrees: {count} rows of {thing} trees.",
        ("Who planted {title}?", "In what year was {title} planted?",
         "Which town is nearest to {title}?"),
        ("apple", "pear", "quince", "plum", "cherry", "walnut"),
    ),
    "clock tower": _Kind(
        "the {name} Clock Tower",
        "Clock tower inventory, item {number}.\nTower: {Title}.\nClock made by: {person}.\n"
        "Year installed: {year}.\nTown: {town}.\nDials: {count}, {thing}.",
        ("Who made the clock of {title}?", "In what year was the clock of {title} installed?",
         "In which town does {title} stand?"),
        ("white enamel", "gilded copper", "painted slate", "black iron"),
    ),
    "tapestry": _Kind(
        "the {name} Tapestry",
        "Museum catalogue card {number}.\nObject: {Title}.\nWoven by: {person}.\n"
        "Dated: {year}.\nPlace of weaving: {town}.\nMaterials: {thing}, in {count} panels.",
        ("Who wove {title}?", "In what year is {title} dated?",
         "In which town was {title} woven?"),
        ("wool and silk", "linen and wool", "silk with silver thread"),
    ),
    "chart": _Kind(
        "the {name} Chart",
        "Map collection, sheet {number}.\nTitle: {Title}.\nSurveyed and drawn by: {person}.\n"
        "Year drawn: {year}.\nPlace of drawing: {town}.\nScale: one inch to {count} miles, "
        "{thing}.",
        ("Who drew {title}?", "In what year was {title} drawn?",
         "In which town was {title} drawn?"),
        ("hand coloured", "engraved on copper", "ink on linen"),
    ),
}

#: Remarks on a card: no person, year, town or count, nothing of the other generators' kinds.
_REMARKS: tuple[str, ...] = (
    "The card is typed on thin blue paper and has been folded once.",
    "A pencil mark in the corner gives an older shelf number.",
    "Condition is fair, with some fading along the upper edge.",
    "The entry was copied into the new ledger without changes.",
    "An earlier card for the same item was lost and replaced.",
    "Two photographs are filed with it in a separate envelope.",
    "The original drawings are kept flat in a wide drawer.",
    "Handling requires gloves, as the surface marks easily.",
    "A clerk noted that the description is brief but accurate.",
    "A short correspondence about it is filed under the same number.",
    "The item was lent out once for an exhibition and came back in good order.",
    "Measurements taken at the last inventory matched the card.",
    "The reference number was changed when the collection was renumbered.",
    "No further papers are known to survive.",
    "The entry is cross-referenced with the general index.",
    "A later hand added that the details had been confirmed.",
    "The card was cleaned and rehoused in an acid-free sleeve.",
    "Its description was translated for a foreign catalogue.",
    "The file is marked as complete.",
    "A sketch on the back shows the item from the side.",
    "An insurance valuation is recorded on a separate sheet.",
    "The edges of the card are worn from frequent use.",
    "A typing error in the first line was corrected by hand.",
    "The item appears in the annual report under the same number.",
    "Enquiries about the entry go to the records office.",
    "The card was filmed with the rest of the drawer.",
    "A label on the reverse has partly come away.",
    "The description keeps the spelling of its period.",
    "It is one of the better documented entries in the series.",
    "Staff consider the record reliable.",
    "A duplicate of the card is held in the regional register.",
    "The wording of the entry is formal and sparing.",
)

#: The instruction after each question, per fact.
_ASK = {"who": " Give the full name only.", "when": " Give the year only.",
        "where": " Give the town only."}
#: System prompts of the ``rag``, ``user`` and ``numbered`` layouts.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You look up facts in catalogue records. Reply in a few words.",
    "Answer from the records provided, as briefly as possible.",
    "The user shares catalogue cards. Answer their question from the cards.",
)
#: The ``system`` layout's system prompt, as in LangChain's RAG tutorial (the documents follow
#: it, after a blank line, in the same message).
LANGCHAIN_SYSTEM = ("Use the following pieces of retrieved context to answer the question. If "
                    "you don't know the answer, say that you don't know. Use three sentences "
                    "maximum and keep the answer concise.")
#: The ``sources`` layout's system prompt and user template: LlamaIndex's chat Q&A prompt.
LLAMAINDEX_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\nAlways answer the query "
    "using the provided context information, and not prior knowledge.\nSome rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n2. Avoid statements like "
    "'Based on the context, ...' or 'The context information ...' or anything along those "
    "lines.")
LLAMAINDEX_USER = ("Context information is below.\n---------------------\n{context}\n"
                   "---------------------\nGiven the context information and not prior "
                   "knowledge, answer the query.\nQuery: {question}\nAnswer: ")


@dataclass(frozen=True, slots=True)
class Record:
    """One invented catalogue item and the facts its card states."""

    kind: str
    name: str
    thing: str
    person: str
    year: int
    town: str
    number: int
    count: int

    @property
    def title(self) -> str:
        return _KINDS[self.kind].title.format(name=self.name, thing=self.thing)

    def answer(self, fact: str) -> str:
        """The short reference answer to ``fact`` (``who``, ``when``, ``where``)."""
        return {"who": self.person, "when": str(self.year), "where": self.town}[fact]


@dataclass(frozen=True)
class DevQuestion:
    """One dev question: eight cards, exactly one of which (``target``) answers ``question``
    with ``answer``; ``layout`` says how the cards reach the model (:meth:`messages`).
    ``system`` is the system message's instruction (in the ``system`` layout the cards follow
    it in the same message)."""

    system: str
    documents: tuple[str, ...]
    question: str
    answer: str
    layout: str
    fact: str = "who"
    target: int = 0

    def messages(self) -> list[dict[str, str]]:
        """The chat messages (``{"role", "content"}``) a LangChain / LlamaIndex user writes
        for this layout; every card appears in them verbatim:

        * ``rag``: the system prompt, each card as a user message of its own, the question
          (what the engine's stock mode renders for ``rag(system, documents, question)``);
        * ``system``: LangChain's RAG tutorial — the instruction and the cards joined by blank
          lines in the system message, the question as the user message;
        * ``user``: ``"Context:\\n" + cards + "\\n\\nQuestion: " + question``;
        * ``numbered``: ``"[1] card\\n\\n[2] card ..."``, then the question;
        * ``sources``: LlamaIndex's Q&A prompt, each card under a ``Source: <file>.txt`` line.
        """
        docs, q = self.documents, self.question
        if self.layout == "rag":
            return [_msg("system", self.system), *(_msg("user", d) for d in docs),
                    _msg("user", q)]
        if self.layout == "system":
            return [_msg("system", self.system + "\n\n" + "\n\n".join(docs)), _msg("user", q)]
        if self.layout == "user":
            text = "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: " + q
        elif self.layout == "numbered":
            text = ("\n\n".join(f"[{i}] {d}" for i, d in enumerate(docs, 1))
                    + "\n\nQuestion: " + q)
        elif self.layout == "sources":
            context = "\n\n".join(f"Source: {source_name(d)}\n{d}" for d in docs)
            text = LLAMAINDEX_USER.format(context=context, question=q)
        else:
            raise ValueError(f"unknown layout {self.layout!r}; expected one of "
                             f"{', '.join(LAYOUTS)}")
        return [_msg("system", self.system), _msg("user", text)]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def source_name(document: str) -> str:
    """The file name a card is filed under (the ``sources`` layout): its first line, slugged,
    ``.txt`` (e.g. ``patent-register-entry-41.txt``)."""
    first = document.split("\n", 1)[0]
    return "-".join(re.findall(r"[a-z0-9]+", first.lower())) + ".txt"


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables))


def make_records(count: int, rng: random.Random) -> list[Record]:
    """``count`` records with unique names, surnames, towns and card numbers."""
    unique = UniqueNames()

    numbers = rng.sample(range(10, 1000), count) if count <= 990 else list(range(count))
    records = []
    for i in range(count):
        kind = rng.choice(list(_KINDS))
        name = unique(lambda: _word(rng, 2).capitalize())
        surname = unique(lambda: _word(rng, 1).capitalize() + rng.choice(_SURNAME_ENDS))
        town = unique(lambda: _word(rng, 1).capitalize() + rng.choice(_TOWN_ENDS))
        records.append(Record(kind, name, rng.choice(_KINDS[kind].things),
                              f"{rng.choice(_FIRST_NAMES)} {surname}", rng.randint(1712, 1958),
                              town, numbers[i], rng.randint(2, 12)))
    return records


def estimate_tokens(text: str) -> int:
    """A rough token count: characters / 4."""
    return round(len(text) / 4)


def card(record: Record, rng: random.Random, tokens: int) -> str:
    """The catalogue card of ``record``, about ``tokens`` tokens (:func:`estimate_tokens`):
    its fields, then ``Remarks:`` (sentences that state no fact) while it stays within the
    size."""
    kind = _KINDS[record.kind]
    title = record.title
    head = kind.card.format(number=record.number, Title=title[0].upper() + title[1:],
                            person=record.person, year=record.year, town=record.town,
                            count=record.count, thing=record.thing)
    pool = list(_REMARKS)
    rng.shuffle(pool)
    remarks: list[str] = []
    for sentence in pool:
        if estimate_tokens(head + "\nRemarks: " + " ".join([*remarks, sentence])) > tokens:
            break
        remarks.append(sentence)
    return head + "\nRemarks: " + " ".join(remarks)


def make_dev_set(count: int, seed: int = 0) -> list[DevQuestion]:
    """``count`` dev questions (deterministic for ``seed``). Question ``i`` has layout
    ``LAYOUTS[i % 5]`` and asks for ``FACTS[(i // 5) % 3]``, so every layout is covered
    equally and, over 15 questions, with every fact. Its eight cards are about eight records
    with names, people and towns unique across the whole set, in random order; the target
    card is the only one that answers it."""
    if count < 0:
        raise ValueError("count must not be negative")
    rng = random.Random(seed * 1_000_003 + 7)
    records = make_records(count * DOCS_PER_QUESTION, rng)
    low, high = DOC_TOKENS
    questions = []
    for i in range(count):
        layout = LAYOUTS[i % len(LAYOUTS)]
        fact = FACTS[(i // len(LAYOUTS)) % len(FACTS)]
        group = records[i * DOCS_PER_QUESTION: (i + 1) * DOCS_PER_QUESTION]
        cards = [card(r, rng, rng.randint(low + 20, high)) for r in group]
        target_record = group[0]
        order = list(range(DOCS_PER_QUESTION))
        rng.shuffle(order)
        kind = _KINDS[target_record.kind]
        question = (kind.questions[FACTS.index(fact)].format(title=target_record.title)
                    + _ASK[fact])
        if layout == "system":
            system = LANGCHAIN_SYSTEM
        elif layout == "sources":
            system = LLAMAINDEX_SYSTEM
        else:
            system = rng.choice(SYSTEM_PROMPTS)
        questions.append(DevQuestion(system, tuple(cards[j] for j in order), question,
                                     target_record.answer(fact), layout, fact,
                                     order.index(0)))
    return questions


def normalize(text: str) -> str:
    """Lower case, accents and punctuation removed, whitespace collapsed."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text).split())


def is_correct(answer: str, generated: str) -> bool:
    """Whether the normalized ``answer`` occurs, as whole words, in the normalized
    ``generated`` text (an empty answer is never correct)."""
    needle = normalize(answer)
    return bool(needle) and f" {needle} " in f" {normalize(generated)} "


__all__ = ["DOCS_PER_QUESTION", "DOC_TOKENS", "DevQuestion", "FACTS", "LANGCHAIN_SYSTEM",
           "LAYOUTS", "LLAMAINDEX_SYSTEM", "LLAMAINDEX_USER", "Record", "SYSTEM_PROMPTS",
           "card", "estimate_tokens", "is_correct", "make_dev_set", "make_records",
           "normalize", "source_name"]
