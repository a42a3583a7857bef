"""Each benchmark runs on tiny sizes and writes rows with the documented keys (no timing
assertions: speed goals live in the benchmarks themselves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from span_workflows.apps.bench import run as bench

RAG_KEYS = {"n_docs", "ttft_stock_s", "ttft_span_miss_s", "ttft_span_hit_s",
            "ttft_span_new_combination_s", "ttft_floor_s", "speedup_hit",
            "speedup_new_combination", "speedup_miss", "hit_over_floor",
            "new_combination_over_floor", "steps_stock", "steps_miss", "steps_hit",
            "steps_new_combination", "tokens_stock", "tokens_miss", "tokens_hit",
            "tokens_new_combination", "miss_tokens_over_stock", "hit_rate", "same_output",
            "weights_span", "weights_stock", "commit", "machine", "reps", "model", "model_dir",
            "adapters", "ttft_stock_new_docs_s", "ttft_span_new_docs_s", "speedup_new_docs",
            "steps_new_docs", "tokens_stock_new_docs", "tokens_new_docs",
            "ttft_stock_repeat_s", "tokens_stock_repeat", "new_combination_over_stock_repeat",
            "ttft_linked_new_combination_s", "steps_linked_new_combination",
            "tokens_linked_new_combination", "speedup_linked_new_combination",
            "linked_new_combination_over_floor", "link_blocks_linked", "link_requests_linked",
            "weights_linked"}


@pytest.mark.engine
def test_rag_bench_rows_have_the_documented_keys(engine) -> None:
    rows = bench.bench_rag(engine, [1, 3], doc_tokens=48, reps=1, progress=False)
    assert [r["n_docs"] for r in rows] == [1, 3]
    for row in rows:
        assert set(row) == RAG_KEYS
        assert row["ttft_span_hit_s"] > 0 and row["ttft_stock_s"] > 0
        assert 0.9 <= row["hit_rate"] <= 1.0
        assert row["same_output"] is True
        assert row["steps_stock"] == row["steps_hit"] == 1
        # span queries on the span-ready adapter, stock on the base, said in the row
        assert row["weights_span"] != row["weights_stock"] == engine.model_name
        assert row["model"] == engine.model_name and row["reps"] == 1
        # a miss computes every document, padded to whole blocks; a hit only the question
        assert row["tokens_miss"] >= row["tokens_stock"] > row["tokens_hit"] > 0
        assert row["miss_tokens_over_stock"] == row["tokens_miss"] / row["tokens_stock"]
        # stock's exact repeat reads every document from vLLM's prefix cache
        assert row["tokens_stock_repeat"] < row["tokens_stock"]
        # with the system prompt cached before, new documents compute less than a cold miss
        assert row["tokens_new_docs"] < row["tokens_miss"]
        assert row["steps_new_docs"] == row["steps_miss"]
    one, three = rows
    assert one["steps_miss"] == 1  # one document: the answer computes it, no prepare
    # the span-ready adapter needs no link blocks: a new combination is the answer's step
    assert three["steps_new_combination"] == 1
    # the base with its default (one link block a span): the links in the answer's own step,
    # computing the question and one block of each span after the first
    assert three["weights_linked"] == engine.model_name and three["link_blocks_linked"] == 1
    assert three["steps_linked_new_combination"] == 1 and three["link_requests_linked"] == 2
    assert (three["tokens_new_combination"] < three["tokens_linked_new_combination"]
            <= three["tokens_new_combination"] + 2 * engine.block_size)


@pytest.mark.engine
def test_nested_and_compile_benches_run(engine) -> None:
    from span_workflows.apps.bench.align import bench_nested_align, nested_markdown

    # drafts longer than one block (their prompts take 22 tokens): crop has a block to cut
    nested = bench_nested_align(engine, [2], reps=1, aligns=("crop", "pad"), max_tokens=24,
                                progress=False)
    assert [r["align"] for r in nested] == ["stock", "crop", "pad"]
    stock, crop, pad = nested
    assert stock["cached_share"] == 1.0 and stock["lost_tokens"] == 0
    assert crop["lost_tokens"] > 0 and crop["cached_share"] < 1.0 and crop["fill_tokens"] == 0
    assert pad["lost_tokens"] == 0 and pad["cached_share"] == 1.0 and pad["fill_tokens"] >= 1
    assert pad["extra_draft_steps"] >= 1 and crop["extra_draft_steps"] == 0
    assert all(r["judge_ttft_s"] > 0 and r["judge_steps"] >= 1 for r in nested)
    assert "| 2 | pad |" in nested_markdown(nested)
    comp = bench.bench_compile(engine, [1, 2], doc_tokens=48, reps=1)
    assert all(0 < r["compile_s"] and r["share_of_hit_ttft"] > 0 for r in comp)


def test_reposition_bench_compares_with_a_plain_copy() -> None:
    rows = bench.bench_reposition([1, 4], reps=1)
    assert [r["tokens"] for r in rows] == [32, 128]
    assert all(r["rotate_tokens_per_ms"] > 0 and r["ratio_to_copy"] > 0 for r in rows)
    assert all(r["model"].startswith("smollm2-135m-instruct KV shapes") for r in rows)


def test_cli_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert bench.run_bench("reposition", ["--blocks", "1,2", "--reps", "1", "--json", str(out),
                                          "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and png.stat().st_size > 1000


def test_unknown_benchmark_is_a_clear_error() -> None:
    from span_workflows.errors import SpanQueryError

    with pytest.raises(SpanQueryError, match="unknown benchmark"):
        bench.run_bench("nope", [])


LOCALITY_KEYS = {"hay_chars", "position", "trials", "flat_accuracy", "tournament_accuracy",
                 "round1_accuracy"}


@pytest.mark.engine
def test_locality_bench_scores_flat_tournament_and_the_needle_pair(engine) -> None:
    from span_workflows.apps.bench.locality import bench_locality, markdown_table

    rows = bench_locality(engine, hay_chars=[0], trials=2, positions=["end"],
                          aligns=("crop",), batch=2, progress=False)
    assert len(rows) == 1 and LOCALITY_KEYS <= set(rows[0])
    row = rows[0]
    assert (row["hay_chars"], row["position"], row["trials"]) == (0, "end", 2)
    for kind in ("flat", "tournament", "round1"):
        assert 0.0 <= row[f"{kind}_accuracy"] <= 1.0 and 0.0 <= row[f"{kind}_f1"] <= 1.0
    # the first-round judge reads two candidates, the flat judge all eight
    assert row["round1_prompt_tokens"] < row["flat_prompt_tokens"]
    assert "round-1 judge EM" in markdown_table(rows)
    assert row["align"] == "crop" and row["lost_per_draft"] >= 0


def test_a_needle_drafts_output_is_its_prompts_text(tmp_path: Path) -> None:
    """bench needle's drafts: each output is constrained to the text its prompt holds, one of
    them with the needle sentence at its place; its tables and plot read the rows."""
    import random

    from span_workflows.apps.bench.align import needle_markdown, needle_trial, plot_align
    from span_workflows.apps.bench.report import wilson

    query, name = needle_trial(random.Random(1), 100, "end", drafts=2)
    drafts = query.input.children[1].children
    texts = [json.loads(d.sampling.json_schema)["enum"][0] for d in drafts]
    needle = f"The secret name is {name}."
    assert sum(t.endswith(needle) for t in texts) == 1
    assert all(d.input.text.endswith(t) for d, t in zip(drafts, texts, strict=True))
    assert all(len(t) >= 100 for t in texts)
    rows = [{"hay_chars": 10, "position": "end", "align": a, "trials": 4, "accuracy": hits / 4,
             "low": wilson(hits, 4)[0], "high": wilson(hits, 4)[1], "lost_tokens": lost,
             "cached_share": 1.0, "draft_tokens": 20.0, "needle_cut": float(a == "crop")}
            for a, hits, lost in (("stock", 3, 0.0), ("crop", 0, 12.0), ("pad", 3, 0.0))]
    table = needle_markdown(rows)
    assert "| 10 | end | 4 | 0.75 [0.30, 0.95] | 0.00 [0.00, 0.49] |" in table
    assert "12.0" in table and table.rstrip().endswith("| 1.00 |")
    nested = [{"fanout": 16, "align": a, "speedup": s, "cached_share": c}
              for a, s, c in (("stock", 1.0, 1.0), ("crop", 9.0, 0.8), ("pad", 9.5, 1.0))]
    plot_align(nested, rows, tmp_path / "align.png")
    assert (tmp_path / "align.png").stat().st_size > 1000



def test_hashing_rows_cover_each_length_plain_and_with_spans() -> None:
    """Rows only (that the work per block is constant is counted, not timed, in
    tests/server/test_span_hashing.py)."""
    rows = bench.bench_hashing((1024, 4096), reps=1)
    assert [(r["tokens"], r["blocks"]) for r in rows] == [(1024, 64), (4096, 256)]
    assert all(r["plain_us_per_block"] > 0 and r["spans_us_per_block"] > 0 for r in rows)
