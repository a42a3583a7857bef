"""Compile an optimized G into its block-aligned token form.

Layout of a span-mode prompt (``|`` = a KV block boundary, ``+``/``x`` = marker tokens)::

    [ordered prefix ......pad] | [+ span 1 ....pad] | [+ span 2 .pad] | [x ordered tail + gen]

* the ordered prefix starts at position 0 and chains like any vLLM prompt;
* every plus span starts a KV block with the plus marker and is padded to a block boundary, so
  its blocks hash on their own tokens only and can be reused at any position;
* an ordered run after spans starts a block with the cross marker: its hash covers everything
  before it.

A G nested under a plus (``inline_prompt``) contributes its own prompt followed by its output; a
partial trailing block of that output is cropped (``crop=True``) because vLLM caches whole blocks
only. A prompt without plus spans has no markers at all: it is exactly the stock chat prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from span_workflows.errors import SpanQueryError
from span_workflows.ir import (
    MESSAGE_TYPES,
    Assistant,
    Cross,
    Generate,
    Message,
    Node,
    Plus,
    Prepare,
    User,
)
from span_workflows.markers import Markers
from span_workflows.render import ChatRenderer, role_of

SpanKind = Literal["prefix", "plus", "cross", "generated"]


@dataclass(frozen=True, slots=True)
class Span:
    """One segment of the token form. ``length`` includes the marker and padding."""

    offset: int
    length: int
    kind: SpanKind
    content_tokens: int
    label: str = ""


@dataclass(frozen=True, slots=True)
class NestedOutput:
    """What a nested G produced: its prompt tokens and output tokens (and text)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str


@dataclass
class TokenizedQuery:
    """The token form of one G: what the engine is sent.

    ``prepare`` lists token sequences to compute alone (max_tokens=1) before ``token_ids`` so
    that every plus span's KV is computed in isolation; each is whole KV blocks long.
    """

    token_ids: list[int]
    spans: list[Span]
    block_size: int
    max_tokens: int
    temperature: float
    n: int = 1
    prepare: list[list[int]] = field(default_factory=list)

    @property
    def num_span_tokens(self) -> int:
        """Tokens that live in plus spans (markers and padding included)."""
        return sum(s.length for s in self.spans if s.kind in ("plus", "generated"))

    def summary(self) -> str:
        """A short human-readable table of the spans."""
        lines = [
            f"{len(self.token_ids)} tokens, block size {self.block_size}, "
            f"{len(self.prepare)} prepare requests, max_tokens={self.max_tokens}, "
            f"temperature={self.temperature}"
        ]
        for s in self.spans:
            lines.append(
                f"  {s.kind:<9} offset {s.offset:>6} length {s.length:>5} "
                f"(content {s.content_tokens:>5}) {s.label}"
            )
        return "\n".join(lines)


def nested_generations(g: Generate) -> list[tuple[str, Generate]]:
    """The G nodes directly inside ``g``'s input (not inside deeper G's), with their paths.

    Paths use the same convention as errors (``input.cross[1].plus[0]``) and key the outputs
    passed to :func:`compile_generate`.
    """
    found: list[tuple[str, Generate]] = []
    stack: list[tuple[str, Node]] = [("input", g.input)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, Generate):
            found.append((path, node))
        elif isinstance(node, Plus):
            stack.extend((f"{path}.plus[{i}]", c) for i, c in enumerate(node.children))
        elif isinstance(node, Cross):
            stack.extend((f"{path}.cross[{i}]", c) for i, c in enumerate(node.children))
        elif isinstance(node, Prepare):
            stack.append((f"{path}.prepare", node.child))
    found.sort(key=lambda item: item[0])
    return found


@dataclass
class Compiler:
    """Compiles optimized trees for one tokenizer, marker set and KV block size."""

    renderer: ChatRenderer
    markers: Markers
    block_size: int
    crop: bool = True

    def inner_prompt(self, g: Generate) -> list[int]:
        """Prompt of a G nested under a plus: a plus span of its own messages, opened by the
        plus marker at position 0, ending with the generation prompt."""
        messages = _messages_of(g.input, "input")
        return [self.markers.plus, *self.renderer.span_chunk(messages, generation_prompt=True)]

    def compile_generate(
        self,
        g: Generate,
        nested: Mapping[str, NestedOutput] | None = None,
        *,
        span_mode: bool = True,
        max_model_len: int | None = None,
    ) -> TokenizedQuery:
        """Token form of ``g`` (optimized), given the outputs of its nested G's by path.

        ``span_mode=False`` gives the stock prompt: the same messages as one ordered chat,
        plus children in the order given, nested outputs as assistant messages.
        """
        nested = nested or {}
        items = _top_items(g.input)
        builder = _Builder(self, nested) if span_mode else None
        if builder is None:
            tokens = self.renderer.conversation(
                _flatten_stock(items, nested), generation_prompt=True
            )
            spans = [Span(0, len(tokens), "prefix", len(tokens), "chat")]
            tq = TokenizedQuery(tokens, spans, self.block_size, g.max_tokens, g.temperature, g.n)
        else:
            tq = builder.build(items, g)
        if max_model_len is not None:
            _check_length(tq, max_model_len)
        return tq


class _Builder:
    """Accumulates the span-mode token form."""

    def __init__(self, compiler: Compiler, nested: Mapping[str, NestedOutput]) -> None:
        self.c = compiler
        self.nested = nested
        self.tokens: list[int] = []
        self.spans: list[Span] = []
        self.prepare: list[list[int]] = []
        self.roles: tuple[str, ...] = ()

    def build(self, items: list[tuple[str, Node]], g: Generate) -> TokenizedQuery:
        run: list[Message] = []
        has_plus = any(isinstance(n, (Plus, Prepare)) for _, n in items)
        for path, node in items:
            if isinstance(node, (Plus, Prepare)):
                if run:
                    self._ordered(run, generation_prompt=False)
                    run = []
                plus = node.child if isinstance(node, Prepare) else node
                base = f"{path}.prepare" if isinstance(node, Prepare) else path
                for i, child in enumerate(plus.children):
                    self._span(f"{base}.plus[{i}]", child)
            else:
                run.extend(self._ordered_messages(path, node))
        if not has_plus:
            tokens = self.c.renderer.ordered_chunk((), run, generation_prompt=True)
            self.tokens = tokens
            self.spans = [Span(0, len(tokens), "prefix", len(tokens), "chat")]
        else:
            self._ordered(run, generation_prompt=True)
            if self.spans and self.spans[0].kind == "prefix":
                first = self.spans[0]
                self.prepare.insert(0, self.tokens[: first.length])
        return TokenizedQuery(
            self.tokens, self.spans, self.c.block_size, g.max_tokens, g.temperature, g.n,
            self.prepare,
        )

    def _ordered_messages(self, path: str, node: Node) -> list[Message]:
        if isinstance(node, MESSAGE_TYPES):
            return [node]  # type: ignore[list-item]
        if isinstance(node, Generate):
            out = self.nested.get(path)
            if out is None:
                raise SpanQueryError(path, "nested generation has no output yet")
            return [Assistant(out.text)]
        if isinstance(node, Cross):
            msgs: list[Message] = []
            for i, child in enumerate(node.children):
                msgs.extend(self._ordered_messages(f"{path}.cross[{i}]", child))
            return msgs
        raise SpanQueryError(path, f"cannot place {type(node).__name__} in an ordered run")

    def _ordered(self, messages: list[Message], *, generation_prompt: bool) -> None:
        at_start = not self.tokens
        chunk = self.c.renderer.ordered_chunk(
            self.roles, messages, generation_prompt=generation_prompt
        )
        if at_start:
            seg = chunk
            kind: SpanKind = "prefix"
        else:
            seg = [self.c.markers.cross, *chunk]
            kind = "cross"
        content = len(seg)
        if not generation_prompt:
            seg = self._pad(seg)
        self._emit(seg, kind, content, ",".join(role_of(m) for m in messages))
        self.roles += tuple(role_of(m) for m in messages)

    def _span(self, path: str, node: Node) -> None:
        if isinstance(node, Generate):
            out = self.nested.get(path)
            if out is None:
                raise SpanQueryError(path, "nested generation has no output yet")
            seg = [*out.prompt_ids, *out.output_ids]
            content = len(seg)
            computed = len(seg) - 1  # the last sampled token never had its KV computed
            keep = (computed // self.c.block_size) * self.c.block_size
            if self.c.crop and keep >= len(out.prompt_ids):
                seg = seg[:keep]
            else:
                seg = self._pad(seg)
            # Whole blocks of it were cached by the inner generation; a padded last block is
            # not, so it is prepared alone like any span (the probe skips what is cached).
            self.prepare.append(seg)
            self._emit(seg, "generated", min(content, len(seg)), f"G@{path}")
        else:
            messages = _messages_of(node, path)
            seg = [self.c.markers.plus, *self.c.renderer.span_chunk(messages)]
            content = len(seg)
            seg = self._pad(seg)
            self.prepare.append(seg)
            self._emit(seg, "plus", content, ",".join(role_of(m) for m in messages))
        self.roles += ("user",)

    def _pad(self, seg: list[int]) -> list[int]:
        rest = (-len(seg)) % self.c.block_size
        return seg + [self.c.markers.pad] * rest

    def _emit(self, seg: list[int], kind: SpanKind, content: int, label: str) -> None:
        self.spans.append(Span(len(self.tokens), len(seg), kind, content, label))
        self.tokens.extend(seg)


def _top_items(node: Node) -> list[tuple[str, Node]]:
    if isinstance(node, Cross):
        return [(f"input.cross[{i}]", c) for i, c in enumerate(node.children)]
    return [("input", node)]


def _messages_of(node: Node, path: str) -> list[Message]:
    if isinstance(node, MESSAGE_TYPES):
        return [node]  # type: ignore[list-item]
    if isinstance(node, Cross):
        msgs: list[Message] = []
        for i, child in enumerate(node.children):
            msgs.extend(_messages_of(child, f"{path}.cross[{i}]"))
        return msgs
    raise SpanQueryError(path, f"a span must be made of messages, not {type(node).__name__}")


def _flatten_stock(
    items: list[tuple[str, Node]], nested: Mapping[str, NestedOutput]
) -> list[Message]:
    out: list[Message] = []
    stack: list[tuple[str, Node]] = list(reversed(items))
    while stack:
        path, node = stack.pop()
        if isinstance(node, MESSAGE_TYPES):
            out.append(node)  # type: ignore[arg-type]
        elif isinstance(node, Generate):
            result = nested.get(path)
            if result is None:
                raise SpanQueryError(path, "nested generation has no output yet")
            out.extend(_messages_of_inline(node) + [Assistant(result.text)])
        elif isinstance(node, (Plus, Cross)):
            key = "plus" if isinstance(node, Plus) else "cross"
            stack.extend(
                (f"{path}.{key}[{i}]", c) for i, c in reversed(list(enumerate(node.children)))
            )
        elif isinstance(node, Prepare):
            stack.append((f"{path}.prepare", node.child))
        else:
            raise SpanQueryError(path, f"cannot place {type(node).__name__} in a chat")
    return out


def _messages_of_inline(g: Generate) -> list[Message]:
    if not g.inline_prompt:
        return []
    try:
        return _messages_of(g.input, "input")
    except SpanQueryError:
        return [User(str(g.input))]


def _check_length(tq: TokenizedQuery, max_model_len: int) -> None:
    budget = tq.max_tokens if tq.max_tokens else 1
    if len(tq.token_ids) + budget > max_model_len:
        raise SpanQueryError(
            "input",
            f"query is {len(tq.token_ids)} tokens (+{budget} to generate), longer than the "
            f"model's context of {max_model_len} tokens",
        )
