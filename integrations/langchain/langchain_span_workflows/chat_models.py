"""``SpanChatModel``: a LangChain chat model that runs span queries.

The model turns the chat messages it receives into a span query: registered fragments (the
documents a :class:`~langchain_span_workflows.retrievers.SpanRetriever` returned, or the outputs
of a :func:`~langchain_span_workflows.runnables.commutative_step`) are found inside the final
prompt text, whatever template and ``format_docs`` put them there, and sent as a plus span
between the ordered text before and after them
(:func:`span_workflows.fragments.lift_messages`). Everything else stays an ordered chat. The
query runs on any :class:`span_workflows.backend.QueryBackend` (:mod:`span_workflows.runner`);
streaming is token by token on both the embedded engine and a server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils import from_env, secret_from_env
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from span_workflows.fragments import lift_messages
from span_workflows.ir import Generate, role_name
from span_workflows.model import DEFAULT_MODEL_NAME
from span_workflows.result import Result
from span_workflows.runner import QueryRunner


class SpanChatModel(BaseChatModel, QueryRunner):
    """A chat model served by span queries: retrieved documents commute and hit the span cache.

    Runs on any query backend (``backend=``), a span server (``server_url=``, default
    ``$SPAN_WORKFLOWS_SERVER_URL``) or the embedded engine (``engine=``, or the process-wide
    default one, created on first use).

    Example:
        ```python
        llm = SpanChatModel(max_tokens=64)
        chain = {"context": SpanRetriever.from_texts(texts) | format_docs,
                 "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
        ```

    ``last_result`` holds the :class:`span_workflows.result.Result` of the latest call (its
    ``metrics`` and, on the embedded engine, its compiled ``query``).
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default=DEFAULT_MODEL_NAME, alias="model")
    """Name reported in metadata (the engine serves one model)."""
    backend: Any = Field(default=None, exclude=True)
    """A ``span_workflows.backend.QueryBackend`` (an ``Engine`` or a ``SpanServer``)."""
    engine: Any = Field(default=None, exclude=True)
    """An embedded ``span_workflows.Engine``; ``None``: the shared default engine."""
    server_url: str | None = Field(
        default_factory=from_env("SPAN_WORKFLOWS_SERVER_URL", default=None)
    )
    """URL of a ``span-workflows serve`` server; when set, queries run there."""
    api_key: SecretStr | None = Field(
        default_factory=secret_from_env("SPAN_WORKFLOWS_API_KEY", default=None)
    )
    """Bearer token of the server (``--api-key``)."""
    max_tokens: int = 256
    temperature: float = 0.0
    stop: list[str] | None = None
    """Stop sequences, applied to the generated text."""
    timeout: float | None = None
    max_retries: int = 0
    streaming: bool = False
    span_options: Any = None
    """What spans attend to and how they are laid out (``"prefix"``, ``"self"``, a dict or a
    ``span_workflows.layout.SpanOptions``); ``None``: the engine's or server's default."""
    cache_salt: str | None = None
    """vLLM cache salt: this model's cached KV, spans included, is shared with no other salt."""

    _server: Any = PrivateAttr(default=None)
    _last_result: Any = PrivateAttr(default=None)

    # -- LangChain plumbing ---------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "span-workflows"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "server_url": self.server_url,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="span_workflows",
            ls_model_name=kwargs.get("model", self.model_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # -- queries --------------------------------------------------------------------------------
    def to_query(self, messages: Sequence[BaseMessage], **kwargs: Any) -> Generate:
        """The span query these chat messages become (fragments lifted into plus spans)."""
        return lift_messages(
            [(role_of_message(m), m.text) for m in messages],
            max_tokens=int(kwargs.get("max_tokens", self.max_tokens)),
            temperature=float(kwargs.get("temperature", self.temperature)),
        )

    # -- generation -----------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = self.execute(self.to_query(messages, **kwargs))
        return self._chat_result(result, stop)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = await self.aexecute(self.to_query(messages, **kwargs))
        return self._chat_result(result, stop)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        cut = _StopCut(stop or self.stop)
        for piece in self.stream_query(self.to_query(messages, **kwargs)):
            chunk = self._chunk(cut.add(piece.delta, last=piece.result is not None),
                                piece.result)
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            if chunk.text or piece.result is not None:
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        cut = _StopCut(stop or self.stop)
        async for piece in self.astream_query(self.to_query(messages, **kwargs)):
            chunk = self._chunk(cut.add(piece.delta, last=piece.result is not None),
                                piece.result)
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            if chunk.text or piece.result is not None:
                yield chunk

    def _chat_result(self, result: Any, stop: list[str] | None) -> ChatResult:
        text = _apply_stop(result.text, stop or self.stop)
        message = AIMessage(
            content=text,
            usage_metadata=_usage(result),
            response_metadata=self._response_metadata(result),
        )
        return ChatResult(
            generations=[ChatGeneration(message=message)],
            llm_output={"model_name": self.model_name,
                        "token_usage": dict(_usage(result))},
        )

    def _chunk(self, text: str, result: Result | None) -> ChatGenerationChunk:
        """A chunk of streamed text; the last one (with the result) also carries the usage
        and the response metadata."""
        if result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=text))
        return ChatGenerationChunk(message=AIMessageChunk(
            content=text,
            usage_metadata=_usage(result),
            response_metadata=self._response_metadata(result),
            chunk_position="last",
        ))

    def _response_metadata(self, result: Any) -> dict[str, Any]:
        m = result.metrics
        return {
            "model_name": self.model_name, "model_provider": "span_workflows",
            "ttft_s": m.ttft_s, "latency_s": m.latency_s,
            "prepare_requests": m.prepare_requests, "link_requests": m.link_requests,
            "cached_tokens": m.cached_tokens,
            "finish_reason": "stop",
        }


def role_of_message(message: BaseMessage) -> str:
    """The chat role of a LangChain message (its ``type``, or a ``ChatMessage``'s ``role``)."""
    return role_name(message.role if isinstance(message, ChatMessage) else message.type)


def _usage(result: Any) -> UsageMetadata:
    m = result.metrics
    return UsageMetadata(
        input_tokens=m.prompt_tokens,
        output_tokens=m.generated_tokens,
        total_tokens=m.prompt_tokens + m.generated_tokens,
        input_token_details={"cache_read": m.cached_tokens},
    )


def _apply_stop(text: str, stop: list[str] | None) -> str:
    """``text`` cut before the first occurrence of any stop sequence."""
    cut = len(text)
    for s in stop or []:
        if s:
            at = text.find(s)
            if 0 <= at < cut:
                cut = at
    return text[:cut]


class _StopCut:
    """Streamed text cut before its first stop sequence: :meth:`add` takes a delta and
    returns what may be shown, holding back a tail that could still begin a stop sequence
    (released with the last delta)."""

    def __init__(self, stop: list[str] | None) -> None:
        self.stop = [s for s in stop or [] if s]
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.text = ""
        self.shown = 0
        self.stopped = False

    def add(self, delta: str, last: bool = False) -> str:
        if self.stopped:
            return ""
        self.text += delta
        cut = _apply_stop(self.text, self.stop)
        if len(cut) < len(self.text):
            self.stopped = True
            end = len(cut)
        else:
            end = len(cut) if last else max(self.shown, len(cut) - self.hold)
        shown, self.shown = cut[self.shown:end], end
        return shown


__all__ = ["SpanChatModel"]
