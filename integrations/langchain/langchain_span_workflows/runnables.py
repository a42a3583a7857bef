"""Runnables built on span-query builders, and ``@commutative`` steps for LCEL pipelines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import RunnableLambda

from langchain_span_workflows.chat_models import SpanChatModel, role_of_message
from span_workflows.query.builders import agent_step, judge_generator
from span_workflows.query.ir import Generate
from span_workflows.query.lift import commutative_outputs

DEFAULT_JUDGE_PROMPT = (
    "Above are several candidate answers. Reply with the best one, improved if needed."
)


def judge_generator_chain(
    llm: SpanChatModel,
    n: int = 3,
    generator_prompt: str | BasePromptTemplate = "{input}",
    judge_prompt: str | BasePromptTemplate = DEFAULT_JUDGE_PROMPT,
    *,
    system: str | None = None,
    max_tokens: int | None = None,
    judge_max_tokens: int | None = None,
    temperature: float = 0.5,
) -> RunnableLambda:
    """A Runnable: ``n`` drafts from ``generator_prompt``, then one judge that reads them all
    (commuting, :func:`span_workflows.judge_generator`), run on ``llm``'s engine or server.

    The input is a str (the ``{input}`` variable) or a dict of template variables; both
    prompts are templates (``str.format`` style, or LangChain prompt templates). Returns the
    judge's text.
    """

    def build(value: Any) -> Generate:
        variables = _variables(value)
        return judge_generator(
            n, _format(generator_prompt, variables), _format(judge_prompt, variables),
            system=system,
            max_tokens=max_tokens if max_tokens is not None else llm.max_tokens,
            judge_max_tokens=judge_max_tokens if judge_max_tokens is not None
            else llm.max_tokens,
            temperature=temperature, judge_temperature=llm.temperature,
        )

    return _query_runnable(llm, build, "judge_generator")


def agent_step_runnable(
    llm: SpanChatModel,
    *,
    system: str | None = None,
    instruction: str | None = None,
    max_tokens: int | None = None,
) -> RunnableLambda:
    """A Runnable for one agent turn whose tool observations commute
    (:func:`span_workflows.agent_step`), run on ``llm``'s engine or server.

    Input: ``{"history": [messages or (role, text)], "observations": [str, ...],
    "instruction": optional str}``. Returns the model's text.
    """

    def build(value: Any) -> Generate:
        if not isinstance(value, dict):
            raise TypeError("agent_step_runnable expects a dict with history and observations")
        history = [
            (role_of_message(m), m.text) if isinstance(m, BaseMessage) else m
            for m in value.get("history", [])
        ]
        return agent_step(
            history, list(value.get("observations", [])),
            system=system, instruction=value.get("instruction", instruction),
            max_tokens=max_tokens if max_tokens is not None else llm.max_tokens,
            temperature=llm.temperature,
        )

    return _query_runnable(llm, build, "agent_step")


def commutative_step(func: Callable[..., Any]) -> RunnableLambda:
    """A pipeline step whose output collection commutes.

    ``func`` (sync or async; plain, or already ``@commutative``) returns strs, fragments,
    documents or a plus. Each item is registered as a fragment and the step outputs the
    items' texts (``list[str]``), so a prompt can format them as usual and a
    :class:`SpanChatModel` downstream sends them as one plus span.
    """
    return RunnableLambda(commutative_outputs(func),
                          name=getattr(func, "__name__", "commutative_step"))


def _query_runnable(llm: SpanChatModel, build: Callable[[Any], Generate],
                    name: str) -> RunnableLambda:
    def run(value: Any) -> str:
        return llm.execute(build(value)).text

    async def arun(value: Any) -> str:
        return (await llm.aexecute(build(value))).text

    return RunnableLambda(run, afunc=arun, name=name)


def _variables(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    return {"input": value}


def _format(template: str | BasePromptTemplate, variables: dict[str, Any]) -> str:
    if isinstance(template, BasePromptTemplate):
        return template.format(**{k: v for k, v in variables.items()
                                  if k in template.input_variables})
    return template.format(**variables) if "{" in template else template


__all__ = ["agent_step_runnable", "commutative_step", "judge_generator_chain"]
