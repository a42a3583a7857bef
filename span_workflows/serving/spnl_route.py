"""``/v1/query/execute`` in spnl's form: URL options and the OpenAI-shaped answers
(the wire: :mod:`span_workflows.serving.spnl_wire`)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from starlette.requests import Request as HttpRequest

from span_workflows.query.ir import Map
from span_workflows.runtime.streaming import ChoiceStream
from span_workflows.serving import spnl_wire, wire
from span_workflows.serving.chat_route import engine_error, stream_choices
from span_workflows.serving.service import SpanQueryService


def url_options(request: HttpRequest, query: wire.QueryBody) -> tuple[wire.QueryBody, bool]:
    """``query`` with the URL's ``stream`` applied, and whether to answer in the OpenAI shapes
    (:func:`span_workflows.serving.spnl_wire.openai_form`)."""
    stream = spnl_wire.url_stream(request.query_params)
    if stream is not None:
        query = dataclasses.replace(query, stream=stream)
    return query, spnl_wire.openai_form(request.query_params,
                                        request.headers.get("content-type"))


async def openai_form_response(request: HttpRequest, query: wire.QueryBody) -> Any:
    """Run ``query`` and answer it in the OpenAI shapes, plain or streamed."""
    from fastapi.responses import JSONResponse

    state = request.app.state
    service: SpanQueryService = state.span_service
    normalized = service.planner.normalize(query.node, query.optimize)
    order = spnl_wire.choice_order(query.node, normalized)
    is_map = isinstance(query.node, Map)
    ids = {"request_id": f"{'cmpl' if is_map else 'chatcmpl'}-{uuid.uuid4().hex}",
           "created": int(time.time()), "model": state.openai_serving_models.model_name()}
    options = {"optimize_query": False, "span_options": query.span_options,
               "cache_salt": query.cache_salt}

    def index(k: int) -> int:
        return order[k] if len(order) > 1 and k < len(order) else k

    if not query.stream:
        choices = ChoiceStream()
        try:
            result = await service.execute(normalized, stream=choices,  # type: ignore[arg-type]
                                           **options)
        except Exception as exc:  # noqa: BLE001 - a bad request the engine refused
            return engine_error(exc)
        return JSONResponse(spnl_wire.completion_body(
            result, is_map=is_map, order=[index(k) for k in range(len(result.texts))],
            finish_reasons=choices.finish_reasons, **ids))

    def delta(k: int, text: str) -> list[dict[str, Any]]:
        return [spnl_wire.chunk_body(index(k), text, is_map=is_map, **ids)]

    def done(result: Any, reasons: dict[int, str]) -> list[dict[str, Any]]:
        return [spnl_wire.chunk_body(index(k), "", is_map=is_map,
                                     finish_reason=reasons.get(k, "stop"), **ids)
                for k in range(len(result.texts))]

    return await stream_choices(service, normalized, delta, done, **options)


__all__ = ["openai_form_response", "url_options"]
