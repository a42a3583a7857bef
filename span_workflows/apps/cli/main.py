"""``span-workflows`` command line: demo, run, compile, lint, serve, bench, tune.

User mistakes (bad JSON, unknown node, missing file, unavailable model) exit with status 2 and
one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Generate, Node, iter_nodes, rewrite_bottom_up
from span_workflows.query.json_ir import from_json
from span_workflows.runtime.store_index import DEFAULT_INDEX_SYSTEM

if TYPE_CHECKING:
    from span_workflows.serving.launch import ServerOptions
    from span_workflows.tune.train import TuneConfig


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``span-workflows`` console script."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after "--" goes to vLLM untouched
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "serve":
        args.vllm_args = unknown + passthrough
    elif unknown or passthrough:
        parser.error(f"unrecognized arguments: {' '.join(unknown + passthrough)}")
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if args.command != "serve":
        # stdout carries results (``run --json`` is parsed by programs): vLLM logs to stderr,
        # and only with --verbose (a user mistake is then one line, not a page of warnings).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        if args.verbose:
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        else:
            quiet_logs()
    try:
        return int(args.func(args) or 0)
    except SpanQueryError as exc:
        print(f"span-workflows: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ConnectionError) as exc:
        print(f"span-workflows: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def quiet_logs() -> None:
    """Hide vLLM's, transformers' and Python's warnings (what ``--verbose`` shows)."""
    import logging
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ warnings
    warnings.filterwarnings("ignore")
    for name in ("vllm", "transformers", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _parser() -> argparse.ArgumentParser:
    verbose = "show vLLM's log lines and library warnings (hidden otherwise)"
    parser = argparse.ArgumentParser(
        prog="span-workflows", description="Span queries on vLLM: build, compile, run, serve.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=verbose)
    # Also after the command; SUPPRESS keeps a -v given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help=verbose)
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="RAG over the Python stdlib docs, span vs stock",
                          parents=[common])
    demo.add_argument("--model", help="bundled name or local HF model directory "
                                      "(default: smollm2-135m-instruct)")
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser("run", help="run span queries (JSON files) in order on one engine, "
                                     "or a bulk of them (JSON lines) scheduled by their spans",
                         parents=[common])
    run.add_argument("files", nargs="*", type=Path,
                     help="span queries in JSON (spnl's IR), run in this order")
    run.add_argument("--json", action="store_true", help="print a JSON list of results")
    run.add_argument("--model", help="model for every g (name or local directory)")
    run.add_argument("--server", help="URL of a `span-workflows serve` server")
    run.add_argument("--api-key", default=os.environ.get("SPAN_WORKFLOWS_API_KEY"),
                     help="API key for --server (default: $SPAN_WORKFLOWS_API_KEY)")
    run.add_argument("--stock", action="store_true", help="run as plain chat prompts (baseline)")
    run.add_argument("--block-size", type=int, default=32,
                     help="KV block size of the embedded engine (default: 32)")
    run.add_argument("--span-store", type=Path, default=None,
                     help="the embedded engine keeps span blocks in this directory beyond "
                          "the KV cache and across runs (see `span-workflows index`)")
    run.add_argument("--span-store-gib", type=float, default=None,
                     help="cap the span store at this size (least recently used go first)")
    _add_bulk_options(run)
    run.set_defaults(func=_cmd_run)

    index = sub.add_parser(
        "index", help="compute every document's span once into a span store on disk",
        description="Each document (a JSONL line: a string or {\"text\": ..., \"source\": "
                    "...}) is computed as a plus span after --system, on the weights span "
                    "queries run on, and written to --store. An engine or server started with "
                    "the same --span-store then loads those spans instead of computing them. "
                    "Documents already in the store are loaded, not computed again.",
        parents=[common])
    index.add_argument("corpus", type=Path, help="documents, one JSON value per line")
    index.add_argument("--store", required=True, type=Path, help="the span store's directory")
    index.add_argument("--system", default=DEFAULT_INDEX_SYSTEM,
                       help="the system prompt your queries put before their documents "
                            f"(default: {DEFAULT_INDEX_SYSTEM!r})")
    index.add_argument("--store-gib", type=float, default=None,
                       help="cap the store at this size (least recently used blocks go first)")
    index.add_argument("--batch-size", type=int, default=8,
                       help="documents computed together (default: 8)")
    index.add_argument("--model", help="bundled name or local HF model directory")
    index.add_argument("--cache-salt", default=None,
                       help="the tenant's cache_salt its queries run with (spans are keyed by "
                            "it; default: none)")
    index.set_defaults(func=_cmd_index)

    comp = sub.add_parser("compile", help="print the optimized tree and token form",
                          parents=[common])
    comp.add_argument("files", nargs="+", type=Path, help="span queries in JSON (spnl's IR)")
    comp.add_argument("--model", help="model whose tokenizer to compile for")
    comp.add_argument("--block-size", type=int, default=32,
                      help="KV block size to align spans to (default: 32)")
    comp.set_defaults(func=_cmd_compile)

    _add_lint(sub, common)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible vLLM server with span queries",
        description="Any other option (or everything after --) is passed to vLLM's server, "
                    "e.g. span-workflows serve --model org/name -- --tensor-parallel-size 2",
        parents=[common],
    )
    serve.add_argument("--model", help="bundled name, local HF model directory or hub id "
                                       "(default: smollm2-135m-instruct)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--api-key", help="require this bearer token (default: "
                                         "$SPAN_WORKFLOWS_API_KEY, else $VLLM_API_KEY; prefer "
                                         "those: the command line is visible to ps)")
    serve.add_argument("--block-size", type=int, default=None,
                       help="KV block size (default: 32 on CPU, vLLM's on a GPU)")
    serve.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache size on CPU")
    serve.add_argument("--adapter", action="append", default=None, metavar="NAME=PATH",
                       help="serve a LoRA adapter beside the model (repeatable; default: the "
                            "span-ready adapter on the bundled base)")
    serve.add_argument("--no-adapters", action="store_true",
                       help="serve the model alone (no LoRA, not even the bundled adapter)")
    serve.add_argument("--no-routing", action="store_true",
                       help="keep span queries on the base unless they name an adapter")
    serve.add_argument("--span-store", type=Path, default=None,
                       help="keep span blocks in this directory beyond the KV cache and across "
                            "restarts (see `span-workflows index`)")
    serve.add_argument("--span-store-gib", type=float, default=None,
                       help="cap the span store at this size (least recently used go first)")
    _add_replica_options(serve)
    serve.set_defaults(func=_cmd_serve)

    _add_tune(sub, common)

    from span_workflows.apps.bench.options import BENCHMARKS, options_help

    bench = sub.add_parser(
        "bench", help=f"benchmarks: {', '.join(BENCHMARKS)}", parents=[common],
        description="Run one benchmark: stock vLLM vs span queries, side by side.",
        epilog=options_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("name", choices=BENCHMARKS, metavar="NAME",
                       help=f"the benchmark: {', '.join(BENCHMARKS)}")
    bench.add_argument("rest", nargs=argparse.REMAINDER, metavar="OPTIONS",
                       help="the benchmark's options (below)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def _add_lint(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from span_workflows.commutativity.lint import DEFAULT_ANSWER_TOKENS, DEFAULT_MARGIN

    lint = sub.add_parser(
        "lint", help="is each plus really commutative? static checks; --trials: on the engine",
        description="Check every plus of span queries: static checks (numbering, sequence "
                    "words, references across children, tables, lists and sentences cut "
                    "between children, conversation turns, tool results of different turns), "
                    "and with --trials K the order check: each plus's query in stock mode "
                    "under K orders of its children next to K whitespace-only controls. Exit "
                    "status: 0 clean, 1 when a plus is flagged, 2 on a user error.",
        parents=[common])
    lint.add_argument("files", nargs="+", type=Path, help="span queries in JSON (spnl's IR)")
    lint.add_argument("--trials", type=int, default=None, metavar="K",
                      help="run the order check with K orders and K controls per plus "
                           "(default: static checks only, no model)")
    lint.add_argument("--json", action="store_true", help="print the reports as JSON")
    lint.add_argument("--model", help="model of the order check (name or local directory)")
    lint.add_argument("--block-size", type=int, default=32,
                      help="KV block size of the embedded engine (default: 32)")
    lint.add_argument("--answer-tokens", type=int, default=DEFAULT_ANSWER_TOKENS,
                      help="tokens each G of the order check generates at most "
                           f"(default: {DEFAULT_ANSWER_TOKENS})")
    lint.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                      help="how far below the control's the agreement across orders must "
                           f"fall to flag a plus (a share of runs; default: {DEFAULT_MARGIN})")
    lint.add_argument("--seed", type=int, default=0, help="seed of the random orders")
    lint.set_defaults(func=_cmd_lint)


def _cmd_lint(args: argparse.Namespace) -> int:
    from span_workflows.commutativity.lint import lint

    queries = load_queries(args.files)
    engine = None
    if args.trials is not None:
        if args.trials < 2:
            raise SpanQueryError("--trials", f"must be at least 2, got {args.trials}")
        if args.answer_tokens < 1:
            raise SpanQueryError("--answer-tokens", "must be at least 1")
        model, queries = pick_model(queries, args.model)
        from span_workflows.apps.cli.precheck import check_queries

        name = None if model is None or _is_default(model) else model
        check_queries(queries, name, args.block_size, span_mode=False,
                      labels=[str(p) for p in args.files])
        from span_workflows.apps.cli.progress import engine_loading
        from span_workflows.runtime.engine import Engine

        with engine_loading():
            engine = Engine(name, block_size=args.block_size, progress=True,
                            load_progress=args.verbose)
    try:
        reports = [lint(q, engine, trials=args.trials or 2, answer_tokens=args.answer_tokens,
                        margin=args.margin, seed=args.seed, progress=engine is not None)
                   for q in queries]
    finally:
        if engine is not None:
            engine.close()
    if args.json:
        print(json.dumps([{"file": str(p), **r.to_dict()}
                          for p, r in zip(args.files, reports, strict=True)], indent=2))
    else:
        from span_workflows.apps.cli.lint_view import print_reports

        print_reports([(str(p), r) for p, r in zip(args.files, reports, strict=True)])
    return max(r.exit_code for r in reports)


#: ``tune`` flags that set a :class:`TuneConfig` field of the same name, with their meaning.
_TUNE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("examples", int, "training examples"),
    ("seed", int, "seed of the generated examples and of the adapter's start"),
    ("rank", int, "LoRA rank"),
    ("learning_rate", float, "peak learning rate"),
    ("accumulate", int, "examples per optimizer step"),
    ("span_share", float, "share of examples in span form (the rest: stock form, text)"),
    ("link_share", float, "share of span-form examples with one link block"),
    ("tool_share", float, "share of examples that are agent turns with tools (keeps the "
                          "model calling tools)"),
    ("ce_weight", float, "weight of the reference answer's cross-entropy"),
    ("kl_weight", float, "weight of KL(base on the stock prompt || adapter) on the answer "
                         "tokens: self-distillation"),
    ("dev_questions", int, "dev-set questions scored at the end of every segment of the run "
                           "(the learning curve in the training log; 0: none)"),
)


def _add_tune(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from span_workflows.tune.train import RECIPES, TuneConfig

    defaults = TuneConfig()
    tune = sub.add_parser(
        "tune", help="make a model span-ready: LoRA fine-tuning on span-form RAG examples",
        description="Fine-tune LoRA adapters so that the model answers in span mode as it "
                    "does in stock mode. Resumable: run the same command again to continue "
                    "from the last checkpoint in --out. Flags not given come from --recipe "
                    "(or the plain defaults shown).", parents=[common])
    tune.add_argument("--out", type=Path, required=True,
                      help="directory for checkpoints, the training log and the finished "
                           "adapter (OUT/adapter)")
    tune.add_argument("--recipe", choices=sorted(RECIPES),
                      help="start from a named configuration: 'default' is the bundled "
                           "adapter's recipe (what make adapter runs)")
    tune.add_argument("--model", help="base model: a bundled name or a local HF directory "
                                      "(default: smollm2-135m-instruct, the base)")
    for name, kind, meaning in _TUNE_FLAGS:
        tune.add_argument(f"--{name.replace('_', '-')}", type=kind,
                          help=f"{meaning} (default: {getattr(defaults, name)})")
    tune.add_argument("--init-adapter", type=Path, default=None,
                      help="start from this adapter directory (e.g. a span-ready model's, to "
                           "tune it further) instead of a fresh LoRA initialization")
    tune.add_argument("--max-doc-tokens", type=int,
                      help=f"longest document of an example, in tokens "
                           f"(default: {defaults.doc_tokens[1]})")
    tune.add_argument("--max-docs", type=int,
                      help=f"most documents per example (default: "
                           f"{defaults.docs_per_prompt[1]})")
    tune.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                      help="where to train (default: cpu)")
    tune.add_argument("--merge", type=Path, default=None,
                      help="when done, write the base model with the adapter merged in here "
                           "(a plain checkpoint vLLM serves)")
    tune.add_argument("--hours", type=float, default=None,
                      help="stop this segment at the first optimizer step after this many "
                           "hours of training, with a checkpoint (SIGTERM or Ctrl-C does the "
                           "same at any time); run the command again to resume")
    tune.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    tune.set_defaults(func=_cmd_tune)


def _tune_config(args: argparse.Namespace) -> TuneConfig:
    """The run's config: ``--recipe`` (or the plain defaults), then every flag given."""
    from span_workflows.tune.train import RECIPES, TuneConfig

    start = RECIPES[args.recipe] if args.recipe else TuneConfig()
    given = {name: getattr(args, name) for name, _, _ in _TUNE_FLAGS
             if getattr(args, name) is not None}
    if args.rank is not None:
        given["alpha"] = 2 * args.rank
    if args.init_adapter is not None:
        given["init_adapter"] = str(args.init_adapter)
    low_tokens, high_tokens = start.doc_tokens
    fewest, most = start.docs_per_prompt
    if args.max_doc_tokens is not None:
        if args.max_doc_tokens < low_tokens:
            raise SpanQueryError("--max-doc-tokens", f"must be at least {low_tokens}")
        high_tokens = args.max_doc_tokens
    if args.max_docs is not None:
        if args.max_docs < fewest:
            raise SpanQueryError("--max-docs", f"must be at least {fewest}")
        most = args.max_docs
    return dataclasses.replace(start, **given, doc_tokens=(low_tokens, high_tokens),
                               docs_per_prompt=(fewest, most))


def _cmd_tune(args: argparse.Namespace) -> int:
    from span_workflows.tune.train import tune

    config = _tune_config(args)
    if args.hours is not None and args.hours <= 0:
        raise SpanQueryError("--hours", "must be positive")
    report = tune(args.out, config, model=args.model, device=args.device,
                  stop_after=args.stop_after, recipe=args.recipe,
                  max_seconds=None if args.hours is None else 3600 * args.hours)
    done = report.examples >= config.examples
    first, last = (report.losses[0], report.losses[-1]) if report.losses else (0.0, 0.0)
    trained = report.examples - report.resumed_from
    if trained:
        print(f"trained {trained} examples in {report.seconds:.0f} s "
              f"({report.seconds_per_1k / 60:.1f} min per 1k examples on {args.device}); "
              f"loss {first:.3f} -> {last:.3f}")
    else:
        print(f"the run in {args.out} has trained all {report.examples} examples already; "
              f"loss {first:.3f} -> {last:.3f}")
    if not done:
        print(f"stopped at {report.examples} of {config.examples}: run again to resume")
        return 0
    print(f"adapter: {report.adapter}")
    if args.merge is not None:
        from span_workflows.compiler.model import BASE_MODEL_NAME, merge_adapter, resolve_model

        merge_adapter(resolve_model(args.model or BASE_MODEL_NAME, progress=False),
                      report.adapter, args.merge)
        print(f"merged model: {args.merge}")
    return 0


def load_queries(files: Sequence[Path]) -> list[Node]:
    """Parse query files; errors name the file and the node path."""
    queries = []
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise SpanQueryError(str(path), f"cannot read: {exc.strerror or exc}") from None
        try:
            queries.append(from_json(raw))
        except SpanQueryError as exc:
            raise SpanQueryError(f"{path}: {exc.path}" if exc.path else str(path),
                                 exc.message) from None
    return queries


def pick_model(queries: Sequence[Node], override: str | None) -> tuple[str | None, list[Node]]:
    """The model to run, and the queries with every g's model set to it.

    ``override`` wins over the models named in the queries; without it, every named model must
    be available here (the bundled default's name, or a local directory).
    """
    from span_workflows.compiler.model import resolve_model

    if override is not None:
        if not _is_default(override):
            resolve_model(override, progress=False)
        return override, [with_model(q, None) for q in queries]
    named = {n.model for q in queries for n in iter_nodes(q)
             if isinstance(n, Generate) and n.model}
    if len(named) > 1:
        raise SpanQueryError("model", f"queries name several models {sorted(named)}; "
                                      "pass --model to run them on one")
    model = next(iter(named), None)
    if model is not None and not _is_default(model):
        resolve_model(model, progress=False)
    return model, [with_model(q, None) for q in queries]


def with_model(node: Node, model: str | None) -> Node:
    """``node`` with every g's ``model`` replaced."""
    def rule(n: Node) -> Node:
        if isinstance(n, Generate) and n.model != model:
            return dataclasses.replace(n, model=model)
        return n

    return rewrite_bottom_up(node, rule)


def _is_default(name: str) -> bool:
    from span_workflows.compiler.model import DEFAULT_MODEL_NAME

    return name.lower() == DEFAULT_MODEL_NAME


def _add_bulk_options(run: argparse.ArgumentParser) -> None:
    """``run --bulk``: many queries from a JSON-lines file, answers to ``--out``."""
    from span_workflows.runtime.bulk import DEFAULT_MAX_IN_FLIGHT, SCHEDULES

    group = run.add_argument_group("bulk (many queries, scheduled by the spans they share)")
    group.add_argument("--bulk", type=Path, metavar="QUERIES.jsonl",
                       help="one span query per line; answered into --out, resumably")
    group.add_argument("--out", type=Path, metavar="ANSWERS.jsonl",
                       help="answers, one JSON line per query (with its input index); "
                            "those already there are not asked again")
    group.add_argument("--schedule", default="cluster", choices=SCHEDULES,
                       help="order: cluster by shared spans (default), as given, or random")
    group.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                       help=f"queries run together (default: {DEFAULT_MAX_IN_FLIGHT})")
    group.add_argument("--kv-cache-gib", type=int, default=2,
                       help="KV cache of each embedded engine on CPU (default: 2)")
    group.add_argument("--kv-cache-blocks", type=int, default=None,
                       help="cap each embedded engine's KV cache at this many blocks")
    group.add_argument("--replicas", type=int, default=None,
                       help="run the bulk on N span-engine actors with Ray Data")
    group.add_argument("--ray-address", default=None,
                       help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    group.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per Ray actor")
    group.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per Ray actor")


def _cmd_run_bulk(args: argparse.Namespace) -> int:
    from span_workflows.apps.cli.bulk_run import read_queries, run_bulk_file, summary

    if args.files:
        raise SpanQueryError("run", "give query files or --bulk, not both")
    if args.out is None:
        raise SpanQueryError("--out", "required with --bulk (where the answers go)")
    if args.stock:
        raise SpanQueryError("--stock", "not available with --bulk")
    if args.max_in_flight < 1:
        raise SpanQueryError("--max-in-flight", "must be at least 1")
    read_queries(args.bulk)  # a missing or unreadable file is one line, before any engine
    store, gib = _run_store(args)
    options = {"schedule": args.schedule, "max_in_flight": args.max_in_flight}
    model = None if args.model is None or _is_default(args.model) else args.model
    if args.server:
        from span_workflows.serving.client import SpanServer

        server = SpanServer(args.server, api_key=args.api_key)
        report = run_bulk_file(lambda lines: server.iter_bulk(lines, **options), args.bulk,
                               args.out)
    elif args.replicas is not None or args.ray_address:
        if store is not None:
            raise SpanQueryError("--span-store", "not available with --replicas or "
                                                 "--ray-address (the actors keep no store)")
        from span_workflows.scaleout.bulk import BulkOptions, run_bulk_on_ray

        try:
            bulk_options = BulkOptions(
                replicas=args.replicas or 2, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                model=model, kv_cache_gib=args.kv_cache_gib,
                kv_cache_blocks=args.kv_cache_blocks, block_size=args.block_size, **options)
        except ValueError as exc:
            raise SpanQueryError("run", str(exc)) from None

        def on_ray(lines: list[str]):
            return (got.answer for got in run_bulk_on_ray(lines, bulk_options,
                                                          address=args.ray_address))

        report = run_bulk_file(on_ray, args.bulk, args.out)
    else:
        if model is not None:
            from span_workflows.compiler.model import resolve_model

            resolve_model(model, progress=False)
        from span_workflows.apps.cli.progress import engine_loading
        from span_workflows.runtime.engine import Engine

        with engine_loading():
            engine = Engine(model, block_size=args.block_size, progress=True,
                            load_progress=args.verbose, kv_cache_gib=args.kv_cache_gib,
                            kv_cache_blocks=args.kv_cache_blocks, span_store=store,
                            span_store_gib=gib)
        with engine:
            report = run_bulk_file(lambda lines: engine.iter_bulk(lines, **options),
                                   args.bulk, args.out)
    print(summary(report, args.out))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    if args.bulk is not None:
        return _cmd_run_bulk(args)
    if not args.files:
        raise SpanQueryError("run", "no query files (give JSON files, or --bulk QUERIES.jsonl "
                                    "--out ANSWERS.jsonl)")
    queries = load_queries(args.files)
    store, gib = _run_store(args)
    if args.server:
        from span_workflows.serving.client import SpanServer

        backend = SpanServer(args.server, api_key=args.api_key)
        results = [backend.execute(q) for q in queries]
    else:
        model, queries = pick_model(queries, args.model)
        from span_workflows.apps.cli.precheck import check_queries

        check_queries(queries, None if model is None or _is_default(model) else model,
                      args.block_size, span_mode=not args.stock,
                      labels=[str(p) for p in args.files])
        from span_workflows.apps.cli.progress import engine_loading
        from span_workflows.runtime.engine import Engine

        with engine_loading():
            engine = Engine(None if model is None or _is_default(model) else model,
                            block_size=args.block_size, progress=True,
                            load_progress=args.verbose, span_store=store, span_store_gib=gib)
        with engine:
            results = []
            for q in queries:  # in order: later queries see what earlier ones cached
                results.append(engine.stock(q) if args.stock else engine.execute(q))
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for path, r in zip(args.files, results, strict=False):
            m = r.metrics
            print(f"== {path}  ttft {m.ttft_s * 1000:.1f} ms  prompt {m.prompt_tokens}  "
                  f"cached {m.cached_tokens}  generated {m.generated_tokens}")
            print(r.text)
    return 0


def _run_store(args: argparse.Namespace) -> tuple[Path | None, float | None]:
    """``run``'s ``--span-store`` and ``--span-store-gib`` for its embedded engine, checked
    before anything starts: a ``--server`` keeps its own store (``serve --span-store``)."""
    if args.server and args.span_store is not None:
        raise SpanQueryError("--span-store", "the server keeps its own store (start it with "
                                             "`span-workflows serve --span-store DIR`)")
    return args.span_store, _store_gib(args.span_store, args.span_store_gib,
                                       "--span-store-gib")


def _cmd_compile(args: argparse.Namespace) -> int:

    from span_workflows.compiler.compile import Compiler
    from span_workflows.compiler.model import load_tokenizer
    from span_workflows.compiler.optimize import optimize
    from span_workflows.query.pretty import pretty

    queries = load_queries(args.files)
    model, queries = pick_model(queries, args.model)
    tokenizer = load_tokenizer(model, progress=True)
    compiler = Compiler.for_tokenizer(tokenizer, args.block_size)
    for path, query in zip(args.files, queries, strict=False):
        tree = optimize(query)
        print(f"== {path}\n{pretty(tree)}")
        if isinstance(tree, Generate):
            from span_workflows.compiler.compile import NestedOutput, nested_generations

            nested = {p: NestedOutput(compiler.inner_prompt(g).token_ids, (), "")
                      for p, g in nested_generations(tree)}
            print(compiler.compile_generate(tree, nested).summary())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from span_workflows.apps.demo.run import run_demo

    engine = None
    if args.model:
        from span_workflows.runtime.engine import Engine

        engine = Engine(args.model, progress=True)
    run_demo(engine=engine)
    return 0


def _add_replica_options(serve: argparse.ArgumentParser) -> None:
    """``serve --replicas N``: N span-engine replicas on Ray Serve (span_workflows.scaleout)."""
    group = serve.add_argument_group("replicas (Ray Serve)")
    group.add_argument("--replicas", type=int, default=None,
                       help="run N span-engine replicas on Ray Serve behind one ingress")
    group.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    group.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica")
    group.add_argument("--router", default="span-affinity",
                       choices=("span-affinity", "prefix-affinity", "power-of-two"),
                       help="how the ingress picks a replica: by the query's span keys "
                            "(default), Ray's text-prefix router, or power of two choices")
    group.add_argument("--imbalance-threshold", type=int, default=2,
                       help="requests in flight beyond the lightest replica's before a "
                            "query leaves the replica holding its spans")
    group.add_argument("--max-share", type=float, default=1.25,
                       help="a replica that took more than this times its fair share of the "
                            "recent queries is passed over for affinity (0: no bound)")
    group.add_argument("--capacity-tokens", type=int, default=None,
                       help="span tokens remembered per replica (default: its KV cache)")
    group.add_argument("--ray-address", default=None,
                       help="Ray cluster to join (default: RAY_ADDRESS, else a local one)")


def _cmd_serve(args: argparse.Namespace) -> int:
    from span_workflows.serving.launch import serve

    server = _server_options(args)
    if args.replicas is not None:
        from span_workflows.scaleout.deployment import ClusterOptions, serve_cluster

        if args.span_store is not None:
            raise SpanQueryError("--span-store", "not available with --replicas (each "
                                                 "replica keeps its spans in its KV cache)")
        try:
            options = ClusterOptions(
                replicas=args.replicas, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                server=server, router=args.router, capacity_tokens=args.capacity_tokens,
                imbalance_threshold=args.imbalance_threshold,
                max_share=args.max_share or None)
        except ValueError as exc:
            raise SpanQueryError("serve", str(exc)) from None
        serve_cluster(options, host=args.host, port=args.port, address=args.ray_address)
        return 0
    serve(server, host=args.host, port=args.port)
    return 0


def _server_options(args: argparse.Namespace) -> ServerOptions:
    """``serve``'s options for its server (or each replica's), checked before anything
    starts; the API key from ``--api-key``, else ``$SPAN_WORKFLOWS_API_KEY``, else
    ``$VLLM_API_KEY``."""
    from span_workflows.serving.launch import ServerOptions

    api_key = (args.api_key or os.environ.get("SPAN_WORKFLOWS_API_KEY")
               or os.environ.get("VLLM_API_KEY"))
    gib = _store_gib(args.span_store, args.span_store_gib, "--span-store-gib")
    try:
        return ServerOptions(
            model=args.model, block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
            extra_args=tuple(getattr(args, "vllm_args", [])), adapters=_adapters(args),
            routing=not args.no_routing, span_store=args.span_store, span_store_gib=gib,
            api_key=api_key)
    except ValueError as exc:  # named by its field: block_size is --block-size
        raise SpanQueryError("serve", str(exc)) from None


def _store_gib(store: Path | None, gib: float | None, option: str) -> float | None:
    if gib is not None and gib <= 0:
        raise SpanQueryError(option, f"must be > 0, got {gib}")
    if gib is not None and store is None:
        raise SpanQueryError(option, "needs --span-store")
    return gib


def _cmd_index(args: argparse.Namespace) -> int:
    from span_workflows.runtime.store_index import index_documents, read_corpus

    docs = read_corpus(args.corpus)
    if args.batch_size < 1:
        raise SpanQueryError("--batch-size", f"must be at least 1, got {args.batch_size}")
    gib = _store_gib(args.store, args.store_gib, "--store-gib")
    if args.cache_salt is not None and not args.cache_salt:
        raise SpanQueryError("--cache-salt", "must be a non-empty string")
    from span_workflows.apps.cli.progress import engine_loading
    from span_workflows.runtime.engine import Engine

    with engine_loading():
        engine = Engine(None if args.model is None or _is_default(args.model) else args.model,
                        progress=True, load_progress=args.verbose, span_store=args.store,
                        span_store_gib=gib)
    with engine:
        report = index_documents(engine, docs, args.system, batch_size=args.batch_size,
                                 cache_salt=args.cache_salt)
    print(f"indexed {report.documents} documents into {args.store}: "
          f"{report.computed_tokens} of {report.prompt_tokens} prompt tokens computed, "
          f"{report.seconds:.1f} s")
    return 0


def _adapters(args: argparse.Namespace) -> dict[str, str] | None:
    """``--adapter NAME=PATH`` options as ``{name: path}`` (``None``: the default set)."""
    if args.no_adapters:
        if args.adapter:
            raise SpanQueryError("--adapter", "cannot be combined with --no-adapters")
        return {}
    if not args.adapter:
        return None
    adapters: dict[str, str] = {}
    for item in args.adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SpanQueryError("--adapter", f"expected NAME=PATH, not {item!r}")
        if name in adapters:
            raise SpanQueryError("--adapter", f"adapter {name!r} given twice")
        adapters[name] = path
    return adapters


def _cmd_bench(args: argparse.Namespace) -> int:
    from span_workflows.apps.bench.run import run_bench

    return run_bench(args.name, args.rest)


if __name__ == "__main__":
    raise SystemExit(main())
