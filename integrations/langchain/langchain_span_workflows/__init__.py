"""LangChain integration of span-workflows.

Swap two objects in a pipeline: the retriever becomes :class:`SpanRetriever`, the chat model
:class:`SpanChatModel`. Templates, ``format_docs`` and chains stay as they are; the retrieved
documents reach the model as commutative spans, so their KV cache is reused in any order.
:class:`SpanTextSplitter` cuts the texts into chunks that fill whole KV blocks.
"""

from langchain_span_workflows.chat_models import SpanChatModel
from langchain_span_workflows.retrievers import SpanRetriever
from langchain_span_workflows.runnables import (
    agent_step_runnable,
    commutative_step,
    judge_generator_chain,
)
from langchain_span_workflows.splitters import SpanTextSplitter

__version__ = "0.1.0"

__all__ = [
    "SpanChatModel", "SpanRetriever", "SpanTextSplitter", "agent_step_runnable", "commutative_step",
    "judge_generator_chain",
]
