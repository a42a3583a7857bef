"""Short builder functions for span queries, plus the paper's canonical query shapes.

Every builder converts convenient Python values (a ``str`` is a user message, a list is an
ordered join) into IR nodes, checks its arguments eagerly and returns a validated node; a bad
argument raises :class:`~span_workflows.errors.SpanQueryError` whose path is the argument's name
(or the node's path, for a bad numeric parameter).

>>> g(cross(system("Be brief."), plus(fragment("doc A"), fragment("doc B")), "Which is older?"),
...   max_tokens=64)
G(x(S('Be brief.'), +(F('doc A'), F('doc B')), U('Which is older?')), max_tokens=64)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    NODE_TYPES,
    ROLE_MESSAGES,
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Node,
    Plus,
    Repeat,
    Retrieve,
    System,
    User,
)
from span_workflows.query.sampling import Sampling
from span_workflows.query.validate import validate

#: What builders accept where a node is expected: a node, or a str meaning a user message.
NodeLike = Node | str


def system(text: str) -> System:
    """A system message."""
    return System(_text(text, "text"))


def user(text: str) -> User:
    """A user message."""
    return User(_text(text, "text"))


def assistant(text: str) -> Assistant:
    """An assistant message."""
    return Assistant(_text(text, "text"))


def fragment(text: str, source: str = "") -> Fragment:
    """A corpus fragment (a retrieved document); ``source`` is metadata, not prompt text."""
    return Fragment(_text(text, "text"), _text(source, "source"))


def g(
    input: NodeLike | Sequence[NodeLike],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    n: int = 1,
    model: str | None = None,
    align: str | None = None,
    **sampling: Any,
) -> Generate:
    """A generation over ``input``: a node, a str (a user message) or a list/tuple (a cross).

    ``max_tokens`` 0 means up to the model's limit; ``n`` is the number of samples. ``align``
    is how this G reads the G's nested under a plus in its input (``"recompute"``, ``"pad"``,
    ``"bias"``, ``"crop"``; default: the query's). Other keywords are sampling options
    (:meth:`span_workflows.query.sampling.Sampling.from_options`: ``top_p``, ``stop``,
    ``json_schema``, ``tools``, ...); an unknown one raises ``ValueError``.
    """
    if isinstance(input, (list, tuple)):
        node: Node = Cross(_nodes(input, "input"))
    else:
        node = _node(input, "input")
    return _checked(
        Generate(node, max_tokens, _temperature(temperature), n, model,
                 sampling=Sampling.from_options(sampling), align=align)
    )


def plus(*children: NodeLike | Sequence[NodeLike]) -> Plus:
    """A commutative join of ``children`` (nodes, or strs meaning user messages).

    ``plus(a, b)`` and ``plus([a, b])`` are the same.
    """
    return _checked(Plus(_nodes(_spread(children), "children")))


def cross(*children: NodeLike | Sequence[NodeLike]) -> Cross:
    """An ordered join of ``children`` (nodes, or strs meaning user messages).

    ``cross(a, b)`` and ``cross([a, b])`` are the same.
    """
    return _checked(Cross(_nodes(_spread(children), "children")))


def chat(
    *messages: NodeLike | Sequence[NodeLike],
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    model: str | None = None,
) -> Chat:
    """A chat: one generation over the ordered ``messages`` (nodes, or strs = user messages)."""
    msgs = _nodes(_spread(messages), "messages")
    return _checked(Chat(msgs, max_tokens, _temperature(temperature), model))


def retrieve(query: str, docs: Iterable[str | Fragment]) -> Retrieve:
    """The fragments a retriever returned for ``query`` (strs become fragments)."""
    return _checked(Retrieve(_text(query, "query"), _fragments(docs, "docs")))


def repeat(n: int, g: Generate) -> Repeat:
    """``n`` independent samples of the generation ``g``, joined with plus."""
    if not isinstance(g, Generate):
        raise SpanQueryError("g", f"repeat() needs a g node, got {type(g).__name__}")
    return _checked(Repeat(n, g))


def rag(
    system: str | System,
    docs: Iterable[str | Fragment],
    question: str | User,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    model: str | None = None,
) -> Generate:
    """Retrieval-augmented generation: ``G(x(S, +(F...), U))``.

    The documents are joined with plus, so each one's KV cache is reusable wherever it appears.
    """
    sys_node = system if isinstance(system, System) else System(_text(system, "system"))
    question_node = question if isinstance(question, User) else User(_text(question, "question"))
    docs_node = Plus(_fragments(docs, "docs"))
    return _checked(
        Generate(
            Cross((sys_node, docs_node, question_node)),
            max_tokens, _temperature(temperature), model=model,
        )
    )


def judge_generator(
    n: int,
    generator_prompt: str,
    judge_prompt: str,
    *,
    system: str | None = None,
    max_tokens: int = 64,
    judge_max_tokens: int = 64,
    temperature: float = 0.5,
    judge_temperature: float = 0.0,
    model: str | None = None,
    align: str | None = None,
) -> Generate:
    """The judge/generator pattern: ``G(x([S], repeat(n, G(U(generator_prompt))), U(judge)))``.

    ``n`` drafts are sampled from the generator prompt, then one judging generation reads them
    all (their order carries no meaning) followed by the judge prompt; ``align`` is how the
    judge reads them (default: the query's ``SpanOptions.align``).
    """
    generator = Generate(
        User(_text(generator_prompt, "generator_prompt")),
        max_tokens, _temperature(temperature), model=model,
    )
    parts: list[Node] = []
    if system is not None:
        parts.append(System(_text(system, "system")))
    parts.append(Repeat(n, generator))
    parts.append(User(_text(judge_prompt, "judge_prompt")))
    return _checked(
        Generate(
            Cross(tuple(parts)), judge_max_tokens, _temperature(judge_temperature), model=model,
            align=align,
        )
    )


def agent_step(
    history: Iterable[Node | tuple[str, str]],
    observations: Iterable[str | Node],
    *,
    system: str | None = None,
    instruction: str | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    model: str | None = None,
) -> Generate:
    """One agent turn: ``G(x([S], *history, +(observations), [U(instruction)]))``.

    ``history`` holds nodes or ``(role, text)`` pairs with role ``system``, ``user`` or
    ``assistant``; ``observations`` holds strs (fragments) or nodes, e.g. tool outputs whose
    order does not matter. With no observations the plus is left out.
    """
    parts: list[Node] = []
    if system is not None:
        parts.append(System(_text(system, "system")))
    for i, item in enumerate(_listed(history, "history")):
        where = f"history[{i}]"
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            role, text = item
            if role not in ROLE_MESSAGES:
                raise SpanQueryError(
                    where, f"unknown role {role!r}; expected system, user or assistant"
                )
            parts.append(ROLE_MESSAGES[role](_text(text, where)))
        elif isinstance(item, NODE_TYPES):
            parts.append(item)
        else:
            raise SpanQueryError(
                where, f"expected a node or a (role, text) pair, got {type(item).__name__}"
            )
    observed: list[Node] = []
    for i, item in enumerate(_listed(observations, "observations")):
        if isinstance(item, str):
            observed.append(Fragment(item))
        else:
            observed.append(_node(item, f"observations[{i}]"))
    if observed:
        parts.append(Plus(tuple(observed)))
    if instruction is not None:
        parts.append(User(_text(instruction, "instruction")))
    if not parts:
        raise SpanQueryError("history", "agent_step() needs at least one message")
    return _checked(
        Generate(Cross(tuple(parts)), max_tokens, _temperature(temperature), model=model)
    )


def _checked(node: Node) -> Node:
    validate(node)
    return node


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise SpanQueryError(name, f"must be a str, got {type(value).__name__}")
    return value


def _temperature(value: object) -> object:
    """An int temperature becomes a float, so equal queries have equal content hashes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _node(value: object, name: str) -> Node:
    if isinstance(value, str):
        return User(value)
    if isinstance(value, NODE_TYPES):
        return value  # type: ignore[return-value]
    raise SpanQueryError(name, f"expected a node or a str, got {type(value).__name__}")


def _nodes(values: Iterable[object], name: str) -> tuple[Node, ...]:
    items = _listed(values, name)
    if not items:
        raise SpanQueryError(name, "is empty")
    return tuple(_node(v, f"{name}[{i}]") for i, v in enumerate(items))


def _spread(args: tuple[object, ...]) -> list[object]:
    """A single list/tuple argument stands for its elements."""
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return list(args[0])
    return list(args)


def _listed(values: object, name: str) -> list:
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise SpanQueryError(name, f"expected a list, got {type(values).__name__}")
    return list(values)


def _fragments(docs: object, name: str) -> tuple[Fragment, ...]:
    items = _listed(docs, name)
    if not items:
        raise SpanQueryError(name, "is empty")
    out: list[Fragment] = []
    for i, doc in enumerate(items):
        if isinstance(doc, Fragment):
            out.append(doc)
        elif isinstance(doc, str):
            out.append(Fragment(doc))
        else:
            raise SpanQueryError(
                f"{name}[{i}]", f"expected a str or a fragment, got {type(doc).__name__}"
            )
    return tuple(out)


__all__ = [
    "NodeLike", "agent_step", "assistant", "chat", "cross", "fragment", "g", "judge_generator",
    "plus", "rag", "repeat", "retrieve", "system", "user",
]
