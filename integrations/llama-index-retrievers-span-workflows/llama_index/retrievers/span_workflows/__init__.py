"""span-workflows retriever for LlamaIndex:
``from llama_index.retrievers.span_workflows import SpanRetriever``, and
:class:`SpanTextSplitter`, a node parser whose chunks fill whole KV blocks."""

from llama_index.retrievers.span_workflows.base import SpanRetriever
from llama_index.retrievers.span_workflows.splitter import SpanTextSplitter

__all__ = ["SpanRetriever", "SpanTextSplitter"]
