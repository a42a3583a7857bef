"""``SpanLLM``: a LlamaIndex LLM that runs span queries.

Prompts are lifted like in the LangChain integration (:func:`span_workflows.query.lift.
lift_messages`): the registered fragments found in a prompt (the nodes a
:class:`llama_index.retrievers.span_workflows.SpanRetriever` returned, whatever the response
synthesizer's template put around them) become a plus span between the ordered text before and
after them, so the nodes hit the span cache in any order. The query runs on any
:class:`span_workflows.runtime.backend.QueryBackend` (:mod:`span_workflows.frameworks`); streaming
is token by token on both the embedded engine and a server.
"""

from __future__ import annotations

import dataclasses
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
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from span_workflows.compiler.model import DEFAULT_MODEL_NAME
from span_workflows.frameworks import Chunk, QueryRunner
from span_workflows.query.ir import Generate, role_name
from span_workflows.query.lift import commutative_outputs, lift_messages
from span_workflows.query.sampling import Sampling, render_calls, render_content, render_tool_result
from span_workflows.runtime.result import Result

R = TypeVar("R", CompletionResponse, ChatResponse)


class SpanLLM(CustomLLM, FunctionCallingLLM, QueryRunner):
    """A LlamaIndex LLM served by span queries: retrieved nodes commute and hit the span cache.

    Runs on any query backend (``backend=``), a span server (``server_url=``) or the embedded
    engine (``engine=``, or the process-wide default one, created on first use).
    ``last_result`` holds the :class:`span_workflows.runtime.result.Result` of the latest call.

    A function-calling LLM (``FunctionAgent``, ``chat_with_tools``): tool calls are generated
    under vLLM's structured outputs (:mod:`span_workflows.query.sampling`), returned in
    ``message.additional_kwargs["tool_calls"]`` and read back by
    :meth:`get_tool_calls_from_response`. In a history, a ``tool`` message is a user turn
    ``Tool <name> returned: ...``; the results of one turn's calls commute (one plus span).
    Chat options other than ``max_tokens``, ``temperature``, ``tools``, ``tool_choice`` and
    the sampling options (``top_p``, ``top_k``, ``seed``, ``logprobs``, ``stop``, penalties)
    are refused with ``ValueError``.
    """

    model_name: str = Field(default=DEFAULT_MODEL_NAME, description=(
        "The model: the default's name or a local model directory, loaded by the process's "
        "default engine on first use (one model per process)."))
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
    context_window: int | None = Field(default=None, description=(
        "Context window in tokens; None: the embedded engine's max_model_len less a block "
        "(a span's layout may pad its last block), or 8192 on a server."))
    span_options: Any = Field(default=None, description=(
        "What spans attend to and their layout: 'prefix', 'self', a dict or SpanOptions; "
        "None: the engine's or server's default."))
    cache_salt: str | None = Field(default=None, description=(
        "vLLM cache salt: this model's cached KV, spans included, is shared with no other "
        "salt."))
    weights: str | None = Field(default=None, description=(
        "The weights every call runs on: the base's or an adapter's name; None: the engine's "
        "routing (span queries on the span-ready adapter, tool calls and chats on the base)."))

    tool_once_per_turn: bool = Field(default=False, description=(
        "With tools: a tool already called since the last user message is not offered again "
        "(it stays described); once every tool has been called, the model answers."))

    _server: Any = PrivateAttr(default=None)
    _last_result: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "span_workflows_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._context_window(), num_output=self.max_tokens,
            is_chat_model=True, is_function_calling_model=True, model_name=self.model_name,
        )

    def _context_window(self) -> int:
        if self.context_window is not None:
            return self.context_window
        if self.backend is None and self.server_url:
            return 8192
        backend = self.query_backend()
        limit = getattr(backend, "max_model_len", None)
        if limit is None:
            return 8192
        return int(limit) - int(getattr(backend, "block_size", 0))

    # -- queries --------------------------------------------------------------------------------
    def to_query(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generate:
        """The span query these messages become (fragments lifted into plus spans; the
        results of one turn's tool calls commuting). ``kwargs``: see the class docstring."""
        kwargs = dict(kwargs)
        max_tokens = int(kwargs.pop("max_tokens", self.max_tokens))
        temperature = float(kwargs.pop("temperature", self.temperature))
        try:
            sampling = Sampling.from_options({k: v for k, v in kwargs.items() if v is not None})
        except ValueError as exc:
            raise ValueError(f"SpanLLM: {exc}") from None
        names = {c.get("id"): c.get("name") for m in messages
                 for c in m.additional_kwargs.get("tool_calls", [])}
        pairs = [_pair(m, names, sampling.uses_tools) for m in messages]
        if self.system_prompt and not any(role == "system" for role, _ in pairs):
            pairs.insert(0, ("system", self.system_prompt))
        if self.tool_once_per_turn and sampling.uses_tools:
            called: set[str] = set()
            for m in reversed(messages):
                if m.role == MessageRole.USER:
                    break
                called.update(c["name"] for c in m.additional_kwargs.get("tool_calls") or [])
            sampling = dataclasses.replace(
                sampling, used_tools=tuple(t.name for t in sampling.tools if t.name in called))
        return lift_messages(pairs, max_tokens=max_tokens, temperature=temperature,
                             sampling=sampling)

    # -- tools ----------------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments of a call with ``tools`` (LlamaIndex tools)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg if isinstance(user_msg, ChatMessage)
                            else ChatMessage(role=MessageRole.USER, content=user_msg))
        specs = [t.metadata.to_openai_tool() for t in tools]
        choice = "required" if tool_required else (tool_choice or "auto")
        return {"messages": messages, "tools": specs or None,
                "tool_choice": choice if specs else None, **kwargs}

    def _validate_chat_with_tools_response(
        self, response: ChatResponse, tools: Sequence[Any],
        allow_parallel_tool_calls: bool = False, **kwargs: Any,
    ) -> ChatResponse:
        """Without parallel calls, only the first call of the answer is kept."""
        calls = response.message.additional_kwargs.get("tool_calls")
        if not allow_parallel_tool_calls and calls and len(calls) > 1:
            response.message.additional_kwargs["tool_calls"] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any,
    ) -> list[ToolSelection]:
        """The tool calls of a ``chat`` answer; none raises ``ValueError`` if asked."""
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError("the answer calls no tool")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"])
                for c in calls]

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
        query = self.to_query(messages, **kwargs)
        if query.sampling.uses_tools:  # a call is only known whole: one response
            return iter([_chat(self.execute(query), whole=True)])
        return self._responses(query, _chat_delta)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        query = self.to_query(messages, **kwargs)
        if query.sampling.uses_tools:
            response = _chat(await self.aexecute(query), whole=True)

            async def one() -> ChatResponseAsyncGen:
                yield response

            return one()
        return self._aresponses(query, _chat_delta)


def _usage(result: Result | None) -> dict[str, Any]:
    """The usage a response carries: OpenAI-style counts, the time to first token and the
    engine steps the answer waited for."""
    if result is None:
        return {}
    return {**result.metrics.usage(), "ttft_s": result.metrics.ttft_s,
            "engine_steps": result.metrics.engine_steps}


def _completion(result: Result) -> CompletionResponse:
    return CompletionResponse(text=result.text, additional_kwargs=_usage(result),
                              raw={"usage": _usage(result)})


def _completion_delta(text: str, chunk: Chunk) -> CompletionResponse:
    """A streamed completion: the text so far and its delta; the last carries the usage."""
    usage = _usage(chunk.result)
    return CompletionResponse(text=text, delta=chunk.delta, additional_kwargs=usage,
                              raw={"usage": usage} if usage else None)


def _pair(message: ChatMessage, names: dict[Any, Any], tools_bound: bool) -> tuple[str, str]:
    """``(role, text)`` of a history message, tool calls and results rendered as the model
    generates and reads them."""
    text = message.content or ""
    if message.role == MessageRole.TOOL:
        call_id = message.additional_kwargs.get("tool_call_id")
        name = names.get(call_id) or message.additional_kwargs.get("name") or "tool"
        return "tool", render_tool_result(name, text)
    if message.role == MessageRole.ASSISTANT:
        calls = message.additional_kwargs.get("tool_calls")
        if calls:
            return "assistant", render_calls([(c["name"], c["arguments"]) for c in calls])
        return "assistant", render_content(text) if tools_bound else text
    return role_name(message.role.value), text


def _chat(result: Result, whole: bool = False) -> ChatResponse:
    """The chat answer of ``result`` (its tool calls in ``additional_kwargs``); ``whole``:
    also its delta, as the one response of a stream."""
    extra: dict[str, Any] = {"finish_reason": result.finish_reason}
    if result.tool_calls:
        extra["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                               for c in result.tool_calls]
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text,
                            additional_kwargs=extra),
        delta=result.text if whole else None,
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
