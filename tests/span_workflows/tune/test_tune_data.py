"""The training data is its own: disjoint from the benchmark's held-out question set in entity
kinds, names, templates, phrasings and system prompts, and shaped as the README says."""

from __future__ import annotations

import random
import re

from span_workflows.apps.bench import qa_set
from span_workflows.apps.bench import quality as bench_quality
from span_workflows.tune import data


def test_documents_questions_and_answers_have_the_promised_shapes(tokenizer) -> None:
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    examples = data.make_examples(120, seed=3, count_tokens=count)
    assert examples == data.make_examples(120, seed=3, count_tokens=count)
    sizes = [count(d) for e in examples for d in e.documents]
    assert 56 <= min(sizes) and max(sizes) <= 560  # 64-512 tokens, to a sentence
    assert min(sizes) < 120 and max(sizes) > 380  # short and long both occur
    per_prompt = [len(e.documents) for e in examples]
    assert min(per_prompt) == 2 and max(per_prompt) >= 8 and max(per_prompt) <= 10
    needs = [e.needs for e in examples]
    assert needs.count(0) >= 5 and needs.count(2) >= 5 and needs.count(1) > 80
    for e in examples:
        if e.needs == 0:
            assert e.answer == data.NOT_FOUND
        else:  # every name in the answer is in the documents
            for name in set(re.findall(r"[A-Z][a-z]+", e.answer)) - {"The", "Near", "In"}:
                # a name as written; a colour starts the answer, capitalized
                assert any(name in d or name.lower() in d for d in e.documents), (name, e)


def test_nothing_of_the_benchmark_question_set_appears_in_the_training_data() -> None:
    examples = data.make_examples(300, seed=0)
    train_text = " ".join(" ".join((e.system, *e.documents, e.question, e.answer))
                          for e in examples)
    held_out = qa_set.make_questions(240, 4, seed=0)
    entities = qa_set.make_entities(240, seed=0)
    assert not set(data._KINDS) & set(qa_set._KINDS)
    for entity in entities:
        for name in (entity.name, entity.person.split()[1], entity.town):
            assert name not in train_text
    # benchmark names cannot be produced by the training syllables and vice versa
    train_names = {f.name.lower() for f in data.make_facts(2000, random.Random(1))}
    bench_names = {e.name.lower() for e in qa_set.make_entities(2000, seed=1)}
    assert not train_names & bench_names
    assert not set(data._FIRST_NAMES) & set(qa_set._FIRST_NAMES)
    assert bench_quality.SYSTEM not in data.SYSTEM_PROMPTS
    # no question is phrased the same (entity titles abstracted); the benchmark's always end
    # in an instruction ("Answer with the full name.") the training data never uses
    titles = re.compile(r"the [A-Z][a-z]+( [A-Z][a-z]+)?")
    bench_questions = {titles.sub("T", q.question) for q in held_out}
    train_questions = {titles.sub("T", e.question) for e in examples}
    assert not bench_questions & train_questions
    assert "Answer with" not in train_text
    for sentence in qa_set._FILLER:
        assert sentence.split("{")[0] not in train_text or len(sentence.split("{")[0]) < 12


def test_plain_passages_are_prose_and_never_standard_library_documentation() -> None:
    passages = data.plain_passages(20)
    assert len(passages) == 20
    assert all(100 <= len(p.split()) <= 160 for p in passages)
    from span_workflows.apps.demo.corpus import stdlib_passages

    stdlib = {p.text[:60] for p in stdlib_passages(["json", "pathlib"])}
    assert not any(p[:60] in stdlib for p in passages)


def _tool_results(example) -> list[str]:
    """The names of the tools whose results the turn's messages hold."""
    return [text.split()[1] for role, text in example.messages if role == "tool"]


def test_agent_turns_call_what_is_still_needed_then_answer_from_the_results() -> None:
    from span_workflows.query.sampling import parse_answer
    from span_workflows.tune.tool_data import make_tool_examples

    turns = make_tool_examples(200, seed=4)
    assert turns == make_tool_examples(200, seed=4)
    calling = answering = 0
    for turn in turns:
        offered = {t.name for t in turn.tools}
        assert set(turn.used) <= set(_tool_results(turn)) and set(turn.used) <= offered
        content, calls = parse_answer(turn.answer)
        question = next(text for role, text in turn.messages if role == "user")
        if calls:
            calling += 1
            names = [c.name for c in calls]
            assert set(names) <= offered and not set(names) & set(_tool_results(turn))
            towns = {v for c in calls for v in c.arguments.values()}  # one town, asked about
            assert len(towns) == 1 and towns.pop() in question, turn
        else:
            answering += 1
            assert content
            for role, text in turn.messages:  # the answer repeats every result it read
                if role == "tool":
                    assert text.split(": ", 1)[1] in content
    assert calling > 80 and answering > 40
    # some turns come after a turn that called several tools at once, some after one call
    histories = [len(_tool_results(t)) for t in turns]
    assert max(histories) >= 2 and histories.count(1) > 10


def test_agent_turns_share_nothing_with_the_agent_tests() -> None:
    from span_workflows.tune.tool_data import make_tool_examples

    text = " ".join(
        " ".join([*(m for _, m in t.messages), *(s.name + s.description for s in t.tools),
                  t.answer]) for t in make_tool_examples(400, seed=0))
    for held_out in ("weather", "population", "Varnholm", "inhabitants", "Foggy"):
        assert held_out.lower() not in text.lower(), held_out


def test_the_default_recipe_reaches_eight_to_twelve_documents() -> None:
    """The recipe that trains the bundled adapter: 2-12 documents per prompt, at least a fifth
    of its prompts with 8 or more (where span mode lost most), no link blocks (the options the
    adapter is served with), self-distillation on, a dev-set learning curve."""
    from span_workflows.tune.train import RECIPES, TRAINED_OPTIONS

    recipe = RECIPES["default"]
    assert recipe.docs_per_prompt == (2, 12) and recipe.link_share == 0.0
    assert TRAINED_OPTIONS["link_blocks"] == 0
    assert recipe.kl_weight > 0 and recipe.tool_share > 0 and recipe.dev_questions > 0
    examples = data.make_examples(600, seed=recipe.seed, doc_tokens=recipe.doc_tokens,
                                  docs_per_prompt=recipe.docs_per_prompt)
    per_prompt = [len(e.documents) for e in examples]
    assert min(per_prompt) == 2 and max(per_prompt) == 12
    assert sum(n >= 8 for n in per_prompt) >= len(per_prompt) / 5


def test_make_adapter_resumes_the_committed_run_and_installs_only_a_finished_one() -> None:
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    if shutil.which("make") is None:
        raise AssertionError("make is needed to build this project")
    said = subprocess.run(["make", "-n", "adapter", "STAMP=/dev/null", "TUNE_HOURS=2"],
                          cwd=root, capture_output=True, text=True, check=True).stdout
    lines = said.replace("\\\n", " ").splitlines()  # one line per shell command
    tune = next(i for i, line in enumerate(lines) if " tune --recipe default " in line)
    assert "--out training/adapter-run" in lines[tune] and "--hours 2" in lines[tune]
    guard = next(i for i, line in enumerate(lines)
                 if "test -f training/adapter-run/adapter/adapter_model.safetensors" in line)
    then = lines[guard]
    install = then.index("mv span_workflows/adapters/smollm2-135m-instruct-span.new")
    assert tune < guard and then.index("test -f") < install
    assert install < then.index("rm -rf training/adapter-run &&")  # the run leaves the tree


def test_documents_name_two_people_and_the_questions_ask_for_either() -> None:
    """Each document names who made its entity and who keeps it now (the model must pick the
    right one), and a colour; some answers take two sentences."""
    rng = random.Random(5)
    for fact in data.make_facts(50, rng):
        assert fact.keeper and fact.keeper != fact.person and fact.colour
        text = data.document(fact, rng, 200)
        assert fact.person in text and fact.keeper in text and fact.colour in text
        maker, keeper = data._answer(fact, "who", rng), data._answer(fact, "keeper", rng)
        assert fact.person in maker and fact.keeper not in maker
        assert fact.keeper in keeper and fact.person not in keeper
        story = data._answer(fact, "story", rng)
        assert story.count(". ") == 1 and fact.person in story and fact.town in story
    examples = data.make_examples(400, seed=2)
    asked = {"keeper": 0, "colour": 0, "story": 0}
    for e in examples:
        if e.needs != 1:
            continue
        asked["keeper"] += "keys" in e.question or "visitors round" in e.question
        asked["colour"] += "shutters" in e.question
        asked["story"] += e.answer.count(". ") == 1
    assert all(count >= 20 for count in asked.values()), asked


def test_examples_come_in_the_layouts_framework_prompts_use(tokenizer) -> None:
    """Documents as messages of their own, inside the system message (LangChain's RAG
    tutorial), inside the user message, numbered, under source headers: every layout is drawn,
    its span form holds each document as a plus span, and the teacher reads the same
    messages as one plain chat."""
    from collections import Counter

    from span_workflows.tune.layouts import LAYOUTS, layout_messages
    from span_workflows.tune.train import ExampleStream, TuneConfig

    config = TuneConfig(examples=60, seed=4, span_share=0.8, text_share=0.0, tool_share=0.0,
                        doc_tokens=(48, 96), docs_per_prompt=(2, 4))
    stream = ExampleStream(config, tokenizer)
    examples = data.make_examples(60, seed=4, doc_tokens=(48, 96), docs_per_prompt=(2, 4),
                                  count_tokens=stream._count)
    seen: Counter[str] = Counter()
    for index, example in enumerate(examples):
        item = stream.item(index)
        seen[item.layout] += 1
        teacher = tokenizer.decode(item.teacher_ids)
        assert all(document in teacher for document in example.documents)
        if item.form == "span":
            plus = [s for s in item.query.spans if s.kind == "plus"]
            assert len(plus) == len(example.documents), item.layout
    assert set(seen) == set(LAYOUTS) and min(seen.values()) >= 3
    rng = random.Random(0)
    example = examples[0]
    for layout in LAYOUTS[1:]:
        messages = layout_messages(layout, example.system, example.documents,
                                   example.question, example.titles, rng)
        text = "\n".join(t for _, t in messages)
        assert all(d in text for d in example.documents) and example.question in text
        if layout == "sources":
            assert all(t in text for t in example.titles)
