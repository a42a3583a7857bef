"""Tree drawing and token-form HTML (no engine: the token form is compiled with a tokenizer)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from span_workflows.apps.demo.viz import draw_tree, show_token_form, tree_layout  # noqa: E402
from span_workflows.compiler.optimize import optimize  # noqa: E402
from span_workflows.query.builders import judge_generator, rag  # noqa: E402
from span_workflows.query.ir import iter_nodes  # noqa: E402


def test_layout_places_every_node_once_per_occurrence():
    q = optimize(judge_generator(3, "Write a haiku.", "Pick the best."))
    placed, edges = tree_layout(q)
    assert len(placed) == sum(1 for _ in iter_nodes(q))
    assert len(edges) == len(placed) - 1
    # parents sit above (smaller depth) and between their children
    for parent, child in edges:
        assert placed[parent][2] + 1 == placed[child][2]
    leaves = sorted(x for i, (_, x, _) in enumerate(placed) if all(p != i for p, _ in edges))
    assert leaves == [float(i) for i in range(len(leaves))]


def test_draw_tree_labels_every_node():
    import matplotlib.pyplot as plt

    q = rag("Be brief.", ["doc one", "doc two"], "Why?")
    ax = draw_tree(q)
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == sum(1 for _ in iter_nodes(q))
    assert any(t.startswith("G") for t in texts) and "+" in texts and "x" in texts
    assert any("doc one" in t for t in texts)
    plt.close(ax.figure)
    fig, ax2 = plt.subplots()
    assert draw_tree(q, ax2) is ax2
    plt.close(fig)


def test_show_token_form_highlights_spans(tokenizer):
    from span_workflows.compiler.compile import Compiler

    compiler = Compiler.for_tokenizer(tokenizer, 32)
    q = optimize(rag("Be brief.", ["doc <one> & more", "doc two"], "Why?", max_tokens=8))
    tq = compiler.compile_generate(q)
    out = show_token_form(tq, tokenizer)
    assert out.count("class='span span-plus'") == 2
    assert "span-prefix" in out and "span-cross" in out
    assert "doc &lt;one&gt; &amp; more" in out  # escaped
    assert f"<b>{len(tq.token_ids)} tokens</b>" in out
    assert "pad" in out
