"""``POST /v1/chat/completions`` with ``spans``: vLLM's own route, with span requests taken out.

:func:`install_chat_route` wraps vLLM's chat-completions route in a :class:`SpanChatRoute`: a
body with a ``spans`` key is validated by vLLM's own request model, then served as a span
query by the :class:`~span_workflows.serving.service.SpanQueryService` (the wire:
:mod:`span_workflows.serving.chat_wire`); every other body is handed, byte for byte, to
vLLM's route, so requests without ``spans`` behave exactly as stock vLLM. vLLM's middleware
(``--api-key`` among them) runs before either.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.routing import BaseRoute, Match
from starlette.types import Message, Receive, Scope, Send

from span_workflows.errors import SpanQueryError
from span_workflows.runtime.streaming import ChoiceStream
from span_workflows.serving import chat_wire
from span_workflows.serving.service import SpanQueryService, StreamedRun


class SpanChatRoute(BaseRoute):
    """vLLM's chat route (``stock``) for bodies without ``spans``; span queries for the rest."""

    def __init__(self, stock: BaseRoute) -> None:
        self.stock = stock
        self.path = getattr(stock, "path", chat_wire.CHAT_PATH)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return self.stock.matches(scope)

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        return self.stock.url_path_for(name, **path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        replay = _replay(body, receive)
        if scope.get("method") != "POST" or not chat_wire.has_spans(body):
            await self.stock.handle(scope, replay, send)
            return
        response = await span_chat_response(HttpRequest(scope, replay), body)
        await response(scope, replay, send)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _json_error(body: dict[str, Any]) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=int(body["error"]["code"]))


async def span_chat_response(request: HttpRequest, body: bytes) -> Any:
    """The answer to a chat-completions ``body`` that carries ``spans``."""
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    state = request.app.state
    obj = json.loads(body)
    try:
        ChatCompletionRequest.model_validate(
            {k: v for k, v in obj.items() if k != chat_wire.SPANS_KEY})
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()))
        return _json_error(chat_wire.error_body(f"{param}: {first.get('msg')}",
                                                param=param or None))
    models = state.openai_serving_models
    service: SpanQueryService = state.span_service
    name = obj.get("model")
    adapter = name if name in service.router.adapters else None
    if name and adapter is None and not models.is_base_model(name):
        return _json_error(chat_wire.error_body(f"The model `{name}` does not exist.",
                                                status=404, kind="NotFoundError",
                                                param="model"))
    serving_chat = getattr(state, "openai_serving_chat", None)
    defaults = dict(getattr(serving_chat, "default_sampling_params", None) or {})
    try:
        chat = chat_wire.parse_span_chat(obj, defaults)
    except SpanQueryError as exc:
        return _json_error(chat_wire.query_error_body(exc))
    ids = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
           "model": chat.model or models.model_name()}
    if not chat.stream:
        choices = ChoiceStream()
        try:
            result = await service.execute(chat.node, stream=choices,  # type: ignore[arg-type]
                                           cache_salt=chat.cache_salt, sampling=chat.sampling,
                                           weights=adapter)
        except Exception as exc:  # noqa: BLE001 - a bad request the engine refused
            return engine_error(exc)
        ids["model"] = result.metrics.weights or ids["model"]  # the weights that answered
        return JSONResponse(chat_wire.completion_body(result, finish_reasons=choices.finish_reasons,
                                                      uses_tools=chat.uses_tools, **ids))
    if chat.uses_tools:
        return await _stream_whole(service, chat, ids, adapter)
    try:  # every chunk names the weights that answer, as the whole answer does
        ids["model"] = service.weights_name(chat.node, weights=adapter) or ids["model"]
    except SpanQueryError as exc:
        return _json_error(chat_wire.query_error_body(exc))
    return await _stream(service, chat, ids, adapter)


def engine_error(exc: BaseException) -> Any:
    """A 400 for an error the planner or vLLM reports about the request; else re-raised."""
    if isinstance(exc, SpanQueryError):
        return _json_error(chat_wire.query_error_body(exc))
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # pragma: no cover - older vLLM
        raise exc from None
    if isinstance(exc, VLLMValidationError):
        return _json_error(chat_wire.error_body(str(exc)))
    raise exc


async def _stream(service: SpanQueryService, chat: chat_wire.SpanChat,
                  ids: dict[str, Any], weights: str | None) -> Any:
    """The chunk stream of a span chat request."""
    started: set[int] = set()

    def delta(index: int, text: str) -> list[dict[str, Any]]:
        first = index not in started
        started.add(index)
        return [chat_wire.chunk_body(choices=[chat_wire.delta_choice(index, text, first=first)],
                                     **ids)]

    def done(result: Any, reasons: dict[int, str]) -> list[dict[str, Any]]:
        ends = [chat_wire.delta_choice(i, "", first=i not in started,
                                       finish_reason=reasons.get(i, "stop"))
                for i in range(len(result.texts))]
        last = [chat_wire.chunk_body(choices=ends, **ids)]
        if chat.include_usage:
            last.append(chat_wire.usage_chunk_body(result, **ids))
        return last

    return await stream_choices(service, chat.node, delta, done, cache_salt=chat.cache_salt,
                                sampling=chat.sampling, weights=weights)


async def _stream_whole(service: SpanQueryService, chat: chat_wire.SpanChat,
                        ids: dict[str, Any], weights: str | None) -> Any:
    """The chunk stream of an answer in the tool answer format: it is read back whole (its
    JSON is not the client's content), then sent as one delta, the finish and the usage."""
    from fastapi.responses import StreamingResponse

    try:
        result = await service.execute(chat.node, cache_salt=chat.cache_salt,
                                       sampling=chat.sampling, weights=weights)
    except Exception as exc:  # noqa: BLE001 - a bad request the engine refused
        return engine_error(exc)
    ids = {**ids, "model": result.metrics.weights or ids["model"]}
    message = chat_wire.tool_message(result)
    if "tool_calls" in message:
        message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    chunks = [chat_wire.chunk_body(choices=[{"index": 0, "delta": message, "logprobs": None,
                                             "finish_reason": None}], **ids),
              chat_wire.chunk_body(choices=[chat_wire.delta_choice(
                  0, "", finish_reason=result.finish_reason)], **ids)]
    if chat.include_usage:
        chunks.append(chat_wire.usage_chunk_body(result, **ids))
    body = b"".join(_event(c) for c in chunks) + b"data: [DONE]\n\n"
    return StreamingResponse(iter([body]), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def stream_choices(service: SpanQueryService, node: Any,
                         on_delta: Callable[[int, str], list[dict[str, Any]]],
                         on_done: Callable[[Any, dict[str, int]], list[dict[str, Any]]],
                         **execute: Any) -> Any:
    """Run ``node`` on ``service`` (``execute``: its keyword options) and answer an SSE
    stream of OpenAI-style chunks: ``on_delta(index, text)`` gives the chunks of each piece
    of choice ``index``, ``on_done(result, finish_reasons)`` the last ones; ``data: [DONE]``
    ends it. The answer starts once the first piece came, so a request that fails before it
    still gets a plain error answer."""
    from fastapi.responses import StreamingResponse

    run = StreamedRun()
    choices = ChoiceStream(lambda index, delta: run.put_delta((index, delta)))
    first = await run.start(lambda: service.execute(node, stream=choices,  # type: ignore[arg-type]
                                                    **execute))
    if first[0] == "error":
        return engine_error(first[1])

    def render(kind: str, value: Any) -> tuple[list[bytes], bool]:
        if kind == "delta":
            return [_event(chunk) for chunk in on_delta(*value)], False
        if kind == "done":
            return [*(_event(c) for c in on_done(value, choices.finish_reasons)),
                    b"data: [DONE]\n\n"], True
        return [_event(chat_wire.error_body(str(value) or type(value).__name__,
                                            status=500, kind="InternalServerError")),
                b"data: [DONE]\n\n"], True

    return StreamingResponse(run.events(first, render), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def install_chat_route(app: Any) -> bool:
    """Wrap vLLM's ``POST /v1/chat/completions`` route of ``app`` in a
    :class:`SpanChatRoute`; ``False`` if the app has no such route (a model without chat)."""
    routes = app.router.routes
    for i, route in enumerate(routes):
        if (getattr(route, "path", None) == chat_wire.CHAT_PATH
                and "POST" in (getattr(route, "methods", None) or ())):
            routes[i] = SpanChatRoute(route)
            return True
    return False


__all__ = ["SpanChatRoute", "engine_error", "install_chat_route", "span_chat_response",
           "stream_choices"]
