"""N span-engine replicas as a Ray Serve application, behind one ingress.

* :class:`SpanReplica` — a Ray Serve deployment; each replica runs one span server (the
  command and environment of ``span-workflows serve``, :mod:`span_workflows.serving.launch`:
  vLLM with the span plugin, in its own process group, on a free local port) with the
  CPUs/GPUs Ray gives the replica, and forwards calls to it. Ray Serve's health check fails
  when that server has exited, so Ray replaces the replica; a watchdog process ends the server
  if the replica's process is killed.
* :class:`SpanIngress` — the HTTP front (FastAPI, Ray Serve's ingress): the single server's API
  (``POST /v1/query/execute`` plain and streamed, vLLM's OpenAI routes forwarded to a replica,
  ``/health``, ``/metrics`` with every replica's samples labelled ``replica``). It computes
  each query's span keys (:class:`~span_workflows.compiler.keys.QueryKeyer`) and calls the
  replicas through a handle routed by
  :class:`~span_workflows.scaleout.ray_router.SpanAffinityRouter`.
* Faults: a call that fails because its replica died (or its server went down) is sent once
  more, to another replica; a second failure is answered ``503``; every call has a deadline
  (``request_timeout_s``, then ``504``): nothing hangs.

:func:`build_app` returns the application (for ``serve.run`` or a Serve config file's
``import_path``, see :func:`app_from_args`); :func:`serve_cluster` runs it in the foreground
(``span-workflows serve --replicas N``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from span_workflows.errors import SpanQueryError
from span_workflows.scaleout.ray_env import check_replicas, forwarded_env
from span_workflows.serving import chat_wire, spnl_wire, wire
from span_workflows.serving.launch import ServerOptions

APP_NAME = "span-workflows"
ROUTERS = ("span-affinity", "prefix-affinity", "power-of-two")
#: Ray Serve LLM's prefix router (``ray.serve.llm.request_router.PrefixCacheAffinityRouter``
#: is this class under its public name; importing ``ray.serve.llm`` needs ``ray[llm]``)
_RAY_PREFIX_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware."
                      "prefix_aware_router:PrefixCacheAffinityRouter")
_SPAN_ROUTER = "span_workflows.scaleout.ray_router:SpanAffinityRouter"


class EngineDownError(RuntimeError):
    """A replica's span server is not answering (it exited or cannot be reached)."""


@dataclass(frozen=True)
class ClusterOptions:
    """How the application is deployed.

    ``replicas``: span-engine replicas; ``num_cpus`` / ``num_gpus``: Ray resources per replica
    (a GPU replica's server sees only its GPU); ``server``: what each replica's server runs
    with, the options of ``span-workflows serve``
    (:class:`~span_workflows.serving.launch.ServerOptions`, or a mapping of its fields; its
    ``api_key`` is also the bearer token the ingress requires on ``/v1`` paths; no
    ``span_store``: replicas keep their spans in their own KV caches); ``router``: one of
    :data:`ROUTERS`;
    ``capacity_tokens``: span tokens the router remembers per replica (``None``: the replica's
    KV cache size, read from its server); ``imbalance_threshold``, ``max_share`` (``None``:
    no bound): see :class:`~span_workflows.scaleout.affinity.AffinityOptions`;
    ``max_ongoing_requests``: per replica; ``request_timeout_s``: deadline of one call to a
    replica; ``server_command``: a command to run instead of the span server (``{port}`` is
    replaced; for tests)."""

    replicas: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    server: ServerOptions = field(default_factory=ServerOptions)
    router: str = "span-affinity"
    capacity_tokens: int | None = None
    imbalance_threshold: int = 2
    max_share: float | None = 1.25
    max_ongoing_requests: int = 16
    request_timeout_s: float = 600.0
    start_timeout_s: float = 600.0
    server_command: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "server", ServerOptions.coerce(self.server))
        object.__setattr__(self, "server_command", tuple(self.server_command))
        check_replicas(self.replicas, self.num_cpus, self.num_gpus)
        if self.server.span_store is not None:
            raise ValueError("span_store is not available with replicas (each keeps its "
                             "spans in its own KV cache)")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}")
        if self.capacity_tokens is not None and self.capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, not {self.capacity_tokens}")
        if self.imbalance_threshold < 0:
            raise ValueError("imbalance_threshold must be >= 0")
        if self.max_share is not None and self.max_share < 1:
            raise ValueError(f"max_share must be >= 1 (or None), not {self.max_share}")
        if self.request_timeout_s <= 0 or self.max_ongoing_requests < 1:
            raise ValueError("request_timeout_s must be > 0 and max_ongoing_requests >= 1")


@dataclass(frozen=True)
class ReplicaAnswer:
    """A replica's HTTP answer, passed back through the ingress as is."""

    status: int
    body: bytes
    media_type: str
    replica: str = ""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica's server reports: KV block size and cache size (tokens), if known."""

    replica: str
    block_size: int | None
    cache_tokens: int | None


# --------------------------------------------------------------------------------------------
# Replicas


class SpanReplica:
    """One span server, started when the replica starts and stopped with it."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = ClusterOptions(**options)
        self.name = _replica_name()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open with the replica
            prefix="span-replica-", suffix=".log", delete=False)
        self.proc, self.url = self._start()
        import httpx

        self.http = httpx.AsyncClient(base_url=self.url, timeout=None, headers=self._auth())

    def _auth(self) -> dict[str, str]:
        key = self.options.server.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _start(self) -> tuple[subprocess.Popen, str]:
        """Start the server in its own process group, with a watchdog that ends the group if
        this replica's process dies without stopping it (Ray kills actors with SIGKILL)."""
        from span_workflows.serving.launch import free_port, wait_until_healthy

        opts = self.options
        port = free_port()
        if opts.server_command:
            cmd = [part.replace("{port}", str(port)) for part in opts.server_command]
            env = dict(os.environ)
        else:
            cmd, env = opts.server.command("127.0.0.1", port), opts.server.env()
        env.update(opts.env)
        proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.watchdog = _watchdog(proc.pid)
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, opts.start_timeout_s)
        return proc, url

    def check_health(self) -> None:
        """Ray Serve's health check: fails once the span server has exited."""
        if self.proc.poll() is not None:
            raise EngineDownError(f"span server of {self.name} exited with {self.proc.returncode}")

    async def info(self) -> ReplicaInfo:
        """Block size and KV cache size, from vLLM's ``cache_config_info`` metric."""
        text = (await self._get("/metrics")).body.decode(errors="replace")
        block = _label(text, "block_size")
        blocks = _label(text, "num_gpu_blocks") or _label(text, "num_cpu_blocks")
        return ReplicaInfo(self.name, block, block * blocks if block and blocks else None)

    async def execute(self, query: Any) -> ReplicaAnswer:
        """``POST /v1/query/execute`` (or another path, see :meth:`forward`) on this replica."""
        return await self.forward(query, wire.EXECUTE_PATH)

    async def forward(self, query: Any, path: str) -> ReplicaAnswer:
        """``POST path`` with the query's body; the answer as is."""
        import httpx

        self.check_health()
        try:
            resp = await self.http.post(path, content=query.body,
                                        headers={"Content-Type": query.content_type})
        except httpx.HTTPError as exc:
            self.check_health()
            raise EngineDownError(f"span server of {self.name}: {exc}") from None
        return ReplicaAnswer(resp.status_code, resp.content,
                             resp.headers.get("content-type", "application/json"), self.name)

    async def stream(self, query: Any, path: str = wire.EXECUTE_PATH) -> AsyncIterator[Any]:
        """A streamed call: first a :class:`ReplicaAnswer` without body (status, media type),
        then the body's chunks."""
        import httpx

        self.check_health()
        try:
            async with self.http.stream("POST", path, content=query.body,
                                        headers={"Content-Type": query.content_type}) as resp:
                yield ReplicaAnswer(resp.status_code, b"",
                                    resp.headers.get("content-type", wire.SSE_MEDIA_TYPE),
                                    self.name)
                async for chunk in resp.aiter_raw():
                    yield chunk
        except httpx.HTTPError as exc:
            self.check_health()
            raise EngineDownError(f"span server of {self.name}: {exc}") from None

    async def metrics(self, query: Any = None) -> str:
        """This replica's ``/metrics`` text."""
        return (await self._get("/metrics")).body.decode(errors="replace")

    async def _get(self, path: str) -> ReplicaAnswer:
        import httpx

        try:
            resp = await self.http.get(path)
        except httpx.HTTPError as exc:
            raise EngineDownError(f"span server of {self.name}: {exc}") from None
        return ReplicaAnswer(resp.status_code, resp.content,
                             resp.headers.get("content-type", "text/plain"), self.name)

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            from span_workflows.serving.launch import stop_server_process

            stop_server_process(proc, timeout=10)
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None and watchdog.poll() is None:
            watchdog.kill()


_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(1)
for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        break
    time.sleep(10)
"""


def _watchdog(group: int) -> subprocess.Popen:
    """A process that ends process group ``group`` once this process has died."""
    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(group)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _replica_name() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside a replica (tests)
        return f"local-{os.getpid()}"


def _label(text: str, name: str) -> int | None:
    found = re.search(rf'[{{,]{name}="(\d+)"', text)
    return int(found.group(1)) if found else None


# --------------------------------------------------------------------------------------------
# Metrics


def relabel_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one (``prometheus_client``'s parser and
    writer): every sample gets a ``replica`` label, each family's ``# HELP`` / ``# TYPE`` is
    written once, with the samples of every replica under it; a replica whose text does not
    parse is named in a comment line instead."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    unreadable: list[str] = []
    for replica, text in sorted(texts.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as exc:  # one replica's bad text costs its samples, not the page
            unreadable.append(f"# replica {replica}: metrics not readable ({exc})\n")
            continue
        for family in parsed:
            merged = families.setdefault(family.name, Metric(
                family.name, family.documentation, family.type, family.unit))
            merged.samples += [sample._replace(labels={**sample.labels, "replica": replica})
                               for sample in family.samples]
    return generate_latest(_Families(families)).decode() + "".join(unreadable)


@dataclass(frozen=True)
class _Families:
    """Parsed metric families, as a collector ``generate_latest`` writes."""

    families: dict[str, Any]

    def collect(self) -> Any:
        return iter(self.families.values())


# --------------------------------------------------------------------------------------------
# Ingress


def _retryable(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError

    return isinstance(exc, (RayActorError, EngineDownError))


class SpanIngressCore:
    """The ingress's work, apart from HTTP: key, route, retry, aggregate."""

    def __init__(self, handle: Any, options: dict[str, Any]) -> None:
        self.options = ClusterOptions(**options)
        self.handle = handle
        self.keyer: Any = None
        self._ready = asyncio.Lock()
        # The tokenizer loads (seconds: transformers' import, the files) while the replicas
        # start their engines, not after the first of them answers.
        loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="span-ingress-tokenizer")
        self._tokenizer: Future[Any] = loader.submit(_tokenizer, self.options)
        loader.shutdown(wait=False)

    async def _prepare(self) -> None:
        """Learn the replicas' block size (and cache size) once; build the keyer."""
        async with self._ready:
            if self.keyer is not None:
                return
            from span_workflows.compiler.keys import QueryKeyer

            info = await self._call("info", None, retry=True)
            block = self.options.server.block_size or info.block_size or 32
            self.keyer = QueryKeyer(await asyncio.wrap_future(self._tokenizer), block,
                                    with_prompt=self.options.router == "prefix-affinity")
            router = self.router()
            if router is not None and self.options.capacity_tokens is None and info.cache_tokens:
                from dataclasses import replace

                router.policy.options = replace(router.policy.options,
                                                capacity_tokens=int(info.cache_tokens))

    def router(self) -> Any:
        """This process's span-affinity router of the application, if there is one yet."""
        if self.options.router != "span-affinity":
            return None
        from ray import serve

        from span_workflows.scaleout.ray_router import router_for

        try:
            app = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001 - outside Serve
            app = APP_NAME
        return router_for(app)

    async def route(self, body: bytes, content_type: str = "application/json") -> Any:
        """The parsed body and the :class:`RoutedQuery` of an execute body (raises
        ``SpanQueryError`` if bad)."""
        query = wire.parse_body(body)
        routed = await self.route_node(query.node, body, content_type,
                                       optimize_query=query.optimize,
                                       span_options=query.span_options,
                                       cache_salt=query.cache_salt)
        return query, routed

    async def route_node(self, node: Any, body: bytes, content_type: str = "application/json",
                         **options: Any) -> Any:
        """The :class:`RoutedQuery` that sends ``body`` (whose span query is ``node``) by
        ``node``'s span keys; ``options``: the keyer's (optimize, span options, salt)."""
        from span_workflows.scaleout.ray_router import RoutedQuery

        await self._prepare()
        route = self.keyer.route(node, **options)
        return RoutedQuery(body=body, keys=route.keys, prompt=route.prompt,
                           query_id=uuid.uuid4().hex, content_type=content_type)

    async def _call(self, method: str, query: Any, *, retry: bool = True,
                    args: Sequence[Any] = ()) -> Any:
        """Call ``method`` on a replica with a deadline; once more on another replica if the
        first died or its server is down."""
        from dataclasses import replace

        attempts = 2 if retry else 1
        for attempt in range(attempts):
            try:
                call = getattr(self.handle, method).remote(
                    *(() if query is None else (query,)), *args)
                return await asyncio.wait_for(call, self.options.request_timeout_s)
            except TimeoutError:
                raise
            except Exception as exc:
                if not _retryable(exc) or attempt == attempts - 1:
                    raise
                router = self.router()
                gone = router.replica_of(query.query_id) if router and query else None
                if gone is not None and query is not None:
                    router.forget(gone)
                    query = replace(query, avoid=query.avoid | {gone})
        raise AssertionError("unreachable")

    async def execute(self, query: Any, path: str = wire.EXECUTE_PATH) -> ReplicaAnswer:
        """Run one routed call; failures become HTTP answers (503 / 504)."""
        try:
            return await self._call("forward", query, args=(path,))
        except TimeoutError:
            return _error_answer(504, f"no answer within {self.options.request_timeout_s:.0f} s")
        except Exception as exc:  # noqa: BLE001 - reported to the client
            if _retryable(exc):
                return _error_answer(503, f"replica unavailable after a retry: {exc}")
            raise

    async def metrics(self) -> str:
        """Every replica's metrics, labelled by replica."""
        from span_workflows.scaleout.ray_router import RoutedQuery

        router = self.router()
        if router is None:
            answer = await self._call("metrics", None)
            return relabel_metrics({"any": answer})
        texts: dict[str, str] = {}
        for rid in router.replica_ids():
            try:
                texts[rid] = await asyncio.wait_for(
                    self.handle.metrics.remote(RoutedQuery(target=rid)), 30)
            except Exception:  # noqa: BLE001 - a replica down has no metrics now
                continue
        return relabel_metrics(texts)


def _routed_response(answer: ReplicaAnswer) -> Response:
    """A replica's answer to a routed call, naming the replica in ``x-span-replica``."""
    return Response(answer.body, status_code=answer.status, media_type=answer.media_type,
                    headers={"x-span-replica": answer.replica} if answer.replica else None)


def _error_answer(status: int, message: str) -> ReplicaAnswer:
    err = SpanQueryError("", message)
    return ReplicaAnswer(status, json.dumps(wire.error_body(err)).encode(), "application/json")


def _tokenizer(options: ClusterOptions) -> Any:
    from transformers import AutoTokenizer

    from span_workflows.serving.launch import model_reference

    reference, _ = model_reference(options.server.model)
    return AutoTokenizer.from_pretrained(reference)


def make_ingress_app(core_factory: Any) -> Any:
    """The FastAPI app of the ingress; ``core_factory(request)`` gives its
    :class:`SpanIngressCore`."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="span-workflows (Ray Serve)")

    def unauthorized(request: Request, core: SpanIngressCore) -> Response | None:
        key = core.options.server.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return None

    @app.get(wire.HEALTH_PATH)
    async def health(request: Request) -> Response:
        """200 once a replica has answered (the ingress knows the block size), else 503."""
        try:
            await asyncio.wait_for(core_factory(request)._prepare(), 10)
        except Exception:  # noqa: BLE001 - not ready yet
            return Response(status_code=503)
        return Response(status_code=200)

    @app.post(wire.EXECUTE_PATH)
    async def execute(request: Request) -> Response:
        """Our query form and spnl's (``text/plain``, ``?stream=``, ``?format=``): the URL
        travels to the replica as received, which answers in the shape asked for."""
        core = core_factory(request)
        if (denied := unauthorized(request, core)) is not None:
            return denied
        body = await request.body()
        if len(body) > wire.MAX_BODY_BYTES:
            return JSONResponse(wire.too_large_body(wire.MAX_BODY_BYTES), status_code=413)
        content_type = request.headers.get("content-type") or "application/json"
        try:
            parsed, query = await core.route(body, content_type)
            stream = spnl_wire.url_stream(request.query_params)
        except SpanQueryError as exc:
            return JSONResponse(wire.error_body(exc), status_code=400)
        path = wire.EXECUTE_PATH + (f"?{request.url.query}" if request.url.query else "")
        if parsed.stream if stream is None else stream:
            return await _streamed(core, query, StreamingResponse, path)
        answer = await core.execute(query, path)
        return _routed_response(answer)

    @app.post(chat_wire.CHAT_PATH)
    async def chat(request: Request) -> Response:
        """Chat completions: with ``spans``, routed by the spans' keys (streamed when asked);
        without, as every other OpenAI route."""
        core = core_factory(request)
        if (denied := unauthorized(request, core)) is not None:
            return denied
        body = await request.body()
        if not chat_wire.has_spans(body):
            return await openai_route(core, chat_wire.CHAT_PATH, body)
        try:
            chat = chat_wire.parse_span_chat(json.loads(body))
        except SpanQueryError as exc:
            return JSONResponse(wire.error_body(exc), status_code=400)
        query = await core.route_node(chat.node, body, cache_salt=chat.cache_salt)
        if chat.stream:
            return await _streamed(core, query, StreamingResponse, chat_wire.CHAT_PATH)
        answer = await core.execute(query, chat_wire.CHAT_PATH)
        return _routed_response(answer)

    async def openai_route(core: SpanIngressCore, path: str, body: bytes) -> Response:
        from span_workflows.scaleout.ray_router import RoutedQuery

        query = RoutedQuery(body=body, query_id=uuid.uuid4().hex)
        answer = await core.execute(query, path)
        return Response(answer.body, status_code=answer.status, media_type=answer.media_type)

    @app.post("/v1/{rest:path}")
    async def openai(rest: str, request: Request) -> Response:
        """vLLM's OpenAI routes (completions, ...), sent to the least loaded replica."""
        core = core_factory(request)
        if (denied := unauthorized(request, core)) is not None:
            return denied
        return await openai_route(core, f"/v1/{rest}", await request.body())

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return PlainTextResponse(await core_factory(request).metrics())

    return app


async def _streamed(core: SpanIngressCore, query: Any, response_class: Any,
                    path: str = wire.EXECUTE_PATH) -> Any:
    """Open the replica's stream of ``path`` (retrying once before its first byte) and pass
    it on."""
    from dataclasses import replace

    for attempt in range(2):
        gen = core.handle.options(stream=True).stream.remote(query, path)
        try:
            head = await asyncio.wait_for(gen.__anext__(), core.options.request_timeout_s)
            break
        except TimeoutError:
            answer = _error_answer(504, "no answer in time")
            return Response(answer.body, status_code=504, media_type=answer.media_type)
        except Exception as exc:
            if not _retryable(exc) or attempt == 1:
                answer = _error_answer(503, f"replica unavailable after a retry: {exc}")
                return Response(answer.body, status_code=503, media_type=answer.media_type)
            router = core.router()
            gone = router.replica_of(query.query_id) if router else None
            if gone is not None:
                router.forget(gone)
                query = replace(query, avoid=query.avoid | {gone})
    if head.status != 200:
        body = b"".join([chunk async for chunk in gen])
        return Response(body, status_code=head.status, media_type=head.media_type)

    async def chunks() -> AsyncIterator[bytes]:
        async for chunk in gen:
            yield chunk

    return response_class(chunks(), media_type=head.media_type,
                          headers={"Cache-Control": "no-cache", "x-span-replica": head.replica})


# --------------------------------------------------------------------------------------------
# The application


def build_app(options: ClusterOptions) -> Any:
    """The Ray Serve application: ``SpanReplica`` × ``options.replicas`` behind the ingress."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    settings = asdict(options)
    replica_options: dict[str, Any] = {
        "num_replicas": options.replicas,
        "ray_actor_options": {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus},
        "max_ongoing_requests": options.max_ongoing_requests,
        "health_check_period_s": 2,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 20,
    }
    if options.router == "span-affinity":
        kwargs: dict[str, Any] = {"imbalance_threshold": options.imbalance_threshold,
                                  "max_share": options.max_share}
        if options.capacity_tokens is not None:
            kwargs["capacity_tokens"] = options.capacity_tokens
        replica_options["request_router_config"] = RequestRouterConfig(
            request_router_class=_SPAN_ROUTER, request_router_kwargs=kwargs)
    elif options.router == "prefix-affinity":
        replica_options["request_router_config"] = RequestRouterConfig(
            request_router_class=_RAY_PREFIX_ROUTER)
    replica = serve.deployment(SpanReplica, name="SpanReplica").options(**replica_options)
    return _ingress_deployment().bind(replica.bind(_replica_settings(options)), settings)


def _replica_settings(options: ClusterOptions) -> dict[str, Any]:
    """What a replica is built from: the server's settings only, so that redeploying with
    another router or replica count keeps the running replicas (Ray reconfigures them)."""
    from dataclasses import replace

    default = ClusterOptions()
    return asdict(replace(options, replicas=default.replicas, router=default.router,
                          capacity_tokens=None, imbalance_threshold=default.imbalance_threshold,
                          max_share=default.max_share,
                          max_ongoing_requests=default.max_ongoing_requests,
                          request_timeout_s=default.request_timeout_s))


def _ingress_deployment() -> Any:
    from ray import serve

    app = make_ingress_app(_ingress_core)

    @serve.deployment(name="SpanIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=1000)
    @serve.ingress(app)
    class SpanIngress:
        """The HTTP front of the application."""

        def __init__(self, replicas: Any, options: dict[str, Any]) -> None:
            _set_ingress_core(SpanIngressCore(replicas, options))

        def check_health(self) -> None:
            """Always healthy: replicas are checked on their own."""

    return SpanIngress


#: The ingress core of this process (one ingress replica per process).
_CORE: list[SpanIngressCore] = []


def _set_ingress_core(core: SpanIngressCore) -> None:
    _CORE[:] = [core]


def _ingress_core(request: Any) -> SpanIngressCore:
    if not _CORE:
        raise RuntimeError("the ingress is not initialized")
    return _CORE[0]


def app_from_args(args: dict[str, Any]) -> Any:
    """Application builder for a Serve config file (``import_path:
    span_workflows.scaleout.deployment:app_from_args``, ``args``: :class:`ClusterOptions`
    fields)."""
    return build_app(ClusterOptions(**dict(args)))


def serve_cluster(options: ClusterOptions, host: str = "127.0.0.1", port: int = 8000,
                  address: str | None = None) -> None:
    """Run the application until interrupted: on the Ray cluster at ``address`` (or
    ``RAY_ADDRESS``), else on a local Ray started here with this machine's resources."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False,
                 runtime_env={"env_vars": forwarded_env()}, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(options), name=APP_NAME, route_prefix="/")
    print(f"span-workflows: {options.replicas} replicas ({options.router}) at "
          f"http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


__all__ = [
    "APP_NAME", "ROUTERS", "ClusterOptions", "EngineDownError", "ReplicaAnswer", "ReplicaInfo",
    "SpanIngressCore", "SpanReplica", "app_from_args", "build_app", "make_ingress_app",
    "relabel_metrics", "serve_cluster",
]
