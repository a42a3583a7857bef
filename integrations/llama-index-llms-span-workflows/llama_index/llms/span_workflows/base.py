"""``SpanLLM``: a LlamaIndex LLM that runs span queries.

Prompts are lifted like in the LangChain integration (:func:`span_workflows.fragments.
lift_messages`): the registered fragments found in a prompt (the nodes a
:class:`llama_index.retrievers.span_workflows.SpanRetriever` returned, whatever the response
synthesizer's template put around them) become a plus span between the ordered text before and
after them, so the nodes hit the span cache in any order. The query runs on any
:class:`span_workflows.backend.QueryBackend` (:mod:`span_workflows.runner`); streaming is token
by token on both the embedded engine and a server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from span_workflows.fragments import commutative_outputs, lift_messages
from span_workflows.ir import Generate, role_name
from span_workflows.model import DEFAULT_MODEL_NAME
from span_workflows.result import Result
from span_workflows.runner import Chunk, QueryRunner

R = TypeVar("R", CompletionResponse, ChatResponse)


class SpanLLM(CustomLLM, QueryRunner):
    """A LlamaIndex LLM served by span queries: retrieved nodes commute and hit the span cache.

    Runs on any query backend (``backend=``), a span server (``server_url=``) or the embedded
    engine (``engine=``, or the process-wide default one, created on first use).
    ``last_result`` holds the :class:`span_workflows.result.Result` of the latest call.
    """

    model_name: str = Field(default=DEFAULT_MODEL_NAME, description="Name of the model.")
    backend: Any = Field(default=None, exclude=True, description=(
        "A span_workflows QueryBackend (an Engine or a SpanServer)."))
    engine: Any = Field(default=None, exclude=True, description="An embedded Engine.")
    server_url: str | None = Field(default=None, description="URL of a span server.")
    api_key: str | None = Field(default=None, exclude=True, description="Server API key.")
    timeout: float | None = Field(default=None, description=(
        "Seconds a server request may take (None: 600)."))
    max_retries: int = Field(default=0, description=(
        "How many more times a server request is tried while the server cannot be reached."))
    max_tokens: int = Field(default=256, description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, description="Sampling temperature.")
    context_window: int = Field(default=8192, description="Context window in tokens.")
    span_options: Any = Field(default=None, description=(
        "What spans attend to and their layout: 'prefix', 'self', a dict or SpanOptions; "
        "None: the engine's or server's default."))
    cache_salt: str | None = Field(default=None, description=(
        "vLLM cache salt: this model's cached KV, spans included, is shared with no other "
        "salt."))

    _server: Any = PrivateAttr(default=None)
    _last_result: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "span_workflows_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window, num_output=self.max_tokens,
            is_chat_model=True, model_name=self.model_name,
        )

    # -- queries --------------------------------------------------------------------------------
    def to_query(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generate:
        """The span query these messages become (fragments lifted into plus spans)."""
        pairs = [(role_name(m.role.value), m.content or "") for m in messages]
        if self.system_prompt and not any(role == "system" for role, _ in pairs):
            pairs.insert(0, ("system", self.system_prompt))
        return lift_messages(
            pairs,
            max_tokens=int(kwargs.get("max_tokens", self.max_tokens)),
            temperature=float(kwargs.get("temperature", self.temperature)),
        )

    # -- completion -----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = self.execute(self._prompt_query(prompt, formatted, **kwargs))
        return _completion(result)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        result = await self.aexecute(self._prompt_query(prompt, formatted, **kwargs))
        return _completion(result)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        return self._responses(self._prompt_query(prompt, formatted, **kwargs),
                               _completion_delta)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._aresponses(self._prompt_query(prompt, formatted, **kwargs),
                                _completion_delta)

    def _prompt_query(self, prompt: str, formatted: bool, **kwargs: Any) -> Generate:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return self.to_query([ChatMessage(role=MessageRole.USER, content=prompt)], **kwargs)

    # -- streaming ------------------------------------------------------------------------------
    def _responses(self, query: Generate, make: Callable[[str, Chunk], R]) -> Iterator[R]:
        """The streamed responses of ``query``: ``make(text so far, chunk)`` per chunk."""
        text = ""
        for chunk in self.stream_query(query):
            text += chunk.delta
            yield make(text, chunk)

    async def _aresponses(self, query: Generate,
                          make: Callable[[str, Chunk], R]) -> AsyncIterator[R]:
        """Async :meth:`_responses`."""
        text = ""
        async for chunk in self.astream_query(query):
            text += chunk.delta
            yield make(text, chunk)

    # -- chat -----------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat(self.execute(self.to_query(messages, **kwargs)))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat(await self.aexecute(self.to_query(messages, **kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._responses(self.to_query(messages, **kwargs), _chat_delta)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        return self._aresponses(self.to_query(messages, **kwargs), _chat_delta)


def _usage(result: Result | None) -> dict[str, Any]:
    """The usage a response carries: OpenAI-style counts and the time to first token."""
    if result is None:
        return {}
    return {**result.metrics.usage(), "ttft_s": result.metrics.ttft_s}


def _completion(result: Result) -> CompletionResponse:
    return CompletionResponse(text=result.text, additional_kwargs=_usage(result),
                              raw={"usage": _usage(result)})


def _completion_delta(text: str, chunk: Chunk) -> CompletionResponse:
    """A streamed completion: the text so far and its delta; the last carries the usage."""
    usage = _usage(chunk.result)
    return CompletionResponse(text=text, delta=chunk.delta, additional_kwargs=usage,
                              raw={"usage": usage} if usage else None)


def _chat(result: Result) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
                        additional_kwargs=_usage(result), raw={"usage": _usage(result)})


def _chat_delta(text: str, chunk: Chunk) -> ChatResponse:
    """A streamed chat answer: the text so far and its delta; the last carries the usage."""
    usage = _usage(chunk.result)
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                        delta=chunk.delta, additional_kwargs=usage,
                        raw={"usage": usage} if usage else None)


#: Wrap a (sync or async) function so the collection it returns is registered as commuting
#: fragments (returns the texts); use it for the search step of a LlamaIndex ``Workflow``.
commutative_step = commutative_outputs

__all__ = ["SpanLLM", "commutative_step"]
