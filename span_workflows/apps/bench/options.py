"""The benchmarks of ``span-workflows bench`` and their options (light: read by ``--help``).

Every benchmark's parser starts from :func:`new_parser` (its name, ``--seed``, ``--model``)
and reads lists with :func:`int_list`, :func:`float_list` and :func:`name_list`; those that
write their tables into a directory add :func:`add_results_dir`. ``bench route`` and
``bench bulk`` build their own parser from these pieces; the others share
:func:`bench_parser`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

#: The benchmarks, by name.
BENCHMARKS = ("rag", "nested", "reposition", "compile", "locality", "needle", "quality",
              "route", "lint", "bulk", "lora", "store")
#: The checkout these modules belong to, and the directory of its committed results.
REPOSITORY = Path(__file__).resolve().parents[3]
RESULTS = REPOSITORY / "benchmarks" / "results"


def int_list(minimum: int = 0) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each at least ``minimum``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= {minimum}, not {text!r}")
        return values
    return parse


def float_list(text: str) -> list[float]:
    """An argparse type: comma-separated numbers."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, not {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """An argparse type: comma-separated names."""
    return [p for p in text.split(",") if p]


def new_parser(name: str, *, model: bool = True) -> argparse.ArgumentParser:
    """The parser of ``span-workflows bench NAME`` with the options every benchmark shares:
    ``--seed`` and, for a benchmark that starts an engine, ``--model``."""
    parser = argparse.ArgumentParser(prog=f"span-workflows bench {name}")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the benchmark's random choices: its trace, question "
                             "set or orders (default: 0)")
    if model:
        parser.add_argument("--model", help="the engines' model: a bundled name or a local "
                                            "HF model directory (default: "
                                            "smollm2-135m-instruct)")
    return parser


def add_results_dir(parser: argparse.ArgumentParser, stem: str) -> None:
    """``--out DIR`` (default: ``benchmarks/results``) for ``STEM.json``, ``STEM.md`` and
    ``STEM.png``, and ``--no-write`` to print the table only."""
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help=f"directory of {stem}.json / {stem}.md / {stem}.png")
    parser.add_argument("--no-write", action="store_true", help="print the table only")


def bench_parser(name: str = "NAME") -> argparse.ArgumentParser:
    """The options of benchmark ``name`` (every benchmark reads the ones it needs)."""
    parser = new_parser(name)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument("--reps", type=int, default=3,
                        help="repetitions per point; the median is reported (default: 3)")
    parser.add_argument("--docs", type=int_list(), default=None,
                        help="rag, compile: numbers of documents (default: 1,2,4,8,16); "
                             "quality: documents per question (default: 4,8)")
    parser.add_argument("--doc-tokens", type=int, default=440,
                        help="rag, compile: tokens per document; lora: a quarter of the "
                             "prompt (default: 440)")
    parser.add_argument("--fanout", type=int_list(), default=[1, 2, 4, 8, 16],
                        help="nested: numbers of drafts the judge reads (default: 1,2,4,8,16)")
    parser.add_argument("--align", type=name_list, default=None,
                        help="nested, needle, locality: how the judge reads its drafts, "
                             "recompute,pad,bias,crop (default: nested all four; needle "
                             "crop,recompute,pad; locality crop,recompute)")
    parser.add_argument("--draft-tokens", type=int, default=64,
                        help="nested: max_tokens of each draft (default: 64)")
    parser.add_argument("--drafts", type=int, default=2,
                        help="needle: drafts each judge reads (default: 2)")
    parser.add_argument("--nested-json", type=Path, default=None,
                        help="needle: bench nested rows (JSON) to plot next to the grid")
    parser.add_argument("--blocks", type=int_list(), default=[1, 16, 64, 256],
                        help="reposition: numbers of blocks moved (default: 1,16,64,256)")
    parser.add_argument("--hay-chars", type=int_list(), default=None,
                        help="locality, needle: characters of text around the needle "
                             "(default: locality 0,200,400,800; needle 10,100,1000)")
    parser.add_argument("--trials", type=int, default=None,
                        help="locality, needle: trials per point (default: 8); lint: orders "
                             "and controls per plus (default: 3)")
    parser.add_argument("--positions", type=name_list, default=["start", "middle", "end"],
                        help="locality, needle: needle positions (default: start,middle,end)")
    parser.add_argument("--no-crop", action="store_true",
                        help="locality: run with align=recompute only (default: crop and "
                             "recompute)")
    parser.add_argument("--markdown", type=Path,
                        help="nested, needle, locality, quality, lint: write the table "
                             "here (Markdown)")
    parser.add_argument("--copy-tokens", type=int, default=8,
                        help="locality: tokens each inner generation copies (0: all)")
    parser.add_argument("--variants", type=name_list,
                        help="quality: the variants to compare (stock is always run)")
    parser.add_argument("--questions", type=int, default=200,
                        help="quality: questions per document count (default: 200)")
    parser.add_argument("--answers", type=Path,
                        help="quality, lint: keep answers (lint: rows) here and resume "
                             "from them")
    parser.add_argument("--sizes", type=name_list, default=None,
                        help="quality: document shapes, short (65-85 tokens), long "
                             "(256-512), transcript (the held-out shape: interviews) "
                             "(default: short,long)")
    parser.add_argument("--seeds", type=int_list(), default=None,
                        help="quality: question seeds; every cell pools --questions of "
                             "each, the same for every variant (default: --seed)")
    parser.add_argument("--no-ttft", action="store_true",
                        help="quality: answers only, no span-hit TTFT columns")
    parser.add_argument("--no-ttft-own", action="store_true",
                        help="quality: the span-hit TTFT at 16 x 440 tokens only, not also "
                             "at 16 documents of each size")
    parser.add_argument("--perplexity", type=int, default=0,
                        help="quality: also the model's perplexity on this many held-out "
                             "standard-library passages (default: 0, not measured)")
    parser.add_argument("--merge-json", type=Path, default=None,
                        help="quality: keep the rows of other models from this JSON file "
                             "(the same path as --json to grow one table)")
    parser.add_argument("--choose-default", action="store_true",
                        help="quality: print the model's default span options chosen from "
                             "its link frontier (the fewest recomputed tokens within 2 points "
                             "of stock in every cell, else the best reachable)")
    parser.add_argument("--write-default", type=Path, default=None, metavar="MODEL_DIR",
                        help="quality: record that choice in MODEL_DIR/span_workflows.json, "
                             "the defaults engines and servers on that model start with")
    return parser


def options_help() -> str:
    """The benchmarks and their options, as ``bench --help`` lists them."""
    text = bench_parser().format_help()
    options = text[text.index("options:"):] if "options:" in text else text
    return ("benchmarks:\n"
            "  rag         RAG TTFT: stock vs span miss vs span hit, by number of documents\n"
            "  nested      judge/generator per align: the judge's TTFT, draft tokens read\n"
            "              from cache and lost, the drafts' extra decode steps\n"
            "  reposition  RoPE re-rotation throughput vs a plain copy, by blocks moved\n"
            "  compile     optimize + compile time, as a share of a span-hit TTFT\n"
            "  locality    needle extraction: flat judge vs tournament, per align\n"
            "  needle      a needle in the drafts' output (start, middle, end of 10, 100,\n"
            "              1000 characters): the judge's exact match per align and stock\n"
            "  quality     invented-fact QA accuracy: stock vs every span mode\n"
            "  route       routers over span-engine replicas (its own options: "
            "bench route --help)\n"
            "  lint        span-workflows lint on a labelled set of commuting and ordered "
            "pluses\n"
            "  bulk        a bulk in arrival order vs random vs clustered, one engine and Ray "
            "actors (its own options: bench bulk --help)\n"
            "  lora        prefill and decode of the base and the span-ready adapter, as LoRA "
            "and merged\n"
            "  store       the span store: a hit from disk vs the KV cache vs stock, load GB/s, "
            "a corpus over 10x\n"
            "              KV cache (its own options: bench store --help)\n\n"
            "benchmark " + options)


__all__ = ["BENCHMARKS", "REPOSITORY", "RESULTS", "add_results_dir", "bench_parser", "float_list",
           "int_list", "name_list", "new_parser", "options_help"]
