"""An invented-fact question set for measuring answer quality of RAG prompts.

Every document describes one invented entity (a lighthouse, a workshop, a ship, a festival, an
observatory, a bridge) with three facts the model cannot know: who made it (a person's name),
when (a year) and where (a town). Names of entities, people and towns are built from syllables
with a seeded random generator and are unique across the set, so each question is answerable
from exactly one document: its *target*. The other documents of a question (distractors) are
the targets of other questions — about other entities of the same kinds — so the same documents
recur across questions, as they do in a real retrieval workload.

Two document sizes: ``"short"`` (one paragraph, 65–85 tokens) and ``"long"`` (256–512 tokens,
what a RAG chunker returns): the short paragraph's sentences, the fact sentences among them,
spread at random depths among sentences about the same entity that state none of its facts and
name no other person, year or town (:func:`long_document`). And a held-out shape,
``"transcript"``: an oral-history interview (:func:`transcript`), a form that neither the
tuning generator nor its dev set produces, written before any adapter of the tuning recipe
was measured on it.

>>> qs = make_questions(8, n_docs=4, seed=1)
>>> len(qs), len(qs[0].documents), qs[0].documents[qs[0].target] == qs[0].answer_document
(8, 4, True)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

# scored as the training run's dev set scores: one exact match for every curve and table
from span_workflows.tune.dev_set import is_correct, normalize

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "qu", "r",
           "s", "t", "th", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
_CODAS = ("", "", "l", "n", "r", "s", "th", "nd", "rk", "m")
_FIRST_NAMES = (
    "Tomas", "Elira", "Bram", "Oswin", "Maren", "Ilse", "Corwin", "Petra", "Anselm", "Lioba",
    "Ferris", "Odile", "Jorund", "Wenna", "Cassius", "Ysolde", "Leopold", "Nerys", "Bastian",
    "Gudrun", "Emrys", "Rosalind", "Tibor", "Amalia",
)
_TOWN_ENDS = ("mere", "by", "ford", "holm", "wick", "stead", "vale", "haven", "thorpe", "moor")
_SURNAME_ENDS = ("holt", "feather", "wright", "mont", "berg", "ley", "stone", "ward", "croft",
                 "well", "brook", "hart")


@dataclass(frozen=True, slots=True)
class Entity:
    """One invented entity and its three facts."""

    kind: str
    name: str
    person: str
    year: int
    town: str
    detail: str

    @property
    def title(self) -> str:
        """How the document and the questions name it."""
        return _KINDS[self.kind][0].format(name=self.name)

    def document(self) -> str:
        """The document text (65–85 tokens for SmolLM2's tokenizer)."""
        text = _KINDS[self.kind][1].format(
            title=self.title, name=self.name, person=self.person, year=self.year,
            town=self.town, detail=self.detail,
        )
        return text[0].upper() + text[1:]


#: kind → (title, document template)
_KINDS: dict[str, tuple[str, str]] = {
    "lighthouse": (
        "the {name} Lighthouse",
        "{title} stands on a rocky cape outside the harbour town of {town}. It was built in "
        "{year} by the engineer {person}, who also designed its stone keeper's cottage. Its "
        "lamp, {detail}, can be seen far out at sea on clear nights, and the tower is painted "
        "with broad red and white bands.",
    ),
    "workshop": (
        "the {name} Workshop",
        "{title} makes clocks and small brass instruments in the market town of {town}. It was "
        "founded in {year} by the clockmaker {person}, whose first clock still hangs above the "
        "door. Its best-known piece is {detail}, and apprentices still train there for four "
        "years before they sign their own work.",
    ),
    "ship": (
        "the {name}",
        "The sailing ship {name} was launched in {year} from the shipyards of {town}. Her "
        "first captain was {person}, who commanded her on twelve voyages across the northern "
        "sea. She carried {detail}, and her carved figurehead is now kept in a small museum "
        "near the old docks.",
    ),
    "festival": (
        "the {name} Festival",
        "{title} is held every autumn in the hill town of {town}. It was started in {year} by "
        "the musician {person}, who wanted to bring the valley's villages together. The "
        "festival is known for {detail}, and it ends each year with a lantern walk along the "
        "old town walls.",
    ),
    "observatory": (
        "the {name} Observatory",
        "{title} sits on a high ridge above the village of {town}. It was founded in {year} "
        "by the astronomer {person}, who ground the lenses of its first telescope by hand. "
        "Its most famous instrument is {detail}, and visitors may look through it on the "
        "first night of every month.",
    ),
    "bridge": (
        "the {name} Bridge",
        "{title} crosses the wide river at the town of {town}. It was completed in {year} to "
        "plans by the architect {person}, after an older wooden bridge was swept away by a "
        "flood. It is built of {detail}, and its seven arches are lit by lamps every evening.",
    ),
}

_DETAILS: dict[str, tuple[str, ...]] = {
    "lighthouse": ("a great glass lens", "a slowly turning double lamp", "an amber beacon"),
    "workshop": ("a moon-phase clock", "a singing music box", "a brass sea compass"),
    "ship": ("wool and salt", "timber and tar", "tea and silk"),
    "festival": ("its puppet plays", "its bell choirs", "its bread contests"),
    "observatory": ("a bronze refracting telescope", "a copper sun dial", "a tall mirror"),
    "bridge": ("pale grey granite", "red river stone", "dark iron and oak"),
}

#: Sentences about any entity that state none of its facts (no person, year or town): the
#: body of a long document. ``{title}`` is the entity's title, ``{noun}`` what it is.
_FILLER: tuple[str, ...] = (
    "Local guidebooks describe {title} as one of the sights a visitor should not miss.",
    "Over the years the {noun} has been repaired many times, always with care to keep its "
    "original look.",
    "Painters often set up their easels nearby to catch the {noun} in the early morning light.",
    "A small society of volunteers looks after {title} and raises money for its upkeep.",
    "School classes come to see the {noun} in spring, when the weather is mild.",
    "Old postcards of {title} are still sold in the shops of the region.",
    "The records of the {noun} fill several shelves in the regional archive.",
    "Many people who grew up in the area remember their first visit to {title}.",
    "On festival days the {noun} is decorated with garlands of green leaves and ribbons.",
    "A short booklet about the history of {title} is given to every visitor for free.",
    "Photographers like the {noun} best on grey days, when its outline stands out sharply.",
    "In winter fewer visitors come, and the {noun} is quiet for weeks at a time.",
    "The path to {title} is lined with old trees that were planted long ago.",
    "Its upkeep is paid for partly by donations and partly by a small entrance fee.",
    "Some say that the {noun} brings luck to those who see it on their wedding day.",
    "A model of {title} stands in the entrance hall of the regional museum.",
    "The {noun} has appeared in several novels and in at least one well-known song.",
    "Storms have damaged it more than once, but it was always rebuilt in the same style.",
    "Guided tours of the {noun} take about an hour and end with a cup of tea.",
    "Local children learn a rhyme about {title} before they can read.",
    "The {noun} is marked on the oldest maps of the coast and the valley.",
    "People in the region are proud of the {noun} and speak of it as their own.",
    "A bench near {title} offers a fine view of the countryside around it.",
    "The wooden signs that point the way to the {noun} were carved by hand.",
    "Travellers have written about {title} in letters and diaries for generations.",
    "The {noun} is busiest in late summer, when the roads are dry and the days are long.",
    "Its name is painted in tall white letters above the main entrance.",
    "A careful survey of the {noun} found its foundations in good order.",
    "Every few years a new coat of paint protects its woodwork from the weather.",
    "The small garden beside {title} is kept by the same family who keeps its keys.",
    "Visitors are asked not to touch the older fittings of the {noun}.",
    "Birds nest under its eaves each spring, and nobody has the heart to move them.",
    "The {noun} was once threatened with demolition, but the plan was dropped after protests.",
    "A brass plaque by the door tells, in a few lines, why {title} matters.",
    "At dusk the {noun} casts a long shadow across the ground in front of it.",
    "Musicians sometimes play near {title} on warm evenings, and people gather to listen.",
    "A local baker sells a small cake shaped like the {noun}.",
    "The {noun} is said to look its best after a night of rain.",
    "Each autumn the volunteers hold an open day, when every room of the {noun} can be seen.",
    "The view from {title} has hardly changed in a hundred years.",
)
_NOUNS: dict[str, str] = {"lighthouse": "lighthouse", "workshop": "workshop", "ship": "ship",
                          "festival": "festival", "observatory": "observatory",
                          "bridge": "bridge"}
#: How many tokens a long document has (the range a RAG chunker returns).
LONG_DOC_TOKENS: tuple[int, int] = (256, 512)
#: The document shapes: two sizes of prose, and the held-out shape (:func:`transcript`).
DOC_SIZES: tuple[str, ...] = ("short", "long", "transcript")

#: kind → how a speaker says who, when and where (the held-out shape's fact turns)
_SPOKEN: dict[str, tuple[str, str, str]] = {
    "lighthouse": ("My grandmother always said the engineer {person} built it.",
                   "It went up in {year}, that's carved over the door.",
                   "It's the light you see from {town}, out on the cape."),
    "workshop": ("The clockmaker {person} founded it, everybody knows that.",
                 "It opened its doors in {year}, I believe.",
                 "Right in the middle of {town}, by the market."),
    "ship": ("Her first captain, that was {person}.",
             "She was launched in {year}.",
             "She came out of the yards at {town}."),
    "festival": ("It was the musician {person} who started it.",
                 "The very first one was in {year}.",
                 "Always up in {town}, in the hills."),
    "observatory": ("The astronomer {person} founded it, ground the lenses himself.",
                    "That was in {year}.",
                    "Up on the ridge above {town}."),
    "bridge": ("The architect {person} drew the plans for it.",
               "It was completed in {year}.",
               "It crosses the river at {town}."),
}
_ASKED = ("Do you know who was behind it?", "And when was that?", "Where exactly is it?")
#: Turns of the interview that state no fact (no person, year or town).
_TALK: tuple[tuple[str, str], ...] = (
    ("Thank you for sitting down with us today.", "It's my pleasure, I don't get many visitors."),
    ("How long have you known the {noun}?", "Oh, since I was a little one, really."),
    ("What do people around here think of it?", "They're fond of it. Proud, even."),
    ("Is it much changed?", "Not much. A lick of paint now and then."),
    ("Did you ever go inside?", "Many times. My father took me on a Sunday."),
    ("What is it like in winter?", "Quiet. Hardly anyone about, just the wind."),
    ("Are there any stories about it?", "Plenty, though I wouldn't swear to most of them."),
    ("Do young people still care about it?", "Some do. The school brings them up every year."),
    ("Anything you'd like to add?", "Only that it deserves looking after."),
    ("Shall we take a short break?", "Yes, let me put the kettle on."),
)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=\.)\s+", text.strip()) if s]


def _approx_tokens(text: str) -> int:
    """SmolLM2's tokenizer takes about 4.4 characters per token on this text."""
    return round(len(text) / 4.4)


def long_document(entity: Entity, rng: random.Random, tokens: int,
                  count_tokens: Callable[[str], int] = _approx_tokens) -> str:
    """A document of about ``tokens`` tokens (``count_tokens`` measures): ``entity``'s short
    paragraph cut into sentences, each put at a random depth (in their order) among filler
    sentences about the same entity, which state none of its facts."""
    facts = _sentences(entity.document())
    noun = _NOUNS[entity.kind]
    pool = [f.format(title=entity.title, noun=noun) for f in _FILLER]
    rng.shuffle(pool)
    filler: list[str] = []
    budget = tokens - count_tokens(" ".join(facts))
    for sentence in pool:
        if budget <= 0:
            break
        filler.append(sentence)
        budget -= count_tokens(sentence) + 1
    # Fact sentences at random depths, keeping their order (the second refers to the first).
    slots = sorted(rng.sample(range(len(filler) + len(facts)), len(facts)))
    body: list[str] = []
    fact_iter, fill_iter = iter(facts), iter(filler)
    for i in range(len(filler) + len(facts)):
        body.append(next(fact_iter) if i in slots else next(fill_iter))
    text = " ".join(body)
    return text[0].upper() + text[1:]


def transcript(entity: Entity, rng: random.Random) -> str:
    """The held-out shape: an oral-history interview about ``entity`` (200–290 tokens), a
    heading, then turns of ``INTERVIEWER:`` and ``RESIDENT:``; the three facts are told in the
    resident's words, each after a question, in random order among talk that states none of
    them. Nothing the training generator (prose paragraphs) or the tuning dev set (catalogue
    cards) produces has this shape."""
    noun = _NOUNS[entity.kind]
    values = {"person": entity.person, "year": entity.year, "town": entity.town}
    facts = [(asked, said.format(**values))
             for asked, said in zip(_ASKED, _SPOKEN[entity.kind], strict=True)]
    rng.shuffle(facts)
    opening, *others = _TALK
    turns = [opening, ("Tell me about " + entity.title + ".",
                       "Ah, the " + noun + ". Where to begin.")]
    rest = [(q.format(noun=noun), a) for q, a in rng.sample(others, rng.randint(2, 4))]
    for fact in facts:
        rest.insert(rng.randint(0, len(rest)), fact)
    lines = [f"Oral history recording: {entity.title}."]
    for asked, said in turns + rest:
        lines += [f"INTERVIEWER: {asked}", f"RESIDENT: {said}"]
    return "\n".join(lines)


#: fact → the Entity attribute that answers it
QUESTION_KINDS: dict[str, str] = {"who": "person", "when": "year", "where": "town"}
#: kind → (who, when, where) question templates
_QUESTIONS: dict[str, tuple[str, str, str]] = {
    "lighthouse": ("Who built {title}?", "In which year was {title} built?",
                   "Near which town does {title} stand?"),
    "workshop": ("Who founded {title}?", "In which year was {title} founded?",
                 "In which town is {title}?"),
    "ship": ("Who was the first captain of {title}?", "In which year was {title} launched?",
             "From which town was {title} launched?"),
    "festival": ("Who started {title}?", "In which year was {title} started?",
                 "In which town is {title} held?"),
    "observatory": ("Who founded {title}?", "In which year was {title} founded?",
                    "Above which village does {title} sit?"),
    "bridge": ("Who designed {title}?", "In which year was {title} completed?",
               "At which town does {title} cross the river?"),
}
_ASK = {"who": " Answer with the full name.", "when": " Answer with the year.",
        "where": " Answer with the name of the place."}


@dataclass(frozen=True, slots=True)
class Question:
    """One question with its documents (in the order a retriever returned them)."""

    question: str
    answer: str
    fact: str
    documents: tuple[str, ...]
    target: int

    @property
    def answer_document(self) -> str:
        """The one document that holds the answer."""
        return self.documents[self.target]


def make_entities(count: int, seed: int = 0) -> list[Entity]:
    """``count`` entities with unique names, people and towns (deterministic for ``seed``)."""
    rng = random.Random(seed)
    used: set[str] = set()
    kinds = list(_KINDS)
    entities = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        name = _unique(rng, used, lambda: _word(rng, 2).capitalize())
        surname = _unique(rng, used, lambda: _word(rng, 1).capitalize() + rng.choice(_SURNAME_ENDS))
        town = _unique(rng, used, lambda: _word(rng, 1).capitalize() + rng.choice(_TOWN_ENDS))
        entities.append(Entity(
            kind=kind, name=name, person=f"{rng.choice(_FIRST_NAMES)} {surname}",
            year=rng.randint(1702, 1968), town=town, detail=rng.choice(_DETAILS[kind]),
        ))
    return entities


def make_questions(count: int, n_docs: int, seed: int = 0, *, size: str = "short",
                   count_tokens: Callable[[str], int] | None = None) -> list[Question]:
    """``count`` questions, each over ``n_docs`` documents in random order, exactly one of
    which answers it. Facts cycle through who / when / where. ``size`` is ``"short"``,
    ``"long"`` (:data:`LONG_DOC_TOKENS`, measured with ``count_tokens``, e.g. a tokenizer's;
    by default estimated from characters) or ``"transcript"`` (the held-out shape,
    :func:`transcript`). The entities, facts and questions of every size are the same for
    one seed, so the sizes compare paired."""
    if n_docs < 1 or n_docs > count:
        raise ValueError("n_docs must be between 1 and count")
    if size not in DOC_SIZES:
        raise ValueError(f"size must be one of {', '.join(DOC_SIZES)}, not {size!r}")
    entities = make_entities(count, seed)
    if size == "short":
        documents = [e.document() for e in entities]
    elif size == "transcript":
        doc_rng = random.Random(seed * 104729 + 29)
        documents = [transcript(e, doc_rng) for e in entities]
    else:
        doc_rng = random.Random(seed * 104729 + 17)
        low, high = LONG_DOC_TOKENS
        documents = [long_document(e, doc_rng, doc_rng.randint(low + 16, high - 16),
                                   count_tokens or _approx_tokens) for e in entities]
    rng = random.Random(seed * 7919 + n_docs)
    facts = list(QUESTION_KINDS)
    questions = []
    for i, entity in enumerate(entities):
        fact = facts[(i + i // len(_KINDS)) % len(facts)]
        attribute = QUESTION_KINDS[fact]
        template = _QUESTIONS[entity.kind][facts.index(fact)]
        text = template.format(title=entity.title) + _ASK[fact]
        others = rng.sample([j for j in range(count) if j != i], n_docs - 1)
        order = [i, *others]
        rng.shuffle(order)
        questions.append(Question(
            question=text, answer=str(getattr(entity, attribute)), fact=fact,
            documents=tuple(documents[j] for j in order), target=order.index(i),
        ))
    return questions


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(syllables))


def _unique(rng: random.Random, used: set[str], make) -> str:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        word = make()
        if word.lower() not in used and len(word) >= 4:
            used.add(word.lower())
            return word
    raise RuntimeError("ran out of unique invented names")


__all__ = ["DOC_SIZES", "Entity", "LONG_DOC_TOKENS", "QUESTION_KINDS", "Question", "is_correct",
           "long_document", "make_entities", "make_questions", "normalize", "transcript"]
