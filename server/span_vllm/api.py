"""The span query server: vLLM's OpenAI-compatible server plus span query endpoints.

Run it with ``python -m span_vllm.api --model DIR [vLLM serve options]`` (or
``span-workflows serve``). It builds vLLM's own FastAPI app and engine client (``AsyncLLM``,
engine core in its own process) with the span plugin active, and adds:

* ``POST /v1/query/execute`` — body: a span query in spnl's JSON IR, bare or as
  ``{"query": Q, "stream": false, "optimize": true}``. Answers
  ``{"text", "texts", "usage": {...}, "metrics": {...}}``; with ``"stream": true`` an SSE stream
  of ``data: {"delta": "..."}`` events and a final ``data: {"done": true, "usage": ...}``.
  Invalid queries answer 400 ``{"error": {"message": "<path>: <what>", "type":
  "invalid_query", "path": "<path>"}}``; bodies over the size cap 413.
* span counters on ``/metrics`` (``span_hit_blocks_total``, ``span_miss_blocks_total``,
  ``span_repositioned_tokens_total``, ``span_duplicated_blocks_total``,
  ``span_unregistered_blocks_total``), read from the engine core with the ``span_stats``
  utility call when ``/metrics`` is scraped.

Like vLLM, ``--api-key`` guards every ``/v1`` path, ``/v1/query/execute`` included. Unlike
``vllm serve``, the server binds 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from argparse import Namespace
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HttpRequest

from span_vllm import contract
from span_workflows.compile import Compiler
from span_workflows.errors import SpanQueryError
from span_workflows.json_ir import from_json, parse_json
from span_workflows.layout import SpanOptions
from span_workflows.plan import (
    PART_SEPARATOR,
    Output,
    Planner,
    Probe,
    QuerySettings,
    Request,
    drive_async,
)

#: Largest request body accepted by ``/v1/query/execute`` (bytes), unless ``--span-max-body``.
MAX_BODY_BYTES = 4 * 1024 * 1024
EXECUTE_PATH = "/v1/query/execute"
DEFAULT_HOST = "127.0.0.1"
_WRAPPER_KEYS = frozenset({"query", "stream", "optimize", "span_options", "cache_salt"})
_STAT_NAMES = contract.STAT_HELP

#: Environment the engine needs (defaults only; an explicit setting wins).
ENV_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


# --------------------------------------------------------------------------------------------
# Request bodies


class BodyTooLarge(Exception):
    """The request body is over the size cap."""


@dataclass(frozen=True, slots=True)
class QueryBody:
    """A parsed ``/v1/query/execute`` body."""

    node: Any
    stream: bool = False
    optimize: bool = True
    span_options: SpanOptions | None = None
    cache_salt: str | None = None


def parse_body(body: bytes) -> QueryBody:
    """The query and its options from a request body; :class:`SpanQueryError` if bad."""
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpanQueryError("", f"request body is not valid UTF-8 ({exc.reason} at byte "
                                 f"{exc.start})") from None
    if not text.strip():
        raise SpanQueryError("", "empty request body: expected a span query in JSON")
    obj = parse_json(text)
    if not (isinstance(obj, dict) and "query" in obj and set(obj) <= _WRAPPER_KEYS):
        return QueryBody(from_json(obj))
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise SpanQueryError("stream", "must be true or false")
    optimize_query = obj.get("optimize", True)
    if not isinstance(optimize_query, bool):
        raise SpanQueryError("optimize", "must be true or false")
    salt = obj.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise SpanQueryError("cache_salt", "must be a non-empty string")
    options = obj.get("span_options")
    return QueryBody(from_json(obj["query"]), stream, optimize_query,
                     None if options is None else SpanOptions.coerce(options), salt)


def error_body(exc: SpanQueryError) -> dict[str, Any]:
    """The JSON error answer for an invalid query."""
    return {"error": {"message": str(exc), "type": "invalid_query", "path": exc.path}}


# --------------------------------------------------------------------------------------------
# Streaming


class _Stream:
    """Turns the cumulative texts of the answer's parts into ordered deltas on a queue: part
    ``k`` streams live once parts ``0..k-1`` are done (earlier output is buffered), and parts
    after the first start with the separator a joined answer uses, so the deltas concatenate
    to exactly the answer's ``text``."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._seen: dict[int, int] = {}
        self._started: set[int] = set()
        self._buffers: dict[int, list[str]] = {}
        self._done: set[int] = set()
        self._current = 0

    def update(self, part: int, text: str) -> None:
        seen = self._seen.get(part, 0)
        if len(text) > seen:
            self._seen[part] = len(text)
            self._emit(part, text[seen:])

    def finish(self, part: int) -> None:
        self._emit(part, "")
        self._done.add(part)
        while self._current in self._done:
            self._current += 1
            for delta in self._buffers.pop(self._current, []):
                self._put(delta)

    def _emit(self, part: int, delta: str) -> None:
        if part not in self._started:
            self._started.add(part)
            if part > 0:
                delta = PART_SEPARATOR + delta
        if not delta:
            return
        if part == self._current:
            self._put(delta)
        else:
            self._buffers.setdefault(part, []).append(delta)

    def _put(self, delta: str) -> None:
        if delta:
            self.queue.put_nowait(("delta", delta))


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# --------------------------------------------------------------------------------------------
# Executing queries


class SpanQueryService:
    """Executes span queries against a running vLLM engine client (``AsyncLLM``)."""

    def __init__(self, engine_client: Any, tokenizer: Any, block_size: int,
                 max_model_len: int, layout_key: str) -> None:
        self.engine = engine_client
        self.layout_key = layout_key
        self.planner = Planner(Compiler.for_tokenizer(tokenizer, block_size), max_model_len)
        self.stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)

    async def execute(self, node: Any, *, optimize_query: bool = True,
                      stream: _Stream | None = None, span_options: SpanOptions | None = None,
                      cache_salt: str | None = None) -> Any:
        """Run one parsed query; returns a :class:`span_workflows.engine.Result`."""
        settings = QuerySettings(span_options or self.planner.compiler.options, cache_salt)
        plan = self.planner.plan_query(self.planner.normalize(node, optimize_query),
                                       True, settings)

        async def run(req: Request) -> Output:
            return await self._run(req, stream)

        [result] = await drive_async([plan], run, self._probe)
        return result

    async def _probe(self, step: Probe) -> list[bool]:
        answers = []
        for prompt, salt in zip(step.sequences, step.salts, strict=True):
            [hit] = await self.engine.engine_core.call_utility_async(
                contract.PROBE_CALL, [[list(prompt.token_ids), list(prompt.segments)]], salt)
            answers.append(bool(hit))
        return answers

    async def _run(self, req: Request, stream: _Stream | None) -> Output:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=max(1, req.max_tokens), temperature=req.temperature, n=req.n,
            extra_args=(contract.layout_args(req.segments, self.layout_key)
                        if req.segments else None),
        )
        live = stream if req.part is not None else None
        submitted = time.perf_counter()
        first: float | None = None
        final = None
        short = False
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt))
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        outputs_stream = self.engine.generate(prompt, params, f"span-{uuid.uuid4().hex}")
        async for out in outputs_stream:
            if first is None and any(o.token_ids for o in out.outputs):
                first = time.perf_counter()
                if int(out.num_cached_tokens or 0) < req.min_cached:
                    # A prepared span was evicted before use: stop here (nothing was
                    # streamed yet); the plan prepares again and retries.
                    short = True
                    final = out
                    break
            if live is not None:
                for o in out.outputs:
                    if o.index == 0:
                        live.update(req.part, o.text)  # type: ignore[arg-type]
            final = out
        if short:
            await outputs_stream.aclose()  # aborts the request in the engine
        finished = time.perf_counter()
        if final is None:
            raise RuntimeError("the engine returned no output")
        if live is not None and not short:
            live.finish(req.part)  # type: ignore[arg-type]
        outputs = sorted(final.outputs, key=lambda o: o.index)
        return Output(
            texts=[o.text for o in outputs],
            token_ids=[list(o.token_ids) for o in outputs],
            prompt_tokens=len(final.prompt_token_ids or req.prompt),
            cached_tokens=int(final.num_cached_tokens or 0),
            submitted=submitted,
            first_token=first if first is not None else finished,
            finished=finished,
            short=short,
        )

    async def refresh_stats(self, timeout: float = 5.0) -> dict[str, int]:
        """Fetch the span counters from the engine core (keeps the last values on failure)."""
        try:
            snap = await asyncio.wait_for(
                self.engine.engine_core.call_utility_async(contract.STATS_CALL), timeout
            )
            self.stats.update({k: int(v) for k, v in dict(snap).items()})
        except Exception:  # noqa: BLE001 - metrics must never fail a scrape
            pass
        return dict(self.stats)


def result_body(result: Any) -> dict[str, Any]:
    """The JSON answer of an executed query."""
    m = result.metrics
    return {
        "text": result.text,
        "texts": list(result.texts),
        "usage": usage(result),
        "metrics": {
            "ttft_s": m.ttft_s, "prompt_tokens": m.prompt_tokens,
            "cached_tokens": m.cached_tokens, "generated_tokens": m.generated_tokens,
            "prepare_requests": m.prepare_requests, "latency_s": m.latency_s,
            "final_ttft_s": getattr(m, "final_ttft_s", 0.0),
        },
    }


def usage(result: Any) -> dict[str, int]:
    """OpenAI-style usage of a result (final generations only; prepares are not billed)."""
    m = result.metrics
    return {
        "prompt_tokens": m.prompt_tokens, "cached_tokens": m.cached_tokens,
        "completion_tokens": m.generated_tokens,
        "total_tokens": m.prompt_tokens + m.generated_tokens,
    }


# --------------------------------------------------------------------------------------------
# HTTP


def make_router(max_body: int = MAX_BODY_BYTES) -> Any:
    """The FastAPI router of the span endpoints (the service lives in ``app.state``)."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, StreamingResponse

    router = APIRouter()

    @router.post(EXECUTE_PATH)
    async def execute(request: HttpRequest) -> Any:
        service: SpanQueryService = request.app.state.span_service
        try:
            body = await _read_body(request, max_body)
            query = parse_body(body)
            if not query.stream:
                result = await service.execute(
                    query.node, optimize_query=query.optimize, span_options=query.span_options,
                    cache_salt=query.cache_salt)
                return JSONResponse(result_body(result))
            return await _stream_response(service, query, StreamingResponse)
        except BodyTooLarge:
            return JSONResponse(
                {"error": {"message": f"request body is larger than {max_body} bytes",
                           "type": "request_too_large", "path": ""}}, status_code=413)
        except SpanQueryError as exc:
            return JSONResponse(error_body(exc), status_code=400)
        except (RecursionError, MemoryError) as exc:
            err = SpanQueryError("", f"query too large to process ({type(exc).__name__})")
            return JSONResponse(error_body(err), status_code=400)
        except Exception as exc:  # noqa: BLE001 - bad requests rejected by vLLM's own checks
            if _is_validation_error(exc):
                return JSONResponse(error_body(SpanQueryError("input", str(exc))),
                                    status_code=400)
            raise

    return router


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


async def _stream_response(service: SpanQueryService, query: QueryBody,
                           response_class: Any) -> Any:
    """Start the query; answer SSE once it produced its first delta (so invalid queries still
    get a plain 400), or the plain error if it failed before that."""
    stream = _Stream()

    async def work() -> None:
        try:
            result = await service.execute(
                query.node, optimize_query=query.optimize, stream=stream,
                span_options=query.span_options, cache_salt=query.cache_salt)
            stream.queue.put_nowait(("done", result))
        except BaseException as exc:  # handed to the response, which re-raises or reports
            stream.queue.put_nowait(("error", exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    task = asyncio.create_task(work())
    try:
        kind, value = await stream.queue.get()
    except BaseException:
        task.cancel()
        raise
    if kind == "error":
        await asyncio.gather(task, return_exceptions=True)
        raise value

    async def events(kind: str, value: Any) -> AsyncIterator[bytes]:
        try:
            while True:
                if kind == "delta":
                    yield _sse({"delta": value})
                elif kind == "done":
                    yield _sse({"done": True, "text": value.text, "texts": list(value.texts),
                                "usage": usage(value), "metrics": result_body(value)["metrics"]})
                    return
                else:
                    message = str(value) or type(value).__name__
                    kind_name = ("invalid_query" if isinstance(value, SpanQueryError)
                                 else "internal_error")
                    yield _sse({"error": {"message": message, "type": kind_name}})
                    return
                kind, value = await stream.queue.get()
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return response_class(events(kind, value), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache"})


class SpanStatsCollector:
    """Prometheus collector of the span counters last fetched from the engine core."""

    def __init__(self, service: SpanQueryService) -> None:
        self.service = service

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for name, doc in _STAT_NAMES.items():
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


def install(app: Any, service: SpanQueryService, *, max_body: int = MAX_BODY_BYTES) -> None:
    """Add the span endpoints, metrics collector and scrape hook to vLLM's ``app``."""
    from prometheus_client import REGISTRY

    app.state.span_service = service
    app.include_router(make_router(max_body))
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


def prepare_environment() -> str:
    """Turn span mode on for this process and the engine processes it starts (the layout key
    and the engine's environment defaults); returns the layout key."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return contract.enable()


def make_parser() -> Any:
    """vLLM's ``serve`` argument parser with this server's defaults and options."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(
        description="vLLM OpenAI-compatible server with span queries (/v1/query/execute)."
    ))
    parser.add_argument("--span-max-body", type=int, default=MAX_BODY_BYTES,
                        help="largest /v1/query/execute request body, in bytes")
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
            service = SpanQueryService(engine_client, tokenizer, block_size,
                                       int(model_config.max_model_len), contract.layout_key())
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
    """``python -m span_vllm.api --model DIR ...``"""
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
    prepare_environment()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
