"""LangChain integration of span-workflows.

Swap two objects in a pipeline: the retriever becomes :class:`SpanRetriever`, the chat model
:class:`SpanChatModel`. Templates, ``format_docs`` and chains stay as they are; the retrieved
documents reach the model as commutative spans, so their KV cache is reused in any order.
"""

from langchain_span_workflows.chat_models import SpanChatModel
from langchain_span_workflows.retrievers import SpanRetriever
from langchain_span_workflows.runnables import (
    agent_step_runnable,
    commutative_step,
    judge_generator_chain,
)

__version__ = "0.1.0"

__all__ = [
    "SpanChatModel", "SpanRetriever", "agent_step_runnable", "commutative_step",
    "judge_generator_chain",
]
