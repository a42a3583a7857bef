"""The dev set is its own: deterministic, disjoint from the training data and from the
benchmark in entity kinds and names, every layout's messages hold every card, and each layout
lifts to the span query the engine would run (eight plus spans)."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from span_workflows.apps.bench import qa_set
from span_workflows.compiler.compile import Compiler
from span_workflows.query.span_options import SpanOptions
from span_workflows.tune import data, dev_set
from span_workflows.tune.dev_eval import chat_prompt_ids, dev_query, stock_prompt_ids
from span_workflows.tune.dev_set import (
    DOCS_PER_QUESTION,
    FACTS,
    LAYOUTS,
    is_correct,
    make_dev_set,
)

QUESTIONS = make_dev_set(30, seed=0)
#: bigrams every dev name holds and no name of the other two generators can
_DEV_BIGRAMS = ("au", "eu", "aa", "oe")


def _text(question: dev_set.DevQuestion) -> str:
    return " ".join([question.system, *question.documents, question.question, question.answer,
                     *(m["content"] for m in question.messages())])


def test_the_dev_set_is_deterministic_and_shaped_as_promised() -> None:
    assert make_dev_set(30, seed=0) == QUESTIONS
    assert make_dev_set(30, seed=1) != QUESTIONS
    assert [q.layout for q in QUESTIONS] == [LAYOUTS[i % 5] for i in range(30)]
    assert Counter((q.layout, q.fact) for q in QUESTIONS[:15]) == Counter(
        {(layout, fact): 1 for layout in LAYOUTS for fact in FACTS})
    for q in QUESTIONS:
        assert len(q.documents) == DOCS_PER_QUESTION == len(set(q.documents))
        sizes = [dev_set.estimate_tokens(d) for d in q.documents]
        assert min(sizes) >= 120 and max(sizes) <= 250
        target = q.documents[q.target]
        assert q.answer in target
        title = re.search(r"(?:Invention|Orchard|Tower|Object|Title): The (.+)\.",
                          target).group(1)
        assert title.split()[0] in q.question
        # the item asked about is on one card only
        assert [title in d for d in q.documents].count(True) == 1
        if q.fact == "who":
            assert len(q.answer.split()) == 2
        elif q.fact == "when":
            assert q.answer.isdigit() and len(q.answer) == 4


def test_every_layout_puts_every_card_in_its_messages() -> None:
    for q in QUESTIONS[:10]:
        messages = q.messages()
        assert all(set(m) == {"role", "content"} for m in messages)
        assert {m["role"] for m in messages} <= {"system", "user"}
        assert messages[-1]["role"] == "user" and q.question in messages[-1]["content"]
        for doc in q.documents:
            assert [doc in m["content"] for m in messages].count(True) == 1
    rag, system, user, numbered, sources = QUESTIONS[:5]
    assert len(rag.messages()) == 10
    assert system.messages()[0]["content"].startswith(dev_set.LANGCHAIN_SYSTEM + "\n\n")
    assert user.messages()[1]["content"].startswith("Context:\n")
    assert numbered.messages()[1]["content"].startswith("[1] " + numbered.documents[0])
    assert "Source: " + dev_set.source_name(sources.documents[3]) + "\n" + \
        sources.documents[3] in sources.messages()[1]["content"]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_nothing_of_the_training_data_or_the_benchmark_is_in_the_dev_set() -> None:
    questions = make_dev_set(200, seed=0)
    dev_words = set().union(*(_words(_text(q)) for q in questions))
    # no entity kind of theirs, singular or plural; no kind of ours is one of theirs
    theirs = {w for kind in [*data._KINDS, *qa_set._KINDS] for w in kind.split()}
    plurals = {w + "s" for w in theirs} | {w[:-1] + "ies" for w in theirs if w.endswith("y")}
    assert not dev_words & (theirs | plurals), dev_words & (theirs | plurals)
    assert not {w for k in dev_set._KINDS for w in k.split()} & theirs
    # names: our first names and endings are our own, and no name of ours can be theirs
    assert not set(dev_set._FIRST_NAMES) & (set(data._FIRST_NAMES) | set(qa_set._FIRST_NAMES))
    their_ends = {*data._SURNAME_ENDS, *data._TOWN_ENDS, *qa_set._SURNAME_ENDS,
                  *qa_set._TOWN_ENDS}
    records = dev_set.make_records(3000, random.Random(5))
    ours = {w.lower() for r in records for w in (r.name, r.person.split()[1], r.town)}
    for name in ours:
        assert not name.endswith(tuple(their_ends)), name
        assert any(b in name for b in _DEV_BIGRAMS), name
    facts = data.make_facts(3000, random.Random(5))
    entities = qa_set.make_entities(3000, seed=5)
    train_names = {w.lower() for f in facts
                   for w in (f.name, f.person.split()[1], f.town, f.keeper.split()[1])}
    bench_names = {w.lower() for e in entities for w in (e.name, e.person.split()[1], e.town)}
    for name in train_names | bench_names:
        assert not any(b in name for b in _DEV_BIGRAMS), name
    assert not ours & (train_names | bench_names)
    # and our questions' instructions are no one else's
    assert "Answer with" not in " ".join(_text(q) for q in questions)
    assert not set(dev_set.SYSTEM_PROMPTS) & set(data.SYSTEM_PROMPTS)


def test_the_checker_wants_the_whole_answer_in_the_words() -> None:
    assert is_correct("Anouk Vaakamp", "It was registered by anouk VAAKAMP.")
    assert is_correct("1834", "In 1834.")
    assert not is_correct("1834", "In 18345.")
    assert not is_correct("Anouk Vaakamp", "Anouk registered it.")
    assert not is_correct("", "anything")


def _plus_groups(spans) -> list[int]:
    """Sizes of the runs of consecutive plus spans."""
    groups: list[int] = []
    previous = None
    for span in spans:
        if span.kind == "plus":
            if previous == "plus":
                groups[-1] += 1
            else:
                groups.append(1)
        previous = span.kind
    return groups


@pytest.mark.parametrize("index", range(5))
def test_each_layout_lifts_to_eight_plus_spans(tokenizer, index: int) -> None:
    """``rag``, ``system`` and ``user`` lift to one plus of the eight cards; in ``numbered`` and
    ``sources`` the ``[k]`` / ``Source: ...`` line between two cards is text, not glue, so each
    card is a plus of its own, between ordered user messages. The engine's stock prompt is the
    user's chat only for ``rag``."""
    q = QUESTIONS[index]
    options = SpanOptions(attend="prefix", link_blocks=0)
    compiler = Compiler.for_tokenizer(tokenizer, 32, options=options)
    tq = compiler.compile_generate(dev_query(q), options=options)
    plus = [s for s in tq.spans if s.kind == "plus"]
    assert len(plus) == 8
    texts = [tokenizer.decode(tq.token_ids[s.offset: s.offset + s.content_tokens])
             for s in plus]
    for doc in q.documents:
        assert [doc in t for t in texts].count(True) == 1
    lifted_apart = q.layout in ("numbered", "sources")
    assert _plus_groups(tq.spans) == ([1] * 8 if lifted_apart else [8])
    if lifted_apart:  # the line before each card stays, in order, as a message of its own
        between = [tokenizer.decode(tq.token_ids[s.offset: s.offset + s.length])
                   for s in tq.spans if s.kind == "cross"]
        label = "[{}]" if q.layout == "numbered" else "Source: {}"
        names = (range(2, 9) if q.layout == "numbered"
                 else [dev_set.source_name(d) for d in q.documents[1:]])
        assert all(label.format(n) in b for n, b in zip(names, between, strict=False))
    stock = stock_prompt_ids(q, compiler)
    assert (stock == chat_prompt_ids(q, tokenizer)) == (q.layout == "rag")
    assert tokenizer.decode(stock).count("<|im_start|>user") == {
        "rag": 9, "system": 9, "user": 10, "numbered": 17, "sources": 17}[q.layout]
