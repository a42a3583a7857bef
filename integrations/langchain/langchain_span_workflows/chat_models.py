"""``SpanChatModel``: a LangChain chat model that runs span queries.

The model turns the chat messages it receives into a span query: registered fragments (the
documents a :class:`~langchain_span_workflows.retrievers.SpanRetriever` returned, or the outputs
of a :func:`~langchain_span_workflows.runnables.commutative_step`) are found inside the final
prompt text, whatever template and ``format_docs`` put them there, and sent as a plus span
between the ordered text before and after them
(:func:`span_workflows.query.lift.lift_messages`). Everything else stays an ordered chat. The
query runs on any :class:`span_workflows.runtime.backend.QueryBackend`
(:mod:`span_workflows.frameworks`);
streaming is token by token on both the embedded engine and a server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.utils import from_env, secret_from_env
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from langchain_span_workflows.tools import (
    ToolsMixin,
    ai_message_text,
    called_this_turn,
    sampling_options,
    tool_call_chunks,
    tool_calls_of,
    tool_result_text,
)
from span_workflows.compiler.model import DEFAULT_MODEL_NAME
from span_workflows.frameworks import QueryRunner
from span_workflows.query.ir import Generate, role_name
from span_workflows.query.lift import lift_messages
from span_workflows.runtime.result import Result


class SpanChatModel(ToolsMixin, BaseChatModel, QueryRunner):
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

    ``last_result`` holds the :class:`span_workflows.runtime.result.Result` of the latest call (its
    ``metrics`` and, on the embedded engine, its compiled ``query``).

    Tools (``bind_tools``) and structured output (``with_structured_output``) are generated
    under vLLM's structured outputs, so the answer is always a valid call or valid JSON (see
    :mod:`span_workflows.query.sampling`). Sampling options (``top_p``, ``top_k``, ``seed``,
    ``logprobs``, penalties, ``stop``) go to vLLM's sampler; an option it does not know is
    refused with ``ValueError``.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default=DEFAULT_MODEL_NAME, alias="model")
    """The model: the default's name or a local Hugging Face model directory. Without
    ``backend``/``server_url``/``engine``, the process's default engine loads it on first use
    (one model per process: another raises ``ValueError``)."""
    backend: Any = Field(default=None, exclude=True)
    """A ``span_workflows.runtime.backend.QueryBackend`` (an ``Engine`` or a ``SpanServer``)."""
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
    """Stop sequences: generation ends at the first one (it is not returned)."""
    top_p: float | None = None
    """Nucleus sampling: sample from the smallest set of tokens this probable."""
    top_k: int | None = None
    """Sample from the k most probable tokens (``None``/0: all)."""
    seed: int | None = None
    """Seed of this model's sampling: equal seeds, equal samples."""
    logprobs: int | None = None
    """Top log-probabilities to return per generated token (``response_metadata``)."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    """Samples per call: one ``ChatGeneration`` each."""
    tool_once_per_turn: bool = False
    """With tools bound: a tool already called since the last human message is not offered
    again (it stays described, so the prompt's prefix is unchanged); once every tool has been
    called, the model answers. Keeps a small model from calling one tool in a loop."""
    timeout: float | None = None
    max_retries: int = 0
    streaming: bool = False
    span_options: Any = None
    """What spans attend to and how they are laid out (``"prefix"``, ``"self"``, a dict or a
    ``span_workflows.query.span_options.SpanOptions``); ``None``: the engine's or server's
    default."""
    cache_salt: str | None = None
    """vLLM cache salt: this model's cached KV, spans included, is shared with no other salt."""
    weights: str | None = None
    """The weights every call runs on: the base's or an adapter's name (e.g. the span-ready
    adapter for tool calls too); ``None``: the engine's routing (span queries on the span-ready
    adapter, tool calls and plain chats on the base)."""

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
    def to_query(self, messages: Sequence[BaseMessage], stop: list[str] | None = None,
                 **kwargs: Any) -> Generate:
        """The span query these chat messages become (fragments lifted into plus spans;
        consecutive tool results commuting). ``kwargs`` are this call's options: ``max_tokens``,
        ``temperature``, sampling options, ``tools``/``tool_choice`` (from ``bind_tools``),
        ``response_format`` (a JSON schema); anything else raises ``ValueError``."""
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        if model is not None and model != self.model_name:
            raise ValueError(f"this SpanChatModel serves {self.model_name!r}; a call cannot "
                             f"switch to model {model!r}")
        max_tokens = int(kwargs.pop("max_tokens", self.max_tokens))
        temperature = float(kwargs.pop("temperature", self.temperature))
        n = int(kwargs.pop("n", self.n))
        sampling = sampling_options(self, kwargs, stop or self.stop)
        names = {c["id"]: c["name"] for m in messages if isinstance(m, AIMessage)
                 for c in m.tool_calls}
        pairs = []
        for m in messages:
            if isinstance(m, ToolMessage):
                pairs.append(("tool", tool_result_text(m, names.get(m.tool_call_id))))
            elif isinstance(m, AIMessage):
                pairs.append(("assistant", ai_message_text(m, sampling.uses_tools)))
            else:
                pairs.append((role_of_message(m), m.text))
        if self.tool_once_per_turn and sampling.uses_tools:
            sampling = dataclasses.replace(sampling, used_tools=called_this_turn(messages,
                                                                                 sampling))
        return lift_messages(pairs, max_tokens=max_tokens, temperature=temperature, n=n,
                             sampling=sampling)

    # -- generation -----------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = self.execute(self.to_query(messages, stop, **kwargs))
        return self._chat_result(result, stop)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = await self.aexecute(self.to_query(messages, stop, **kwargs))
        return self._chat_result(result, stop)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        query = self.to_query(messages, stop, **kwargs)
        if query.sampling.uses_tools:  # a call is only known whole: one chunk
            yield self._whole_chunk(self.execute(query))
            return
        cut = _StopCut(stop or self.stop)
        for piece in self.stream_query(query):
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
        query = self.to_query(messages, stop, **kwargs)
        if query.sampling.uses_tools:  # a call is only known whole: one chunk
            yield self._whole_chunk(await self.aexecute(query))
            return
        cut = _StopCut(stop or self.stop)
        async for piece in self.astream_query(query):
            chunk = self._chunk(cut.add(piece.delta, last=piece.result is not None),
                                piece.result)
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            if chunk.text or piece.result is not None:
                yield chunk

    def _chat_result(self, result: Any, stop: list[str] | None) -> ChatResult:
        texts = [result.text] if result.tool_calls or len(result.texts) < 2 else result.texts
        generations = [ChatGeneration(message=AIMessage(
            content=_apply_stop(text, stop or self.stop),
            tool_calls=tool_calls_of(result),
            usage_metadata=_usage(result),
            response_metadata=self._response_metadata(result),
        )) for text in texts]
        return ChatResult(
            generations=generations,
            llm_output={"model_name": self.model_name,
                        "token_usage": dict(_usage(result))},
        )

    def _whole_chunk(self, result: Result) -> ChatGenerationChunk:
        """The one chunk of a streamed answer that may call tools."""
        return ChatGenerationChunk(message=AIMessageChunk(
            content=result.text,
            tool_call_chunks=tool_call_chunks(result),
            usage_metadata=_usage(result),
            response_metadata=self._response_metadata(result),
            chunk_position="last",
        ))

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
        meta = {
            "model_name": self.model_name, "model_provider": "span_workflows",
            "ttft_s": m.ttft_s, "latency_s": m.latency_s,
            "prepare_requests": m.prepare_requests, "link_requests": m.link_requests,
            "cached_tokens": m.cached_tokens, "engine_steps": m.engine_steps,
            "finish_reason": result.finish_reason,
        }
        if result.logprobs:
            meta["logprobs"] = result.logprobs
        return meta


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
