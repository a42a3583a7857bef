"""span-workflows LLM for LlamaIndex: ``from llama_index.llms.span_workflows import SpanLLM``."""

from llama_index.llms.span_workflows.base import SpanLLM, commutative_step

__all__ = ["SpanLLM", "commutative_step"]
