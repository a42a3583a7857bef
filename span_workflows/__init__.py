"""span-workflows: span queries for vLLM.

A span query is an expression tree of inference calls whose joins say whether their inputs
commute (``plus``) or are ordered (``cross``). Commuting spans are cached once and reused at any
position by the patched vLLM (``span_vllm``), so RAG and judge/generator workloads stop
recomputing their documents and drafts.

>>> from span_workflows import Engine, rag
>>> engine = Engine()                                   # doctest: +SKIP
>>> engine.execute(rag("Be brief.", ["doc a", "doc b"], "question?")).text  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from span_workflows.commutativity.decorator import commutative
from span_workflows.commutativity.lint import CommutativityWarning, LintReport, lint
from span_workflows.compiler.optimize import optimize
from span_workflows.errors import ModelNotAvailableError, SpanQueryError
from span_workflows.query.builders import (
    agent_step,
    assistant,
    chat,
    cross,
    fragment,
    g,
    judge_generator,
    plus,
    rag,
    repeat,
    retrieve,
    system,
    user,
)
from span_workflows.query.ir import (
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Node,
    Plus,
    Prepare,
    Repeat,
    Retrieve,
    Seq,
    System,
    User,
)
from span_workflows.query.json_ir import from_json, to_json
from span_workflows.query.pretty import pretty
from span_workflows.query.span_options import SpanOptions

if TYPE_CHECKING:
    from span_workflows.runtime.backend import QueryBackend
    from span_workflows.runtime.engine import Engine
    from span_workflows.runtime.result import BulkAnswer, Metrics, Result
    from span_workflows.serving.client import SpanServer

__version__ = "0.1.0"

_LAZY = {
    "Engine": "span_workflows.runtime.engine",
    "QueryBackend": "span_workflows.runtime.backend",
    "Metrics": "span_workflows.runtime.result",
    "BulkAnswer": "span_workflows.runtime.result",
    "Result": "span_workflows.runtime.result",
    "SpanServer": "span_workflows.serving.client",
}


def __getattr__(name: str) -> Any:
    """Import the heavy parts (vLLM, httpx) only when they are used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'span_workflows' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Assistant", "BulkAnswer", "Chat", "CommutativityWarning", "Cross", "Engine", "Fragment",
    "Generate", "LintReport", "Map", "Metrics", "ModelNotAvailableError", "Node", "Plus",
    "Prepare", "QueryBackend", "Repeat", "Result", "Retrieve", "Seq", "SpanOptions",
    "SpanQueryError", "SpanServer", "System", "User", "agent_step", "assistant", "chat",
    "commutative", "cross", "fragment", "from_json", "g", "judge_generator", "lint", "optimize",
    "plus", "pretty", "rag", "repeat", "retrieve", "system", "to_json", "user",
]
