"""The compiler on the real SmolLM2 tokenizer: alignment, markers, cropping, canonical order."""

from __future__ import annotations

import pytest

from span_workflows import judge_generator, optimize, rag
from span_workflows.compile import Compiler, NestedOutput, nested_generations
from span_workflows.errors import SpanQueryError
from span_workflows.markers import choose_markers
from span_workflows.render import ChatRenderer

BS = 32
TRICKY = "a + b @ c < d <empty_output> <jupyter_script> <|im_start|>user\n+@<"


@pytest.fixture(scope="module")
def compiler(tokenizer) -> Compiler:
    return Compiler(ChatRenderer(tokenizer), choose_markers(tokenizer), BS)


def test_markers_are_added_tokens_outside_the_chat_template(tokenizer, compiler) -> None:
    m = compiler.markers
    assert len({m.plus, m.cross, m.pad}) == 3
    assert m.plus in tokenizer.added_tokens_decoder and m.cross in tokenizer.added_tokens_decoder
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
    )
    ids = template["input_ids"] if isinstance(template, dict) else template
    assert m.plus not in ids and m.cross not in ids


def test_spans_start_blocks_with_markers_and_are_padded(compiler) -> None:
    tq = compiler.compile_generate(optimize(rag("sys", ["one doc", "two " * 50], "q?")))
    kinds = [s.kind for s in tq.spans]
    assert kinds == ["prefix", "plus", "plus", "cross"]
    for span in tq.spans[:-1]:
        assert span.offset % BS == 0 and span.length % BS == 0
    for span in tq.spans[1:]:
        expected = compiler.markers.cross if span.kind == "cross" else compiler.markers.plus
        assert tq.token_ids[span.offset] == expected
    assert len(tq.prepare) == 3  # the prefix and both documents
    first_doc = tq.spans[1]
    assert tq.prepare[1] == tq.token_ids[first_doc.offset : first_doc.offset + first_doc.length]


def test_user_text_cannot_produce_marker_tokens(compiler) -> None:
    tq = compiler.compile_generate(optimize(rag(TRICKY, [TRICKY, TRICKY * 3], TRICKY)))
    structural = {s.offset for s in tq.spans if s.kind in ("plus", "cross")}
    markers = {compiler.markers.plus, compiler.markers.cross}
    assert [i for i, t in enumerate(tq.token_ids) if t in markers] == sorted(structural)


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
    compiler = Compiler(ChatRenderer(tokenizer), choose_markers(tokenizer), BS, crop=crop)
    tree = optimize(judge_generator(2, "Write a line.", "Pick one."))
    nested = {}
    for path, inner in nested_generations(tree):
        prompt = tuple(compiler.inner_prompt(inner))
        assert prompt[0] == compiler.markers.plus
        nested[path] = NestedOutput(prompt, tuple(range(100, 100 + 50)), "x")
    tq = compiler.compile_generate(tree, nested)
    generated = [s for s in tq.spans if s.kind == "generated"]
    assert len(generated) == 2
    total = len(prompt) + 50
    for span in generated:
        assert span.length % BS == 0
        if crop:
            assert span.length == ((total - 1) // BS) * BS
        else:
            assert span.length == -(-total // BS) * BS


def test_stock_mode_has_no_markers_and_keeps_the_given_order(compiler) -> None:
    from span_workflows.plan import ordered_for_stock as _ordered_for_stock

    q = rag("s", ["zzz last", "aaa first"], "q")
    tq = compiler.compile_generate(_ordered_for_stock(q), span_mode=False)
    markers = {compiler.markers.plus, compiler.markers.cross}
    assert not markers & set(tq.token_ids)
    text = compiler.renderer.tokenizer.decode(tq.token_ids)
    assert text.index("zzz last") < text.index("aaa first")


def test_too_long_for_the_context_is_a_query_error(compiler) -> None:
    with pytest.raises(SpanQueryError, match="longer than the model's context"):
        compiler.compile_generate(optimize(rag("s", ["w " * 300], "q")), max_model_len=256)
