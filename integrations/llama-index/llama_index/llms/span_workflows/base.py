"""``SpanLLM``: a LlamaIndex LLM that runs span queries.

Prompts are lifted like in the LangChain integration (:func:`span_workflows.fragments.
lift_messages`): the registered fragments found in a prompt (the nodes a
:class:`llama_index.retrievers.span_workflows.SpanRetriever` returned, whatever the response
synthesizer's template put around them) become a plus span between the ordered text before and
after them, so the nodes hit the span cache in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
from span_workflows.fragments import QueryRunner, commutative_outputs, lift_messages
from span_workflows.ir import Generate
from span_workflows.model import DEFAULT_MODEL_NAME

_ROLES = {
    MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system",
    MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}


class SpanLLM(CustomLLM, QueryRunner):
    """A LlamaIndex LLM served by span queries: retrieved nodes commute and hit the span cache.

    Runs on the embedded engine (``engine=``, or the process-wide default one, created on first
    use) or on a span server (``server_url=``). ``last_result`` holds the
    :class:`span_workflows.engine.Result` of the latest call.
    """

    model_name: str = Field(default=DEFAULT_MODEL_NAME, description="Name of the model.")
    engine: Any = Field(default=None, exclude=True, description="An embedded Engine.")
    server_url: str | None = Field(default=None, description="URL of a span server.")
    api_key: str | None = Field(default=None, exclude=True, description="Server API key.")
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
        pairs = [(_ROLES.get(m.role, "user"), m.content or "") for m in messages]
        if self.system_prompt and not any(role == "system" for role, _ in pairs):
            pairs.insert(0, ("system", self.system_prompt))
        return lift_messages(
            pairs,
            max_tokens=int(kwargs.get("max_tokens", self.max_tokens)),
            temperature=float(kwargs.get("temperature", self.temperature)),
        )

    def _get_server(self) -> Any:
        if self._server is None:
            from span_workflows.serving.client import SpanServer

            self._server = SpanServer(self.server_url or "", api_key=self.api_key)
        return self._server

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
        query = self._prompt_query(prompt, formatted, **kwargs)

        def gen() -> CompletionResponseGen:
            # The embedded engine returns whole answers: one delta with all the text.
            yield _completion(self.execute(query), stream=True)

        return gen()

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        query = self._prompt_query(prompt, formatted, **kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            yield _completion(await self.aexecute(query), stream=True)

        return gen()

    def _prompt_query(self, prompt: str, formatted: bool, **kwargs: Any) -> Generate:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return self.to_query([ChatMessage(role=MessageRole.USER, content=prompt)], **kwargs)

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

        def gen() -> ChatResponseGen:
            yield _chat(self.execute(query), stream=True)

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        query = self.to_query(messages, **kwargs)

        async def gen() -> ChatResponseAsyncGen:
            yield _chat(await self.aexecute(query), stream=True)

        return gen()


def _usage(result: Any) -> dict[str, Any]:
    m = result.metrics
    return {
        "prompt_tokens": m.prompt_tokens, "completion_tokens": m.generated_tokens,
        "total_tokens": m.prompt_tokens + m.generated_tokens,
        "cached_tokens": m.cached_tokens, "ttft_s": m.ttft_s,
    }


def _completion(result: Any, stream: bool = False) -> CompletionResponse:
    return CompletionResponse(
        text=result.text, delta=result.text if stream else None,
        additional_kwargs=_usage(result), raw={"usage": _usage(result)},
    )


def _chat(result: Any, stream: bool = False) -> ChatResponse:
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
        delta=result.text if stream else None,
        additional_kwargs=_usage(result), raw={"usage": _usage(result)},
    )


#: Wrap a (sync or async) function so the collection it returns is registered as commuting
#: fragments (returns the texts); use it for the search step of a LlamaIndex ``Workflow``.
commutative_step = commutative_outputs

__all__ = ["SpanLLM", "commutative_step"]
