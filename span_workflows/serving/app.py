"""The span query server: vLLM's OpenAI-compatible server plus ``/v1/query/execute``.

Run it with ``python -m span_workflows.serving.app --model DIR [vLLM serve options]`` (what
``span-workflows serve`` starts, see :mod:`span_workflows.serving.launch`). It builds vLLM's own
FastAPI app and engine client (``AsyncLLM``, engine core in its own process, where the
``span_vllm`` plugin is active) and adds:

* ``POST /v1/query/execute`` — span queries, plain or streamed (the protocol:
  :mod:`span_workflows.serving.wire`), executed by a
  :class:`~span_workflows.serving.service.SpanQueryService`;
* ``POST /v1/query/bulk`` — many queries as JSON lines, scheduled by the spans they share
  (:mod:`span_workflows.runtime.bulk`), answered as JSON lines streamed as each answer is ready;
* spnl's request form on the same path (``text/plain``, ``?stream=``, ``?format=``), answered
  in OpenAI shapes (:mod:`span_workflows.serving.spnl_route`), and ``GET /v1/query/schema``
  (:mod:`span_workflows.serving.query_schema`);
* ``spans`` on vLLM's ``POST /v1/chat/completions`` (:mod:`span_workflows.serving.chat_route`):
  a body with them is a span query, any other body goes to vLLM unchanged;
* the span counters on ``/metrics`` (``span_<name>_total``, names and help in
  :data:`span_vllm.contract.STAT_HELP`), fetched from the engine core when ``/metrics`` is
  scraped.

Like vLLM, ``--api-key`` guards every ``/v1`` path, ``/v1/query/execute`` included. Unlike
``vllm serve``, the server binds 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

from starlette.requests import Request as HttpRequest

from span_vllm import contract
from span_workflows.compiler.model import span_defaults
from span_workflows.errors import SpanQueryError
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.result import BulkAnswer
from span_workflows.runtime.routing import Adapter, WeightsRouter
from span_workflows.runtime.streaming import PartStream
from span_workflows.runtime.vllm_io import warm_up
from span_workflows.serving import wire
from span_workflows.serving.chat_route import install_chat_route
from span_workflows.serving.query_schema import SCHEMA_PATH, query_schema
from span_workflows.serving.service import SpanQueryService, StreamedRun
from span_workflows.serving.spnl_route import openai_form_response, url_options

DEFAULT_HOST = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# /v1/query/execute


class BodyTooLarge(Exception):
    """The request body is over the size cap."""


def make_router(max_body: int = wire.MAX_BODY_BYTES) -> Any:
    """The FastAPI router of the span endpoints (the service lives in ``app.state``)."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, StreamingResponse

    router = APIRouter()

    @router.get(SCHEMA_PATH)
    async def schema() -> Any:
        return JSONResponse(query_schema())

    @router.post(wire.EXECUTE_PATH)
    async def execute(request: HttpRequest) -> Any:
        service: SpanQueryService = request.app.state.span_service
        try:
            query = wire.parse_body(await _read_body(request, max_body))
            query, openai_form = url_options(request, query)  # spnl's form
            if openai_form:
                return await openai_form_response(request, query)
            if not query.stream:
                result = await service.execute(
                    query.node, optimize_query=query.optimize, span_options=query.span_options,
                    cache_salt=query.cache_salt, weights=query.weights)
                return JSONResponse(wire.result_body(result))
            return await _stream_response(service, query, StreamingResponse)
        except BodyTooLarge:
            return JSONResponse(wire.too_large_body(max_body), status_code=413)
        except SpanQueryError as exc:
            return JSONResponse(wire.error_body(exc), status_code=400)
        except (RecursionError, MemoryError) as exc:
            err = SpanQueryError("", f"query too large to process ({type(exc).__name__})")
            return JSONResponse(wire.error_body(err), status_code=400)
        except Exception as exc:  # noqa: BLE001 - bad requests rejected by vLLM's own checks
            if _is_validation_error(exc):
                return JSONResponse(wire.error_body(SpanQueryError("input", str(exc))),
                                    status_code=400)
            raise

    @router.post(wire.BULK_PATH)
    async def execute_bulk(request: HttpRequest) -> Any:
        service: SpanQueryService = request.app.state.span_service
        try:
            body = await _read_body(request, max(max_body, wire.MAX_BULK_BODY_BYTES))
            schedule, max_in_flight = _bulk_options(request)
        except BodyTooLarge:
            return JSONResponse(wire.too_large_body(max(max_body, wire.MAX_BULK_BODY_BYTES)),
                                status_code=413)
        except SpanQueryError as exc:
            return JSONResponse(wire.error_body(exc), status_code=400)
        queries = wire.parse_bulk_body(body)

        async def lines() -> Any:
            async for answer in service.execute_bulk(queries, schedule=schedule,
                                                     max_in_flight=max_in_flight):
                if answer.error is not None and _is_validation_error(answer.error):
                    answer = BulkAnswer(answer.index,
                                        error=SpanQueryError("input", str(answer.error)))
                yield wire.bulk_answer_line(answer)

        return StreamingResponse(lines(), media_type=wire.NDJSON_MEDIA_TYPE,
                                 headers={"Cache-Control": "no-cache"})

    return router


def _bulk_options(request: Any) -> tuple[str, int]:
    """``?schedule=`` and ``?max_in_flight=`` of a bulk request, checked."""
    from span_workflows.runtime.bulk import DEFAULT_MAX_IN_FLIGHT, check_options

    params = request.query_params
    unknown = sorted(set(params) - {"schedule", "max_in_flight"})
    if unknown:
        raise SpanQueryError(unknown[0], "unknown option of a bulk (known: schedule, "
                                         "max_in_flight)")
    schedule = params.get("schedule", "cluster")
    raw = params.get("max_in_flight", str(DEFAULT_MAX_IN_FLIGHT))
    try:
        max_in_flight = int(raw)
    except ValueError:
        raise SpanQueryError("max_in_flight", f"must be an integer >= 1, not {raw!r}") from None
    check_options(schedule, max_in_flight)
    return schedule, max_in_flight


def _is_validation_error(exc: BaseException) -> bool:
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # pragma: no cover - older vLLM
        return False
    return isinstance(exc, VLLMValidationError)


async def _read_body(request: Any, max_body: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None:
        try:
            if int(length) > max_body:
                raise BodyTooLarge
        except ValueError:
            raise SpanQueryError("", "invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _stream_response(service: SpanQueryService, query: wire.QueryBody,
                           response_class: Any) -> Any:
    """Start the query; answer SSE once it produced its first delta (so invalid queries still
    get a plain 400), or the plain error if it failed before that."""
    run = StreamedRun()
    stream = PartStream(run.put_delta)
    first = await run.start(lambda: service.execute(
        query.node, optimize_query=query.optimize, stream=stream,
        span_options=query.span_options, cache_salt=query.cache_salt, weights=query.weights))
    if first[0] == "error":
        raise first[1]

    def render(kind: str, value: Any) -> tuple[list[bytes], bool]:
        if kind == "delta":
            return [wire.sse(wire.delta_event(value))], False
        if kind == "done":
            return [wire.sse(wire.done_event(value))], True
        return [wire.sse(wire.error_event(value))], True

    return response_class(run.events(first, render), media_type=wire.SSE_MEDIA_TYPE,
                          headers={"Cache-Control": "no-cache"})


# --------------------------------------------------------------------------------------------
# /metrics


class SpanStatsCollector:
    """Prometheus collector of the span counters last fetched from the engine core."""

    def __init__(self, service: SpanQueryService) -> None:
        self.service = service

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for name, doc in contract.STAT_HELP.items():
            yield CounterMetricFamily(f"span_{name}", doc,
                                      value=float(self.service.stats.get(name, 0)))

    def describe(self) -> list[Any]:
        return []


async def _metrics_endpoint(request: HttpRequest) -> Any:
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    service: SpanQueryService = request.app.state.span_service
    await service.refresh_stats()
    registry = get_prometheus_registry()
    text = generate_latest(registry)
    if registry is not REGISTRY:  # vLLM's multiprocess registry: add the span counters
        own = CollectorRegistry(auto_describe=False)
        own.register(SpanStatsCollector(service))
        text += generate_latest(own)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


def install(app: Any, service: SpanQueryService, *, max_body: int = wire.MAX_BODY_BYTES) -> None:
    """Add the span endpoints, metrics collector and scrape hook to vLLM's ``app``."""
    from prometheus_client import REGISTRY

    app.state.span_service = service
    app.include_router(make_router(max_body))
    install_chat_route(app)  # /v1/chat/completions with "spans"
    # vLLM's /metrics, with the span counters fetched from the engine core first. Put ahead of
    # vLLM's own /metrics routes (the middleware stack is already built, so no middleware).
    from fastapi.routing import APIRoute

    app.router.routes.insert(0, APIRoute("/metrics", _metrics_endpoint, methods=["GET"],
                                         include_in_schema=False))
    collector = SpanStatsCollector(service)
    previous = getattr(install, "_collector", None)
    if previous is not None:
        REGISTRY.unregister(previous)
    REGISTRY.register(collector)
    install._collector = collector  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Launcher


def make_parser() -> Any:
    """vLLM's ``serve`` argument parser with this server's defaults and options."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(
        description="vLLM OpenAI-compatible server with span queries (/v1/query/execute)."
    ))
    parser.add_argument("--span-max-body", type=int, default=wire.MAX_BODY_BYTES,
                        help="largest /v1/query/execute request body, in bytes")
    parser.add_argument("--span-routing", action=argparse.BooleanOptionalAction, default=True,
                        help="send span queries to the span-ready LoRA adapter of "
                             "--lora-modules and the rest to the base (default: on)")
    parser.set_defaults(host=DEFAULT_HOST, enable_prefix_caching=True)
    return parser


async def run(args: Namespace) -> None:
    """Serve until interrupted (vLLM's ``run_server`` with the span endpoints added)."""
    import signal

    import vllm.envs as envs
    from transformers import AutoTokenizer
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer", skip_if_decorated=True)

    def _interrupt_init(*_: Any) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt_init)
    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine_client:
            supported_tasks = await engine_client.get_supported_tasks()
            app = build_app(args, supported_tasks, engine_client.model_config)
            await init_app_state(engine_client, app.state, args, supported_tasks)
            model_config = engine_client.model_config
            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
            block_size = int(engine_client.vllm_config.cache_config.block_size)
            # a span-ready model records the span options it answers best with
            defaults = span_defaults(Path(str(model_config.model)))
            models = app.state.openai_serving_models
            loras = models.lora_requests
            names = [p.name for p in models.base_model_paths]
            router = WeightsRouter(
                names[-1],  # a bundled model's short name comes last
                {name: Adapter.load(name, lora.lora_path) for name, lora in loras.items()},
                enabled=args.span_routing, aliases=tuple(names[:-1]))
            service = SpanQueryService(engine_client, tokenizer, block_size,
                                       int(model_config.max_model_len), contract.layout_key(),
                                       SpanOptions.coerce(defaults or None), router, loras)
            for name, lora in loras.items():  # warmed before /health answers
                prompt, params = warm_up(tokenizer.eos_token_id or 0)
                async for _ in engine_client.generate(prompt, params, f"span-warm-up-{name}",
                                                      lora_request=lora):
                    pass
            install(app, service, max_body=args.span_max_body)
            shutdown_task = await serve_http(
                app,
                sock=sock,
                enable_ssl_refresh=args.enable_ssl_refresh,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count,
            )
        await shutdown_task
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m span_workflows.serving.app --model DIR ...``"""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) and not args.model:
        args.model = args.model_tag
    data_parallel = int(getattr(args, "data_parallel_size", 1) or 1)
    if data_parallel > 1:
        print(f"span server: error: --data-parallel-size {data_parallel} is not supported: "
              "each rank has its own span cache and a query's requests would be split "
              "between them; run one server per rank", file=sys.stderr)
        raise SystemExit(2)
    # Span mode for the engine processes this server starts (the launcher set it already when
    # it started us; run by hand, the model is local unless HF_HUB_OFFLINE says otherwise).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    contract.enable()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
