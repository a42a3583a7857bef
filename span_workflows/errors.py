"""The one error type users see for bad span queries.

Every user mistake (malformed JSON, unknown node, bad parameter, a query too long for the model)
raises :class:`SpanQueryError`, whose message starts with the path of the offending node, e.g.
``input.cross[2]: unknown node 'plux'``. The CLI and the server turn it into one line / a 4xx.
"""

from __future__ import annotations


class SpanQueryError(ValueError):
    """A span query is invalid. ``path`` names the node (``""`` for the root)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class ModelNotAvailableError(SpanQueryError):
    """The query names a model that is not installed here (pass ``--model`` to override)."""

    def __init__(self, name: str, path: str = "model") -> None:
        super().__init__(
            path,
            f"model {name!r} is not available; pass --model PATH (a local Hugging Face model "
            "directory) or --model smollm2-135m-instruct",
        )
