"""Where a framework model's span queries run: the process-wide default engine, and the mixin
that LangChain's ``SpanChatModel`` and LlamaIndex's ``SpanLLM`` share.

A framework model runs its queries on a :class:`~span_workflows.runtime.backend.QueryBackend`,
chosen once per call in this order: the one given as ``backend=``; a
:class:`~span_workflows.serving.client.SpanServer` for ``server_url=`` (built once per model,
with its ``api_key``, ``timeout`` and ``max_retries``); the embedded engine given as
``engine=``; else the process-wide :func:`default_engine` (created on first use: vLLM cannot run
two in-process engines).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from span_workflows.compiler.model import DEFAULT_MODEL_NAME
from span_workflows.query.ir import Node
from span_workflows.runtime.backend import QueryBackend
from span_workflows.runtime.result import Result
from span_workflows.runtime.streaming import AsyncTextStream, TextStream

#: the environment variable naming the default engine's span store directory
SPAN_STORE_ENV = "SPAN_WORKFLOWS_SPAN_STORE"
_engine_lock = threading.Lock()
_default_engine: Any = None


def default_engine(model: str | None = None) -> Any:
    """The embedded :class:`~span_workflows.runtime.engine.Engine` that framework models use when
    they are given no backend: created on first use, then shared by the whole process.

    ``model`` chooses what it loads: ``None`` or the default's name
    (:data:`~span_workflows.compiler.model.DEFAULT_MODEL_NAME`) the bundled default, announced once
    on stderr, else a local model directory. vLLM runs one engine per process, so asking for
    another model than the one loaded raises ``ValueError``. ``SPAN_WORKFLOWS_SPAN_STORE``
    (a directory) gives it a span store (``Engine(span_store=...)``: spans kept on disk,
    across restarts; ``span-workflows index`` fills one)."""
    global _default_engine
    default = model is None or model == DEFAULT_MODEL_NAME
    with _engine_lock:
        if _default_engine is None:
            from span_workflows.runtime.engine import Engine

            if default:
                print(f"span-workflows: loading the default model {DEFAULT_MODEL_NAME}",
                      file=sys.stderr)
            store = os.environ.get(SPAN_STORE_ENV) or None
            _default_engine = Engine(None if default else model, span_store=store)
        elif not default and model != _default_engine.model_name:
            raise ValueError(
                f"this process already runs an engine for {_default_engine.model_name!r}; "
                f"vLLM runs one in-process engine, so model {model!r} cannot be loaded too "
                f"(serve it with `span-workflows serve` and pass server_url=)")
        elif default and _default_engine.model_name != DEFAULT_MODEL_NAME and model is not None:
            raise ValueError(
                f"this process already runs an engine for {_default_engine.model_name!r}, "
                f"not the default model {DEFAULT_MODEL_NAME!r}")
        return _default_engine


def index_spans(texts: Sequence[str], system: str, *, engine: Any = None,
                batch_size: int = 8, progress: bool = True) -> Any:
    """What the retrievers' ``index_spans`` run: each text's span computed once into the span
    store of ``engine`` (default: :func:`default_engine`), as a plus span after ``system``
    (:func:`span_workflows.runtime.store_index.index_documents`; returns its ``IndexReport``)."""
    from span_workflows.runtime.store_index import index_documents

    return index_documents(engine if engine is not None else default_engine(), list(texts),
                           system, batch_size=batch_size, progress=progress)


def block_chunker(engine: Any = None, blocks: int = 4) -> Any:
    """What the splitters cut text with: ``engine``'s (default: :func:`default_engine`)
    :meth:`~span_workflows.runtime.engine.Engine.chunker` of at most ``blocks`` KV blocks."""
    return (engine if engine is not None else default_engine()).chunker(blocks)


def set_default_engine(engine: Any) -> None:
    """Make ``engine`` the one :func:`default_engine` returns (e.g. an engine you built)."""
    global _default_engine
    with _engine_lock:
        _default_engine = engine


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a streamed answer; the last piece of a stream carries the ``result``."""

    delta: str
    result: Result | None = None


class QueryRunner:
    """What a framework model needs to run span queries on its backend.

    Mixed into a model that declares the fields below (``span_options``, ``cache_salt`` and
    ``weights`` are passed with every query when set) and the private attributes ``_server`` (the
    ``SpanServer`` it built) and ``_last_result``.
    """

    if TYPE_CHECKING:  # declared by each framework model, in its framework's own way
        backend: QueryBackend | None
        server_url: str | None
        engine: QueryBackend | None
        api_key: Any  # a str, or a pydantic SecretStr
        timeout: float | None
        max_retries: int
        span_options: Any
        cache_salt: str | None
        weights: str | None
        _server: QueryBackend | None
        _last_result: Result | None

    @property
    def last_result(self) -> Result | None:
        """The :class:`Result` of the latest call of this model (``None`` before the first)."""
        return self._last_result

    def query_backend(self) -> QueryBackend:
        """The backend this model's queries run on (see the module docstring)."""
        if self.backend is not None:
            return self.backend
        if self.server_url:
            if self._server is None:
                from span_workflows.serving.client import SpanServer

                key = self.api_key
                self._server = SpanServer(
                    self.server_url,
                    api_key=key.get_secret_value() if hasattr(key, "get_secret_value") else key,
                    timeout=self.timeout or 600.0, retries=self.max_retries,
                )
            return self._server
        return self.engine or default_engine(getattr(self, "model_name", None))

    def execute(self, query: Node) -> Result:
        """Run any span query on this model's backend; returns its :class:`Result`."""
        self._last_result = self.query_backend().execute(query, **self._query_options())
        return self._last_result

    async def aexecute(self, query: Node) -> Result:
        """Async :meth:`execute` (the event loop is never blocked)."""
        backend = self.query_backend()
        self._last_result = await backend.aexecute(query, **self._query_options())
        return self._last_result

    def stream_query(self, query: Node) -> Iterator[Chunk]:
        """Run a span query on this model's backend, its answer in :class:`Chunk` s as it is
        generated; the last chunk carries the result."""
        with self.query_backend().stream(query, **self._query_options()) as stream:
            held: str | None = None  # one delta is held back, to go out with the result
            for delta in stream:
                if held is not None:
                    yield Chunk(held)
                held = delta
            yield self._last_chunk(held, stream)

    async def astream_query(self, query: Node) -> AsyncIterator[Chunk]:
        """Async :meth:`stream_query`."""
        async with self.query_backend().astream(query, **self._query_options()) as stream:
            held: str | None = None
            async for delta in stream:
                if held is not None:
                    yield Chunk(held)
                held = delta
            yield self._last_chunk(held, stream)

    def _last_chunk(self, held: str | None, stream: TextStream | AsyncTextStream) -> Chunk:
        self._last_result = stream.result
        return Chunk(held or "", stream.result)

    def _query_options(self) -> dict[str, Any]:
        options = {"span_options": self.span_options, "cache_salt": self.cache_salt,
                   "weights": getattr(self, "weights", None)}
        return {k: v for k, v in options.items() if v is not None}


__all__ = ["SPAN_STORE_ENV", "Chunk", "QueryRunner", "block_chunker", "default_engine",
           "index_spans", "set_default_engine"]
