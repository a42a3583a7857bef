"""``@commutative``: mark the collections in your code whose order carries no meaning.

Retrieved documents, sampled drafts and tool observations are sets, not lists: the answer
should not depend on their order. Marking them commutative turns them into a
:class:`~span_workflows.query.ir.Plus`, which lets each item's KV cache be computed once and reused
wherever the item appears (the point of span queries).

Two forms:

(a) On a function that *returns* the collection::

        @commutative
        def search(question: str) -> list[str]:
            return index.top_k(question, 5)

        search("who?")        # -> Plus((Fragment(doc1), Fragment(doc2), ...))

    A str item becomes a :class:`~span_workflows.query.ir.Fragment`, a node is kept, a returned
    ``Plus`` is returned as is and a single str or node becomes a plus of one. Returning
    nothing (an empty collection or ``None``) raises
    :class:`~span_workflows.errors.SpanQueryError` naming the function.

(b) Naming *parameters* whose argument is such a collection::

        @commutative("docs")
        def answer(question: str, docs) -> Generate:
            return g([system("Answer from the documents."), docs, question])

        answer("who?", ["doc one", "doc two"])   # docs arrives as a Plus of two fragments

    Each named argument is wrapped the same way before the call (an argument left to its
    default, or passed as ``None``, is untouched). Naming a parameter the function does not
    have raises ``TypeError`` when decorating.

(c) ``check=True`` in either form (``@commutative(check=True)``,
    ``@commutative("docs", check=True)``) lints the *first* call (the static checks of
    :func:`span_workflows.commutativity.lint.lint`, no model): form (a) checks the plus it returns;
    form (b)
    the query the function returns when it returns a node, else the pluses it was given. When a
    check finds an error or a warning (numbered steps, the turns of a conversation, a table
    split across items ...) it warns once, with
    :class:`~span_workflows.commutativity.lint.CommutativityWarning`; later calls are not checked.

Both forms work on ``async def`` functions, keep the wrapped function's metadata
(:func:`functools.wraps`) and set ``wrapper.__span_commutative__ = True`` and
``wrapper.__span_commutative_params__`` (the parameter names; empty for form (a)).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from span_workflows.commutativity.lint import FirstCallCheck, checker_for
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import NODE_TYPES, Fragment, Plus

F = TypeVar("F", bound=Callable[..., Any])


@overload
def commutative(func: F, /, *, check: bool = False) -> F: ...


@overload
def commutative(*params: str, check: bool = False) -> Callable[[F], F]: ...


def commutative(*args: Any, check: bool = False) -> Any:
    """Mark a function's result (``@commutative``) or named parameters
    (``@commutative("docs", ...)``) as commutative collections; ``check=True`` lints the first
    call. See the module docstring."""
    if not isinstance(check, bool):
        raise TypeError(f"@commutative(check=...) takes True or False, got {check!r}")
    if len(args) == 1 and callable(args[0]) and not isinstance(args[0], str):
        return _wrap_result(args[0], check)
    for name in args:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(
                f"@commutative takes a function or parameter names (str), got {name!r}"
            )
    if not args:
        return lambda func: _wrap_result(func, check)
    params = tuple(args)
    return lambda func: _wrap_params(func, params, check)


def as_plus(value: object, what: str) -> Plus:
    """``value`` as a plus: a ``Plus`` as is; a str or node as a plus of one; otherwise each
    item of the collection (a str becomes a fragment). ``what`` names the value in errors."""
    if isinstance(value, Plus):
        return value
    if isinstance(value, (str, *NODE_TYPES)):
        items: list[object] = [value]
    elif value is None:
        items = []
    elif isinstance(value, (bytes, dict)) or not isinstance(value, Iterable):
        raise SpanQueryError(
            "", f"{what} must be a collection of strs or nodes, got {type(value).__name__}"
        )
    else:
        items = list(value)
    if not items:
        raise SpanQueryError("", f"{what} is empty; a commutative collection needs an item")
    children = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            children.append(Fragment(item))
        elif isinstance(item, NODE_TYPES):
            children.append(item)
        else:
            raise SpanQueryError(
                "", f"{what}: item {i} is {type(item).__name__}, expected a str or a node"
            )
    return Plus(tuple(children))


def _mark(wrapper: Callable[..., Any], params: tuple[str, ...]) -> None:
    wrapper.__span_commutative__ = True  # type: ignore[attr-defined]
    wrapper.__span_commutative_params__ = params  # type: ignore[attr-defined]


def _checker(func: Callable[..., Any], check: bool) -> FirstCallCheck | None:
    return checker_for(func) if check else None


def _wrap_result(func: F, check: bool = False) -> F:
    """Form (a): the function's result becomes a plus."""
    if not callable(func):
        raise TypeError(f"@commutative must decorate a function, got {func!r}")
    what = f"the result of {func.__qualname__}()"
    first_call = _checker(func, check)

    def checked(plus: Plus) -> Plus:
        if first_call is not None and not first_call.done:
            first_call([plus], stacklevel=4)
        return plus

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Plus:
            return checked(as_plus(await func(*args, **kwargs), what))

        _mark(async_wrapper, ())
        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Plus:
        return checked(as_plus(func(*args, **kwargs), what))

    _mark(wrapper, ())
    return wrapper  # type: ignore[return-value]


def _wrap_params(func: F, params: tuple[str, ...], check: bool = False) -> F:
    """Form (b): the named arguments become pluses before the call."""
    if not callable(func):
        raise TypeError(f"@commutative(...) must decorate a function, got {func!r}")
    signature = inspect.signature(func)
    for name in params:
        param = signature.parameters.get(name)
        if param is None:
            raise TypeError(f"{func.__qualname__}() has no parameter {name!r}")
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(
                f"@commutative cannot wrap the variadic parameter {name!r} of "
                f"{func.__qualname__}(); take the collection as one argument"
            )

    first_call = _checker(func, check)

    def convert(args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple, dict, list[Plus]]:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs, []  # let the call itself report the bad arguments
        made = []
        for name in params:
            if name in bound.arguments and bound.arguments[name] is not None:
                bound.arguments[name] = as_plus(
                    bound.arguments[name], f"argument {name!r} of {func.__qualname__}()"
                )
                made.append(bound.arguments[name])
        return bound.args, bound.kwargs, made

    def checked(result: Any, made: list[Plus]) -> Any:
        if first_call is not None and not first_call.done:
            # the query the function built, where it returns one; else its collections
            first_call([result] if isinstance(result, NODE_TYPES) else made, stacklevel=4)
        return result

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            args, kwargs, made = convert(args, kwargs)
            return checked(await func(*args, **kwargs), made)

        _mark(async_wrapper, params)
        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args, kwargs, made = convert(args, kwargs)
        return checked(func(*args, **kwargs), made)

    _mark(wrapper, params)
    return wrapper  # type: ignore[return-value]


__all__ = ["as_plus", "commutative"]
