"""The quality benchmark: its question set, its statistics, resuming from stored answers, its
table and plot, its CLI errors, and one tiny run on the real engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from span_workflows.apps.bench import quality as bq
from span_workflows.apps.bench.qa_set import QUESTION_KINDS, is_correct, make_questions
from span_workflows.apps.bench.report import print_table, wilson
from span_workflows.apps.cli.main import main

ROW_KEYS = {"model", "size", "seeds", "variant", "n_docs", "questions", "accuracy", "ci_low",
            "ci_high", "delta_vs_stock", "delta_low", "delta_high",
            *(f"acc_{k}" for k in QUESTION_KINDS), "kl_first_token", "kl_vs_layout",
            *(f"{m}_{p}" for m in ("acc", "n") for p in ("first", "middle", "last")),
            *bq.HIT_COLUMNS}


def test_each_question_is_answered_by_exactly_its_target_document() -> None:
    questions = make_questions(120, n_docs=8, seed=3)
    assert {q.fact for q in questions} == set(QUESTION_KINDS)
    assert len({q.target for q in questions}) > 4  # the answer is not always in one place
    for q in questions:
        assert len(q.documents) == len(set(q.documents)) == 8
        assert q.answer in q.answer_document
        if q.fact != "when":  # names and towns are unique; two entities may share a year
            assert sum(q.answer in d for d in q.documents) == 1, q


def test_long_documents_hold_the_same_facts_at_random_depths(tokenizer) -> None:
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    short = make_questions(60, n_docs=4, seed=2)
    long = make_questions(60, n_docs=4, seed=2, size="long", count_tokens=count)
    depths = []
    for s, q in zip(short, long, strict=True):
        assert (s.question, s.answer, s.target) == (q.question, q.answer, q.target)
        doc = q.answer_document
        assert 256 <= count(doc) <= 512
        assert q.answer in doc
        if q.fact != "when":
            assert sum(q.answer in d for d in q.documents) == 1
        sentences = doc.split(". ")
        depths.append(next(i for i, t in enumerate(sentences) if q.answer in t) / len(sentences))
        # the filler names no person, town or year: every capitalised name is the entity's
        # or one of its facts
        for word in {w.strip(".,") for w in doc.split() if w[:1].isupper()}:
            assert word in s.answer_document or word in {"Its", "It", "A", "The", "In",
                                                         "On", "At", "Some", "Every", "Over",
                                                         "Many", "Local", "Old", "Birds",
                                                         "Musicians", "Guided", "School",
                                                         "Storms", "Painters", "People",
                                                         "Visitors", "Travellers",
                                                         "Photographers", "Each"}, word
    assert min(depths) < 0.2 and max(depths) > 0.7  # near the start and near the end


def test_the_held_out_shape_is_an_interview_with_the_same_questions(tokenizer) -> None:
    """``transcript``: the same entities and questions as the prose sizes (paired), each
    answered by its target's interview alone, in the resident's words, at varying turns; a
    shape neither the tuning generator nor its dev set produces."""
    from span_workflows.tune import data, dev_set

    short = make_questions(60, n_docs=8, seed=2)
    heard = make_questions(60, n_docs=8, seed=2, size="transcript")
    turns = []
    for s, q in zip(short, heard, strict=True):
        assert (s.question, s.answer, s.target) == (q.question, q.answer, q.target)
        doc = q.answer_document
        assert doc.startswith("Oral history recording: ") and "\nINTERVIEWER: " in doc
        assert 190 <= len(tokenizer.encode(doc, add_special_tokens=False)) <= 300
        if q.fact != "when":
            assert sum(q.answer in d for d in q.documents) == 1
        lines = doc.splitlines()
        said = next(i for i, line in enumerate(lines) if q.answer in line)
        assert lines[said].startswith("RESIDENT: ")
        turns.append(said)
    assert len(set(turns)) >= 5  # the fact is told at varying turns
    text = "\n".join(d for q in heard for d in q.documents)
    assert "INTERVIEWER" not in " ".join(" ".join(e.documents) for e in data.make_examples(50))
    assert "INTERVIEWER" not in " ".join(" ".join(q.documents) for q in dev_set.make_dev_set(20))
    assert "Registered by" not in text


def test_the_question_set_is_deterministic_per_seed() -> None:
    assert make_questions(20, 4, seed=1) == make_questions(20, 4, seed=1)
    assert make_questions(20, 4, seed=1) != make_questions(20, 4, seed=2)


def test_answers_match_normalized_whole_words() -> None:
    assert is_correct("Bram Holtfeather", "It was built by bram  HOLTFEATHER.")
    assert is_correct("Zélmere", "near Zelmere, by the sea")
    assert not is_correct("Bram Holtfeather", "Bram Holtfeathers built it")
    assert not is_correct("1803", "in 18031")


def test_wilson_interval_and_top_k_kl() -> None:
    assert wilson(6, 6)[1] == 1.0 and wilson(0, 6)[0] == 0.0  # the interval holds p exactly
    low, high = wilson(50, 100)
    assert low < 0.5 < high and high - low == pytest.approx(0.192, abs=0.005)
    same = {1: math.log(0.7), 2: math.log(0.3)}
    assert bq.kl_top(same, same) == 0.0
    assert bq.kl_top(same, {1: math.log(0.3), 2: math.log(0.7)}) > 0.3


def _answers(correct: list[bool]) -> bq._Answers:
    facts = [list(QUESTION_KINDS)[i % 3] for i in range(len(correct))]
    return bq._Answers(correct, facts, [{7: -0.1, 8: -2.4}] * len(correct))


def test_stored_answers_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    store = bq.AnswerStore(path)
    key = store.key("prefix", 4, 3, 0, "m")
    store.put(key, _answers([True, False, True]))
    assert (store.read, store.measured_count) == (0, 1)
    reopened = bq.AnswerStore(path)
    assert reopened.get(key) == _answers([True, False, True])
    assert reopened.get(store.key("prefix", 8, 3, 0, "m")) is None
    assert (reopened.read, reopened.measured_count) == (1, 0)  # a miss is neither


def test_a_broken_answers_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    path = tmp_path / "answers.json"
    path.write_text("{not json")
    assert main(["bench", "quality", "--no-wait", "--answers", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--answers" in err and "Traceback" not in err


def test_unknown_variant_fails_before_the_engine_starts(capsys) -> None:
    assert main(["bench", "quality", "--no-wait", "--variants", "stock,prefx"]) == 2
    err = capsys.readouterr().err
    assert "prefx" in err and "prefix/link" in err and "Traceback" not in err


def test_paired_delta_and_new_combinations() -> None:
    assert bq.paired_delta([True] * 4, [True] * 4) == (0.0, 0.0, 0.0)
    delta, low, high = bq.paired_delta([True, False] * 50, [True] * 100)
    assert delta == -0.5 and low < -0.5 < high < 0
    pool = [f"doc {i}" for i in range(12)]
    seen, fresh = bq.new_combinations(pool, 4, 5)
    assert [len(s) for s in seen] == [4, 4, 4] and sorted(sum(seen, [])) == sorted(pool)
    sets = [frozenset(s) for s in seen]
    for combination in fresh:
        assert len(set(combination)) == 4 and frozenset(combination) not in sets
        sets.append(frozenset(combination))


def test_accuracy_by_where_the_answer_stands() -> None:
    correct = [True, False, True, True, False, True]
    targets = [0, 0, 1, 2, 3, 3]
    assert bq.by_position(correct, targets, 4) == {
        "acc_first": 0.5, "n_first": 2, "acc_middle": 1.0, "n_middle": 2,
        "acc_last": 0.5, "n_last": 2}
    assert bq.by_position([True], [0], 1)["acc_middle"] is None


def test_table_and_plot(tmp_path: Path) -> None:
    stock = _answers([True] * 3)
    rows = [{"model": model, "size": size,
             **bq._row(bq.VARIANTS[name], n, _answers(c), stock, None)}
            for model in ("base", "tuned") for size in ("short", "long")
            for name, c in (("stock", [True] * 3), ("prefix", [True, False, False]),
                            ("prefix/link", [True, True, False]))
            for n in (4, 8)]
    for row in rows:
        row["ttft_hit_s"], row["speedup_hit"], row["steps_hit"] = 0.01, 10.0, 2
        if row["variant"] == "stock":
            row["speedup_hit"], row["steps_hit"] = 1.0, 1
    table = bq.markdown_table(rows)
    assert table.count("\n") == 2 + len(rows)
    assert "| tuned | long | prefix | 8 | 3 | 33.3 | 6.1–79.2 | -66.7 |" in table
    assert "| 0.0 | 0.0…0.0 |" not in table and "| +0.0 | +0.0…+0.0 |" in table  # stock itself
    bq.plot_quality(rows, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 10_000


class CountingEngine:
    """The real engine, counting the calls that answer questions."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self._engine = engine
        self.answering_calls = 0
        self.weights: set[str] = set()  # the weights every span or stock query ran on

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name in ("execute_many", "complete_many"):
            self.answering_calls += 1
        call = getattr(self._engine, name)
        if name not in ("execute_many", "execute", "stock"):
            return call

        def noting(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = call(*args, **kwargs)
            for result in out if isinstance(out, list) else [out]:
                self.weights.add(result.metrics.weights)
            return out
        return noting


class _Said:
    """What a fake engine answers: the right answer for every other question."""

    def __init__(self, text: str) -> None:
        self.text, self.first_logprobs = text, {1: -0.1, 2: -2.5}


class _AnsweringEngine:
    """An engine stand-in for the bookkeeping of ``bench_quality`` (no model; the real
    engine's run is the next test): for a question of even length it says the first
    document, else that it does not know; it counts its calls."""

    model_dir = Path("/models/fake-0123456789abcdef")
    model_name = "fake"

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self.tokenizer, self.calls = tokenizer, 0

    def reset_cache(self) -> None:
        pass

    def execute_many(self, queries, **run):  # type: ignore[no-untyped-def]
        from span_workflows.query.ir import Plus, User

        self.calls += 1
        said = []
        for q in queries:
            question = [m.text for m in q.input.children if isinstance(m, User)][-1]
            first = next(m for m in q.input.children if isinstance(m, Plus)).children[0].text
            said.append(_Said(first if len(question) % 2 == 0 else "I do not know."))
        return said


def test_cells_pool_the_questions_of_every_seed_and_keep_them_by_code(
        tokenizer, tmp_path: Path, monkeypatch) -> None:
    fake = _AnsweringEngine(tokenizer)
    store = bq.AnswerStore(tmp_path / "answers.json")
    rows = bq.bench_quality(fake, ["prefix"], [2], 4, seeds=[0, 1], ttft_docs=0,
                            progress=False, store=store)
    assert fake.calls == 4  # stock and prefix, for each seed
    expected = []
    for seed in (0, 1):
        for q in make_questions(4, 2, seed):
            expected.append(len(q.question) % 2 == 0 and is_correct(q.answer, q.documents[0]))
    assert 0 < sum(expected) < 8  # the pooled accuracy below can tell the seeds apart
    targets = [q.target for seed in (0, 1) for q in make_questions(4, 2, seed)]
    for row in rows:
        assert row["seeds"] == [0, 1] and row["questions"] == 8
        assert row["accuracy"] == sum(expected) / 8
        # by where the answer stands (2 documents: first or last, none in the middle)
        assert row["n_first"] + row["n_last"] == 8 and row["acc_middle"] is None
        if row["variant"] == "prefix":
            last = [e for e, t in zip(expected, targets, strict=True) if t == 1]
            assert row["acc_last"] == (sum(last) / len(last) if last else None)
    keys = [k for k in json.loads((tmp_path / "answers.json").read_text())]
    assert sorted(k.split("|seed=")[1][0] for k in keys) == ["0", "0", "1", "1"]
    # read back, nothing answered again; another code version answers everything again
    fake.calls = 0
    again = bq.bench_quality(fake, ["prefix"], [2], 4, seeds=[0, 1], ttft_docs=0,
                             progress=False, store=bq.AnswerStore(tmp_path / "answers.json"))
    assert fake.calls == 0 and [r["accuracy"] for r in again] == [r["accuracy"] for r in rows]
    stock_code = bq.code_version(False)  # the span path changed: span answers only
    monkeypatch.setattr(bq, "code_version", lambda span: "changed" if span else stock_code)
    bq.bench_quality(fake, ["prefix"], [2], 4, seeds=[0, 1], ttft_docs=0, progress=False,
                     store=bq.AnswerStore(tmp_path / "answers.json"))
    assert fake.calls == 2


@pytest.mark.engine
def test_quality_rows_on_the_engine_and_resume(engine, tmp_path: Path) -> None:
    store = bq.AnswerStore(tmp_path / "answers.json")
    counting = CountingEngine(engine)
    names = ["prefix/link", "full@pad-after"]
    sizes = ("short", "long")
    rows = bq.bench_quality(counting, names, [2], 3, ttft_docs=2, ttft_doc_tokens=48, reps=1,
                            progress=False, store=store, sizes=sizes)
    assert counting.answering_calls == 6  # stock, prefix/link, full@: one batch per size
    # the rows measure the engine's own model, not the adapter it routes span queries to
    assert counting.weights == {engine.model_name}
    assert [(r["size"], r["variant"]) for r in rows] == [
        (size, name) for size in sizes for name in ("stock", "prefix/link", "full@pad-after")]
    for row in rows:
        assert set(row) == ROW_KEYS and row["questions"] == 3
        assert row["ci_low"] <= row["accuracy"] <= row["ci_high"]
        assert row["delta_low"] <= row["delta_vs_stock"] <= row["delta_high"]
    by_name = {(r["size"], r["variant"]): r for r in rows}
    for size in sizes:
        assert by_name[size, "stock"]["kl_first_token"] == 0.0  # stock against itself
        assert by_name[size, "stock"]["delta_vs_stock"] == 0.0
        linked = by_name[size, "prefix/link"]
        assert linked["kl_first_token"] > 0.0  # spans see less than the full prompt
        assert linked["kl_vs_layout"] is not None
        # a hit of a new combination: the links in the answer's own step
        assert linked["speedup_hit"] > 0 and linked["steps_hit"] == 1
        assert linked["steps_hit_own"] == 1 and by_name[size, "stock"]["steps_hit"] == 1
        assert by_name[size, "full@pad-after"]["ttft_hit_s"] is None
    saved = json.loads((tmp_path / "answers.json").read_text())
    answered = [k for k in saved if not k.startswith("ttft|")]
    assert len(answered) == 6 and all("links=batched" in k for k in answered if "/link" in k)
    # each answer is keyed by the code that made it: stock's by the stock path's alone
    stock_code, span_code = bq.code_version(False), bq.code_version(True)
    assert stock_code != span_code
    assert all(k.endswith(f"|code={stock_code if k.startswith('stock|') else span_code}")
               for k in answered)
    # stock's and the span variant's hits, at 16 x 440 and in each size's own pool
    assert len(saved) - len(answered) == 2 * (1 + len(sizes))

    counting.answering_calls = 0
    again = bq.bench_quality(counting, names, [2], 3, ttft_docs=2, ttft_doc_tokens=48, reps=1,
                             progress=False, store=bq.AnswerStore(tmp_path / "answers.json"),
                             sizes=sizes)
    assert counting.answering_calls == 0  # every answer came from the file
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in rows]
    assert [r["ttft_hit_s"] for r in again] == [r["ttft_hit_s"] for r in rows]  # and each hit


def test_perplexity_of_held_out_text_is_finite_and_names_the_standard_library(
        tokenizer) -> None:
    from span_workflows.apps.bench.perplexity import heldout_passages, perplexity
    from span_workflows.compiler.model import resolve_model

    passages = heldout_passages(3)
    assert len(passages) == 3 and len(set(passages)) == 3
    value = perplexity(resolve_model(progress=False), passages, max_tokens=64)
    assert 1.0 < value < 200.0
    # the same words in a random order score far worse
    import random

    words = " ".join(passages).split()
    random.Random(0).shuffle(words)
    shuffled = [" ".join(words[i::3]) for i in range(3)]
    assert perplexity(resolve_model(progress=False), shuffled, max_tokens=64) > 2 * value


def test_a_span_hit_ttft_is_measured_once_per_pool_and_kept(tmp_path: Path) -> None:
    """The 16 × 440-token TTFT does not depend on the rows' document size: a second run (of
    another size) reads it from the answers file instead of timing it again."""
    path = tmp_path / "answers.json"
    calls: list[str] = []

    def measure() -> tuple[float, int]:
        calls.append("timed")
        return 0.25, 1

    key = bq.AnswerStore.ttft_key("prefix", "440", 16, 1, "m")
    first = bq.AnswerStore(path)
    assert first.timed(key, measure) == (0.25, 1)
    second = bq.AnswerStore(path)
    assert second.timed(key, measure) == (0.25, 1)
    assert calls == ["timed"]
    assert (first.read, first.measured_count, second.read, second.measured_count) == (0, 1, 1, 0)
    other = bq.AnswerStore.ttft_key("prefix", "440", 16, 3, "m")  # other repetitions
    assert bq.AnswerStore(path).timed(other, measure) == (0.25, 1) and len(calls) == 2
    # another code version (a changed plan) is timed again, not read from an older entry
    newer = bq.AnswerStore.ttft_key("prefix", "440", 16, 1, "m", code="abc")
    assert newer != key and newer.endswith("|code=abc")
    assert bq.AnswerStore(path).timed(newer, measure) == (0.25, 1) and len(calls) == 3


def test_rows_of_an_earlier_run_merge_and_print_with_their_extra_columns() -> None:
    """An earlier run measured the model's perplexity, this one did not: merging keeps the
    earlier rows this run did not redo, replaces the ones it did, and the table prints every
    column (a dash where a row lacks one) instead of failing on the first row's keys."""
    def row(model: str, variant: str, accuracy: float, **more: float) -> dict:
        return {"model": model, "size": "long", "n_docs": 4, "variant": variant,
                "accuracy": accuracy, **more}

    previous = [row("base", "stock", 0.5, perplexity=22.9),
                row("base", "prefix", 0.25, perplexity=22.9),
                row("tuned", "stock", 0.75, perplexity=23.8)]
    ours = [row("base", "stock", 0.5), row("base", "prefix/link2", 0.5)]
    merged = bq.merge_rows(previous, ours)
    assert [(r["model"], r["variant"]) for r in merged] == [
        ("base", "prefix"), ("tuned", "stock"), ("base", "stock"), ("base", "prefix/link2")]
    lines: list[str] = []
    print_table(merged, lines.append)
    assert lines[0].split() == ["model", "size", "n_docs", "variant", "accuracy", "perplexity"]
    assert lines[-1].split()[-2:] == ["0.5000", "–"] and lines[1].split()[-1] == "22.9000"


def test_merging_drops_the_rows_of_other_weights() -> None:
    """A model measured again on another checkpoint, or its routed rows on other adapters:
    the earlier rows of those weights leave the table; rows of unchanged weights stay."""
    def row(variant: str, n_docs: int, model_dir: str, adapter: str) -> dict:
        return {"model": "base", "size": "short", "n_docs": n_docs, "variant": variant,
                "model_dir": model_dir, "adapters": {"span": adapter}, "accuracy": 0.5}

    previous = [row("stock", 8, "base-1", "a1"), row("routed", 8, "base-1", "a1"),
                row("prefix", 8, "base-1", "a1"),
                {**row("prefix", 8, "span-1", "-"), "model": "span"}]
    ours = [row("stock", 4, "base-1", "a2"), row("routed", 4, "base-1", "a2")]
    merged = bq.merge_rows(previous, ours)
    # base stock and prefix at 8 are still the base's answers; routed at 8 was adapter a1's
    assert [(r["variant"], r["n_docs"]) for r in merged if r["model"] == "base"] == [
        ("stock", 8), ("prefix", 8), ("stock", 4), ("routed", 4)]
    assert any(r["model"] == "span" for r in merged)  # another model: not measured here
    again = bq.merge_rows(merged, [{**row("prefix", 4, "span-2", "-"), "model": "span"}])
    assert [r["model_dir"] for r in again if r["model"] == "span"] == ["span-2"]


def test_a_models_perplexity_is_measured_once_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    calls: list[int] = []

    def measure() -> float:
        calls.append(1)
        return 22.9

    key = bq.AnswerStore.perplexity_key(40, "m-0123")
    assert bq.AnswerStore(path).measured(key, measure) == 22.9
    assert bq.AnswerStore(path).measured(key, measure) == 22.9 and calls == [1]


@pytest.mark.engine
def test_the_routed_variant_is_the_default_engines_answers(engine, tmp_path: Path) -> None:
    """``routed`` answers span queries on the weights the router picks (the span-ready
    adapter, its own options), stock stays on the base; its stored answers name the adapter
    by content digest, so a retrained adapter is answered anew."""
    from span_workflows.compiler.model import SPAN_MODEL_NAME

    counting = CountingEngine(engine)
    store = bq.AnswerStore(tmp_path / "answers.json")
    rows = bq.bench_quality(counting, ["routed"], [2], 4, ttft_docs=0, progress=False,
                            store=store)
    assert [r["variant"] for r in rows] == ["stock", "routed"]
    assert counting.weights == {engine.model_name, SPAN_MODEL_NAME}
    digest = engine.router.adapters[SPAN_MODEL_NAME].digest[:16]
    [routed_key] = [k for k in json.loads((tmp_path / "answers.json").read_text())
                    if k.startswith("routed|")]
    assert f"+{SPAN_MODEL_NAME}-{digest}" in routed_key


def test_every_span_variant_has_its_layout_read_with_full_attention() -> None:
    """``kl_vs_layout`` compares a span variant with the ``full@`` variant of its own tokens."""
    for name, variant in bq.VARIANTS.items():
        if variant.options is not None and not variant.layout_only:
            layout = bq.VARIANTS[bq._layout_name(variant.options)]
            assert layout.layout_only, name
            assert (layout.options.pad, layout.options.pad_text, layout.options.marker) == (
                variant.options.pad, variant.options.pad_text, variant.options.marker), name
