"""Span queries over HTTP: the server that runs them next to vLLM, and its client.

* :mod:`~span_workflows.serving.wire` — the protocol of ``/v1/query/execute``, for both sides;
* :mod:`~span_workflows.serving.service` — runs queries on vLLM's ``AsyncLLM`` (server side);
* :mod:`~span_workflows.serving.app` — the HTTP app and its ``python -m`` entry point;
* :mod:`~span_workflows.serving.launch` — the command and environment that start it;
* :mod:`~span_workflows.serving.client` — :class:`SpanServer`, a query backend over HTTP.
"""
