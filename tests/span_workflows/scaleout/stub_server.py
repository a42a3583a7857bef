"""A stand-in span server for the Ray tests: the HTTP surface of ``span-workflows serve``
without an engine. ``POST /v1/query/execute`` answers ``{"text": "stub <pid>"}``; a body
containing ``DIE-ONCE`` makes the first such request (over all stub processes: a marker file in
``$STUB_DIR``) end the process before it answers, as a crashing engine would; with
``"stream": true`` (or ``?stream=true``) it answers server-sent events. Answers echo the URL's
query string and the body's content type. ``POST /v1/chat/completions`` answers a
``chat.completion`` (events when ``"stream": true``) naming the process.

Run: ``python stub_server.py PORT``.
"""

from __future__ import annotations

import json
import os
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def execute(request: Request) -> Response:
    body = await request.body()
    if b"DIE-ONCE" in body:
        marker = os.path.join(os.environ["STUB_DIR"], "died")
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL)
            os.close(fd)
            os._exit(1)
        except FileExistsError:
            pass
    query = json.loads(body)
    if query.get("stream") or request.query_params.get("stream") == "true":
        events = [{"delta": "stub "}, {"delta": str(os.getpid())}, {"done": True}]
        return _events(events)
    return JSONResponse({"text": f"stub {os.getpid()}", "texts": [], "metrics": {},
                         "echo": bool(query.get("query")), "url_query": request.url.query,
                         "content_type": request.headers.get("content-type", "")})


async def chat(request: Request) -> Response:
    body = json.loads(await request.body())
    message = {"role": "assistant", "content": f"stub {os.getpid()}"}
    if body.get("stream"):
        return _events([{"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": message}]}])
    return JSONResponse({"object": "chat.completion", "spans": len(body.get("spans") or []),
                         "choices": [{"index": 0, "message": message}]})


def _events(events: list[dict]) -> Response:
    return Response("".join(f"data: {json.dumps(e)}\n\n" for e in events),
                    media_type="text/event-stream")


async def metrics(request: Request) -> Response:
    return PlainTextResponse(
        "# HELP span_hit_blocks_total KV blocks of plus spans served from the span cache\n"
        "# TYPE span_hit_blocks_total counter\n"
        f"span_hit_blocks_total {os.getpid() % 7}.0\n"
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="4096"} 1.0\n')


app = Starlette(routes=[Route("/health", health), Route("/metrics", metrics),
                        Route("/v1/query/execute", execute, methods=["POST"]),
                        Route("/v1/chat/completions", chat, methods=["POST"])])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
