"""Tool calling and structured output for ``SpanChatModel``: LangChain's tool schemas and
messages to and from span queries.

* ``bind_tools`` binds OpenAI-style tools (anything ``convert_to_openai_tool`` reads) and a
  ``tool_choice``: ``"auto"``, ``"required"`` (also ``"any"`` or ``True``), ``"none"``, a
  tool's name or ``{"type": "function", "function": {"name": ...}}``;
* ``with_structured_output`` with ``method="function_calling"`` (the default: one forced
  tool call), ``"json_schema"`` (the answer is constrained to the schema) or ``"json_mode"``
  (any JSON object);
* in a history, an ``AIMessage``'s tool calls are rendered in the answer format the model
  generates (:func:`span_workflows.query.sampling.render_calls`), and a ``ToolMessage`` is a user
  turn ``Tool <name> returned:`` followed by its content (SmolLM2's template has no tool
  role); the results of one turn's calls commute (one plus span).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from span_workflows.query.sampling import Sampling, render_calls, render_content, render_tool_result
from span_workflows.runtime.result import Result

#: Model fields that are sampling options (``None``: vLLM's default).
SAMPLING_FIELDS = ("top_p", "top_k", "seed", "logprobs", "presence_penalty",
                   "frequency_penalty")
#: Call options LangChain itself adds (tracing metadata), not sampling options.
_TRACING_OPTIONS = ("ls_structured_output_format",)


class ToolsMixin:
    """``bind_tools`` and ``with_structured_output`` for a chat model whose calls accept
    ``tools``, ``tool_choice`` and ``response_format`` (mixed into ``SpanChatModel``)."""

    if TYPE_CHECKING:  # declared by the chat model
        def bind(self, **kwargs: Any) -> Runnable: ...

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | bool | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """This model with ``tools`` bound; each call answers with tool calls (``"tool_calls"``
        finish reason) or text, as ``tool_choice`` allows."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        return self.bind(tools=formatted, tool_choice=_tool_choice(tool_choice, names),
                         **kwargs)

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """This model answering in ``schema`` (a Pydantic class, a TypedDict or a JSON
        schema): a Pydantic instance or a dict; with ``include_raw``, ``{"raw", "parsed",
        "parsing_error"}``. The answer is always generated under the schema's constraint, so
        ``strict`` is accepted and always holds."""
        if kwargs:
            raise ValueError(f"unsupported argument(s): {', '.join(sorted(kwargs))}")
        if method == "function_calling":
            return super().with_structured_output(  # type: ignore[misc]
                schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be function_calling, json_schema or json_mode, "
                             f"got {method!r}")
        json_schema = (convert_to_json_schema(schema) if method == "json_schema"
                       else {"type": "object"})
        llm = self.bind(response_format=json_schema, ls_structured_output_format={
            "kwargs": {"method": method}, "schema": convert_to_json_schema(schema)})
        parser: Runnable = (
            PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
            if isinstance(schema, type) and is_basemodel_subclass(schema)
            else JsonOutputParser())
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                            parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback],
                                                            exception_key="parsing_error")


def _tool_choice(choice: str | bool | Mapping[str, Any] | None, names: list[str]) -> str:
    """A LangChain ``tool_choice`` as a :class:`Sampling` tool choice."""
    if choice is None or choice == "auto":
        return "auto"
    if choice is True or choice in ("any", "required"):
        return "required"
    if choice is False or choice == "none":
        return "none"
    if isinstance(choice, Mapping):
        choice = (choice.get("function") or {}).get("name") or choice.get("name")
    if isinstance(choice, str) and choice in names:
        return choice
    raise ValueError(f"tool_choice must be auto, required, any, none or one of the bound "
                     f"tools ({', '.join(names)}), got {choice!r}")


def sampling_options(model: Any, call: dict[str, Any], stop: list[str] | None) -> Sampling:
    """The :class:`Sampling` of one call: the model's fields overridden by the call's options
    (``call`` is consumed). An option that is not a sampling option raises ``ValueError``."""
    options: dict[str, Any] = {f: getattr(model, f) for f in SAMPLING_FIELDS
                               if getattr(model, f) is not None}
    for key in _TRACING_OPTIONS:
        call.pop(key, None)
    if "response_format" in call:
        response_format = call.pop("response_format")
        if response_format is not None:
            options["json_schema"] = response_format
    options.update({k: v for k, v in call.items() if v is not None})
    if stop:
        options["stop"] = stop
    if options.get("tools") == []:
        options.pop("tools")
    try:
        return Sampling.from_options(options)
    except ValueError as exc:
        raise ValueError(f"SpanChatModel: {exc}") from None


def ai_message_text(message: AIMessage, tools_bound: bool) -> str:
    """An earlier assistant turn as the model would have generated it: its tool calls in the
    answer format; with tools bound, a plain answer as ``{"content": ...}``."""
    if message.tool_calls:
        return render_calls([(c["name"], c["args"]) for c in message.tool_calls])
    return render_content(message.text) if tools_bound else message.text


def called_this_turn(messages: Sequence[BaseMessage], sampling: Sampling) -> tuple[str, ...]:
    """The bound tools that assistant messages called since the last human message."""
    called: set[str] = set()
    for m in reversed(messages):
        if isinstance(m, HumanMessage):
            break
        if isinstance(m, AIMessage):
            called.update(c["name"] for c in m.tool_calls)
    return tuple(t.name for t in sampling.tools if t.name in called)


def tool_result_text(message: ToolMessage, name: str | None) -> str:
    """A tool's result as the user turn the model reads."""
    return render_tool_result(name or message.name or "tool", message.text,
                              error=message.status == "error")


def tool_calls_of(result: Result) -> list:
    """LangChain tool calls of a result."""
    return [tool_call(name=c.name, args=c.arguments, id=c.id) for c in result.tool_calls]


def tool_call_chunks(result: Result) -> list:
    """LangChain tool-call chunks of a result (streaming)."""
    import json

    return [tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
            for i, c in enumerate(result.tool_calls)]


__all__ = ["SAMPLING_FIELDS", "ToolsMixin", "ai_message_text", "called_this_turn",
           "sampling_options",
           "tool_call_chunks", "tool_calls_of", "tool_result_text"]
