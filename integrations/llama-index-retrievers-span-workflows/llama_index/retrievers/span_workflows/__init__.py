"""span-workflows retriever for LlamaIndex:
``from llama_index.retrievers.span_workflows import SpanRetriever``."""

from llama_index.retrievers.span_workflows.base import SpanRetriever

__all__ = ["SpanRetriever"]
