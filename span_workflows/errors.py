"""The errors users see.

Every user mistake (malformed JSON, unknown node, bad parameter, a query too long for the model)
raises :class:`SpanQueryError`, whose message starts with the path of the offending node, e.g.
``input.cross[2]: unknown node 'plux'``. The CLI and the server turn it into one line / a 4xx,
and a client turns a 4xx back into it. A span server that cannot be reached raises
:class:`ServerUnavailableError`; one that fails a valid request, :class:`ServerError`.
"""

from __future__ import annotations


class SpanQueryError(ValueError):
    """A span query is invalid. ``path`` names the node (``""`` for the root)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class ModelNotAvailableError(SpanQueryError):
    """The query names a model that is not installed here (pass ``--model`` to override);
    ``remedy`` replaces that advice where something else is missing."""

    def __init__(self, name: str, path: str = "model", remedy: str | None = None) -> None:
        super().__init__(
            path,
            f"model {name!r} is not available; " + (
                remedy or "pass --model PATH (a local Hugging Face model directory) or "
                "--model smollm2-135m-instruct"),
        )


class ServerUnavailableError(ConnectionError):
    """The span server at ``url`` could not be reached (the request never ran)."""

    def __init__(self, url: str, reason: object) -> None:
        self.url = url
        super().__init__(f"span server at {url} is unavailable: {reason}")


class ServerError(RuntimeError):
    """The span server failed to answer a valid request (HTTP 5xx or a broken answer)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        self.url = url
        self.status = status
        super().__init__(f"span server at {url} failed (HTTP {status}): {message}")
