"""The compiler on the real SmolLM2 tokenizer: alignment, segments, padding, cropping,
canonical order, prepares per span mode."""

from __future__ import annotations

import pytest

from span_vllm.contract import ANCHORED, ISOLATED, ORDERED
from span_workflows import judge_generator, optimize, rag
from span_workflows.compiler.compile import Compiler, NestedOutput, nested_generations
from span_workflows.errors import SpanQueryError
from span_workflows.query.span_options import SpanOptions

BS = 32
TRICKY = "a + b @ c < d <empty_output> <jupyter_script> <|im_start|>user\n+@<"


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
    return Compiler.for_tokenizer(tokenizer, BS)


def test_marker_is_an_added_token_outside_the_chat_template(tokenizer, compiler) -> None:
    marker = compiler.tokens.marker
    assert marker in tokenizer.added_tokens_decoder and marker != compiler.tokens.pad
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
    )
    ids = template["input_ids"] if isinstance(template, dict) else template
    assert marker not in ids


def test_spans_are_block_aligned_padded_and_described_by_segments(compiler) -> None:
    tq = compiler.compile_generate(optimize(rag("sys", ["one doc", "two " * 50], "q?")))
    kinds = [s.kind for s in tq.spans]
    assert kinds == ["prefix", "plus", "plus", "cross"]
    for span in tq.spans[:-1]:
        assert span.offset % BS == 0 and span.length % BS == 0
    assert [s[:2] for s in tq.segments] == [(tq.spans[1].offset, ANCHORED),
                                            (tq.spans[2].offset, ANCHORED),
                                            (tq.spans[3].offset, ORDERED)]
    # the default links the second span's first block (the first already follows the prefix)
    assert [len(s) for s in tq.segments] == [2, 3, 2]
    assert compiler.tokens.marker not in tq.token_ids  # no marker unless asked for
    for span in tq.spans[:-1]:
        assert all(tq.token_ids[i] == compiler.tokens.pad for i in span.padding)


def test_prefix_mode_prepares_each_span_after_the_prefix(compiler) -> None:
    tq = compiler.compile_generate(optimize(rag("sys", ["one doc", "two " * 50], "q?")))
    prefix = tq.spans[0]
    head = tuple(tq.token_ids[: prefix.length])
    assert [len(stage) for stage in tq.prepare_stages] == [3]
    assert tq.prepare[0].token_ids == head and tq.prepare[0].segments == ()
    for span, prep in zip(tq.spans[1:3], tq.prepare[1:], strict=True):
        body = tuple(tq.token_ids[span.offset: span.offset + span.length])
        assert prep.token_ids == head + body
        assert prep.segments == ((prefix.length, ANCHORED),)


def test_self_mode_prepares_each_span_alone(compiler) -> None:
    tq = compiler.compile_generate(optimize(rag("sys", ["one doc", "two " * 50], "q?")),
                                   options=SpanOptions(attend="self"))
    assert [s[1] for s in tq.segments] == [ISOLATED, ISOLATED, ORDERED]
    for span, prep in zip(tq.spans[1:3], tq.prepare[1:], strict=True):
        assert prep.token_ids == tuple(tq.token_ids[span.offset: span.offset + span.length])
        assert prep.segments == ((0, ISOLATED),)


def test_a_second_plus_is_prepared_after_the_first_in_its_context(compiler) -> None:
    from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User

    q = Generate(Cross((System("s"), Plus((Fragment("a"), Fragment("b"))), User("u1"),
                        Plus((Fragment("c"), Fragment("d"))), User("u2"))), 8, 0.0)
    tq = compiler.compile_generate(q)
    assert [len(stage) for stage in tq.prepare_stages] == [3, 2]
    second = tq.prepare_stages[1][0]
    start = tq.spans[4].offset  # after s, a, b, u1
    assert second.token_ids[:start] == tuple(tq.token_ids[:start])
    assert second.segments == (*tq.segments[:3], (start, ANCHORED))


def test_link_requests_read_the_earlier_spans_of_their_plus_unlinked(compiler) -> None:
    docs = ["one " * 40, "two " * 40, "three " * 40]
    tq = compiler.compile_generate(optimize(rag("sys", docs, "q?")))
    assert [len(stage) for stage in tq.link_stages] == [2]  # the first span follows its context
    for link in tq.links:
        *earlier, own = link.segments
        assert len(own) == 3 and own[2] == 1  # its own link block
        assert all(len(s) == 2 for s in earlier)  # earlier spans as cached: unlinked
        assert len(link.token_ids) == own[0] + BS
        assert link.token_ids == tuple(tq.token_ids[: len(link.token_ids)])


def test_a_later_plus_links_after_the_earlier_plus_as_linked(compiler) -> None:
    from span_workflows.query.ir import Cross, Fragment, Generate, Plus, System, User

    long = ["a " * 40, "b " * 40]
    q = Generate(Cross((System("s"), Plus(tuple(map(Fragment, long))), User("u1"),
                        Plus((Fragment("c " * 40), Fragment("d " * 40))), User("u2"))), 8, 0.0)
    tq = compiler.compile_generate(q)
    assert [len(stage) for stage in tq.link_stages] == [1, 1]
    second = tq.link_stages[1][0]
    assert second.segments[:3] == tq.segments[:3]  # the first plus with its link block
    assert len(second.segments[-1]) == 3 and len(second.segments[-2]) == 2


def test_the_only_span_of_the_last_plus_is_computed_by_the_main_request(compiler) -> None:
    """A plus of one span in prefix mode, followed only by ordered text, is computed by the
    main request exactly in its own context: it needs no prepare, and neither does the
    prefix before it."""
    one = compiler.compile_generate(optimize(rag("sys", ["one doc"], "q?")))
    assert one.main_computes_from == 0 and one.prepare == [] and one.links == []
    two = compiler.compile_generate(optimize(rag("sys", ["one doc", "two"], "q?")))
    assert two.main_computes_from == two.spans[-1].offset and len(two.prepare) == 3
    isolated = compiler.compile_generate(optimize(rag("sys", ["one doc"], "q?")),
                                         options=SpanOptions(attend="self"))
    assert isolated.main_computes_from == isolated.spans[-1].offset  # not at position 0
    assert len(isolated.prepare) == 2


@pytest.mark.parametrize("pad", ["after", "inside", "before"])
@pytest.mark.parametrize("marker", [False, True])
def test_layouts_keep_every_text_and_differ_only_in_padding(tokenizer, compiler, pad,
                                                            marker) -> None:
    options = SpanOptions(pad=pad, marker=marker)
    docs = ["The first document.", "A second, longer document with + and @."]
    tq = compiler.compile_generate(optimize(rag("Be brief.", docs, "What is it?")),
                                   options=options)
    padding = {i for s in tq.spans for i in s.padding}
    markers = [i for i, t in enumerate(tq.token_ids) if t == compiler.tokens.marker]
    starts = sorted(s.offset for s in tq.spans if s.kind in ("plus", "cross"))
    assert markers == (starts if marker else [])
    rest = [t for i, t in enumerate(tq.token_ids) if i not in padding and i not in markers]
    stock = compiler.compile_generate(optimize(rag("Be brief.", docs, "What is it?")),
                                      span_mode=False)
    assert rest == stock.token_ids[: len(rest)] or sorted(rest) == sorted(stock.token_ids)
    for span in tq.spans:
        if span.pad_tokens and span.kind == "plus":
            body = tq.token_ids[span.offset: span.offset + span.length]
            text = tokenizer.decode([t for t in body if t != compiler.tokens.marker])
            if pad == "before":
                assert text.startswith("\n") and "<|im_start|>" in text
            elif pad == "inside":
                assert "\n\n<|im_end|>" in text or text.endswith("\n")
            else:
                assert text.endswith("<|im_end|>\n\n") or text.endswith("\n\n")


def test_user_text_cannot_produce_the_marker_token(compiler) -> None:
    tq = compiler.compile_generate(optimize(rag(TRICKY, [TRICKY, TRICKY * 3], TRICKY)),
                                   options=SpanOptions(marker=True))
    structural = {s.offset for s in tq.spans if s.kind in ("plus", "cross")}
    assert [i for i, t in enumerate(tq.token_ids) if t == compiler.tokens.marker] == sorted(
        structural)


def test_decoding_the_token_form_gives_back_the_texts(tokenizer, compiler) -> None:
    docs = ["The first document.", "A second, longer document with + and @."]
    tq = compiler.compile_generate(optimize(rag("Be brief.", docs, "What is it?")))
    text = tokenizer.decode(tq.token_ids)
    for piece in [*docs, "Be brief.", "What is it?"]:
        assert piece in text


def test_any_document_order_compiles_to_the_same_tokens(compiler) -> None:
    a = compiler.compile_generate(optimize(rag("s", ["x", "y", "z"], "q")))
    b = compiler.compile_generate(optimize(rag("s", ["z", "x", "y"], "q")))
    assert a.token_ids == b.token_ids


def test_span_tokens_do_not_depend_on_their_position(compiler) -> None:
    a = compiler.compile_generate(optimize(rag("s", ["alpha doc"], "q")))
    b = compiler.compile_generate(optimize(rag("a much longer system " * 9, ["alpha doc"], "q2")))
    span_a = next(s for s in a.spans if s.kind == "plus")
    span_b = next(s for s in b.spans if s.kind == "plus")
    assert (a.token_ids[span_a.offset : span_a.offset + span_a.length]
            == b.token_ids[span_b.offset : span_b.offset + span_b.length])


@pytest.mark.parametrize("crop", [True, False])
def test_nested_outputs_are_cropped_to_whole_blocks_or_padded(tokenizer, crop) -> None:
    compiler = Compiler.for_tokenizer(tokenizer, BS, crop=crop)
    tree = optimize(judge_generator(2, "Write a line.", "Pick one."))
    nested = {}
    for path, inner in nested_generations(tree):
        inner_prompt = compiler.inner_prompt(inner)
        assert inner_prompt.segments == ((0, ISOLATED),)
        prompt = inner_prompt.token_ids
        nested[path] = NestedOutput(prompt, tuple(range(100, 100 + 50)), "x")
    tq = compiler.compile_generate(tree, nested)
    assert [s[1] for s in tq.segments if s[1] != ORDERED] == [ISOLATED, ISOLATED]
    generated = [s for s in tq.spans if s.kind == "generated"]
    assert len(generated) == 2
    total = len(prompt) + 50
    for span in generated:
        assert span.length % BS == 0
        if crop:
            assert span.length == ((total - 1) // BS) * BS
        else:
            assert span.length == -(-total // BS) * BS


def test_stock_mode_has_no_segments_and_keeps_the_given_order(compiler) -> None:
    from span_workflows.compiler.optimize import ordered_for_stock as _ordered_for_stock

    q = rag("s", ["zzz last", "aaa first"], "q")
    tq = compiler.compile_generate(_ordered_for_stock(q), span_mode=False)
    assert tq.segments == () and tq.prepare == []
    text = compiler.renderer.tokenizer.decode(tq.token_ids)
    assert text.index("zzz last") < text.index("aaa first")


def test_too_long_for_the_context_is_a_query_error(compiler) -> None:
    with pytest.raises(SpanQueryError, match="longer than the model's context"):
        compiler.compile_generate(optimize(rag("s", ["w " * 300], "q")), max_model_len=256)
