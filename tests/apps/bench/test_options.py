"""The benchmarks' shared options: one parser's pieces, clear errors on bad lists."""

from __future__ import annotations

import argparse

import pytest

from span_workflows.apps.bench import bulk, route
from span_workflows.apps.bench.options import (
    RESULTS,
    bench_parser,
    float_list,
    int_list,
    name_list,
)


@pytest.mark.parametrize("make", [lambda: bench_parser("rag"), bulk.make_parser,
                                  route.make_parser])
def test_every_bench_parser_names_itself_and_shares_the_seed(make) -> None:
    parser = make()
    assert parser.prog.startswith("span-workflows bench ")
    assert parser.parse_args(["--seed", "7"]).seed == 7


def test_benches_that_start_engines_take_a_model_and_directory_writers_an_out() -> None:
    assert bulk.make_parser().parse_args(["--model", "m"]).model == "m"
    assert bench_parser("rag").parse_args([]).model is None
    for make in (bulk.make_parser, route.make_parser):
        args = make().parse_args(["--no-write"])
        assert args.out == RESULTS and args.no_write
    assert RESULTS.name == "results" and (RESULTS.parent / "README.md").exists()


def test_list_options_parse_and_refuse_with_the_value_named() -> None:
    assert int_list()("0,200, 400") == [0, 200, 400]
    assert float_list("4,0.5") == [4.0, 0.5]
    assert name_list("crop,,pad") == ["crop", "pad"]
    with pytest.raises(argparse.ArgumentTypeError, match="'0,2'"):
        int_list(1)("0,2")
    with pytest.raises(argparse.ArgumentTypeError, match="'x'"):
        float_list("x")


def test_a_bad_list_on_the_command_line_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        route.make_parser().parse_args(["--replicas", "0"])
    assert exited.value.code == 2
    assert "--replicas" in capsys.readouterr().err
