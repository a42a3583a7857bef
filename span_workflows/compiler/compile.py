"""Compile an optimized G into its block-aligned token form.

Layout of a span-mode prompt (``|`` = a KV block boundary, ``.`` = padding)::

    [ordered prefix ....] | [span 1 ........] | [span 2 ...] | [ordered tail + generation prompt]

* the ordered prefix starts at position 0 and chains like any vLLM prompt;
* every plus span starts a KV block and is padded to a block boundary (where the padding goes,
  and whether a marker token opens the span, are
  :class:`~span_workflows.query.span_options.SpanOptions`);
* span boundaries travel next to the tokens as *segments* (``TokenizedQuery.segments``:
  ``(offset, kind)`` with kind ``anchored``, ``isolated`` or ``ordered``), which the patched vLLM
  hashes by: an ``anchored`` span's blocks chain over the ordered context before its plus (it
  was computed attending to that context and to itself), an ``isolated`` span's blocks start a
  chain of their own (computed alone from position 0), and an ``ordered`` run chains over
  everything before it.

Every span is computed in its own context first by *prepare* requests (``max_tokens=1``): for
``attend="prefix"`` the prefix followed by the span, for ``attend="self"`` the span alone. The
main request then finds each span in the cache and the engine moves its keys to where it sits.
Where the main request would compute a span in exactly its own context — the only span of the
last plus in ``prefix`` mode, with nothing but ordered text after it
(``TokenizedQuery.main_computes_from``) — it is not prepared: the main request computes it and
its blocks are cached from there.

Link blocks (``SpanOptions.link_blocks``) are computed by *link* requests, one per linked span
(the prompt up to the end of its link blocks), all of one plus independent of each other: each
reads the plus's context and the earlier spans of the plus as cached, so they run in one step.

A G nested under a plus (``inline_prompt``) contributes its own prompt followed by its output, as
an isolated span. vLLM caches whole blocks only, so how the output's partial last block is read
is the reading G's ``align`` (:mod:`span_workflows.query.span_options`): ``"crop"`` drops it; every
other
alignment keeps every token and pads the span to a block boundary with the pad token (a prepare
computes that block, unless the draft's own request filled it with the same pad tokens, when the
probe finds it cached). A prompt without plus spans has no segments and no padding: it is
exactly the stock chat prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from span_vllm.contract import ANCHORED, ISOLATED, ORDERED, Segments
from span_workflows.compiler.render import ChatRenderer
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import (
    MESSAGE_TYPES,
    Assistant,
    Cross,
    Generate,
    Message,
    Node,
    Plus,
    Prepare,
    User,
    child_path,
    role_of,
)
from span_workflows.query.span_options import Align, LayoutTokens, SpanOptions

SpanKind = Literal["prefix", "plus", "cross", "generated"]


@dataclass(frozen=True, slots=True)
class Span:
    """One segment of the token form. ``length`` includes the marker and padding;
    ``pad_at`` is where the padding starts inside the span (``content_tokens`` when it is at
    the end)."""

    offset: int
    length: int
    kind: SpanKind
    content_tokens: int
    label: str = ""
    pad_at: int = -1

    @property
    def pad_tokens(self) -> int:
        """How many padding tokens the span holds."""
        return self.length - self.content_tokens

    @property
    def padding(self) -> range:
        """Absolute positions of the span's padding tokens."""
        at = self.content_tokens if self.pad_at < 0 else self.pad_at
        return range(self.offset + at, self.offset + at + self.pad_tokens)


@dataclass(frozen=True, slots=True)
class SpanPrompt:
    """A token sequence with its span segments: what one engine request is sent."""

    token_ids: tuple[int, ...]
    segments: Segments = ()


@dataclass(frozen=True, slots=True)
class NestedOutput:
    """What a nested G produced: its prompt tokens and output tokens (and text)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str


@dataclass
class TokenizedQuery:
    """The token form of one G: what the engine is sent.

    ``prepare_stages`` lists the prompts to compute (max_tokens=1) before ``token_ids`` so that
    every plus span's KV is computed in the context its segment kind promises; a stage may only
    start once the stages before it are cached (a later plus group's context holds the earlier
    groups).
    """

    token_ids: list[int]
    spans: list[Span]
    block_size: int
    max_tokens: int
    temperature: float
    n: int = 1
    prepare_stages: list[list[SpanPrompt]] = field(default_factory=list)
    segments: Segments = ()
    options: SpanOptions = field(default_factory=SpanOptions)
    #: link requests (``SpanOptions.link_blocks``) per stage (aligned with
    #: ``prepare_stages``), to run after that stage's prepares: each computes one span's link
    #: blocks after the context and the earlier spans of its plus as cached; the requests of
    #: a stage are independent (one engine step)
    link_stages: list[list[SpanPrompt]] = field(default_factory=list)
    #: the token offset (a block boundary) from which the main request computes every block
    #: in the context its segment promises: nothing there needs a prepare
    main_computes_from: int = -1

    def __post_init__(self) -> None:
        if self.main_computes_from < 0:
            self.main_computes_from = len(self.token_ids)

    @property
    def prepare(self) -> list[SpanPrompt]:
        """Every prepare prompt, stage after stage."""
        return [p for stage in self.prepare_stages for p in stage]

    @property
    def links(self) -> list[SpanPrompt]:
        """Every link prompt, stage after stage."""
        return [p for stage in self.link_stages for p in stage]

    @property
    def prompt(self) -> SpanPrompt:
        """The main request: tokens and segments."""
        return SpanPrompt(tuple(self.token_ids), self.segments)

    @property
    def num_span_tokens(self) -> int:
        """Tokens that live in plus spans (markers and padding included)."""
        return sum(s.length for s in self.spans if s.kind in ("plus", "generated"))

    @property
    def num_pad_tokens(self) -> int:
        """Padding tokens in the whole prompt."""
        return sum(s.pad_tokens for s in self.spans)

    def summary(self) -> str:
        """A short human-readable table of the spans."""
        lines = [
            f"{len(self.token_ids)} tokens, block size {self.block_size}, "
            f"{len(self.prepare)} prepare requests, max_tokens={self.max_tokens}, "
            f"temperature={self.temperature}, spans attend to {self.options.attend}"
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
            stack.extend((child_path(path, node, i), c) for i, c in enumerate(node.children))
        elif isinstance(node, Cross):
            stack.extend((child_path(path, node, i), c) for i, c in enumerate(node.children))
        elif isinstance(node, Prepare):
            stack.append((child_path(path, node), node.child))
    found.sort(key=lambda item: item[0])
    return found


class Compiler:
    """Compiles optimized trees for one tokenizer, layout tokens and KV block size.

    ``options`` are the default :class:`SpanOptions`; :meth:`compile_generate` takes others
    per query. ``crop`` (``True``/``False``) is the older spelling of ``options.align``
    (``"crop"``/``"recompute"``); ``end_ids`` are the model's end-of-turn tokens (default: the
    tokenizer's EOS), where a draft's text ends.
    """

    def __init__(self, renderer: ChatRenderer, tokens: LayoutTokens, block_size: int,
                 crop: bool | None = None, options: SpanOptions | None = None,
                 end_ids: tuple[int, ...] = ()) -> None:
        self.renderer = renderer
        self.tokens = tokens
        self.block_size = block_size
        self.options = options or SpanOptions()
        if crop is not None:
            self.crop = crop
        eos = getattr(renderer.tokenizer, "eos_token_id", None)
        self.end_ids = tuple(end_ids) or ((eos,) if eos is not None else ())

    @property
    def crop(self) -> bool:
        """Whether nested outputs are cropped by default (``options.align == "crop"``)."""
        return self.options.align == "crop"

    @crop.setter
    def crop(self, value: bool) -> None:
        self.options = replace(self.options, align="crop" if value else "recompute")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, block_size: int, *, crop: bool | None = None,
                      options: SpanOptions | None = None,
                      end_ids: tuple[int, ...] = ()) -> Compiler:
        """A compiler for ``tokenizer`` with its chat template and layout tokens."""
        options = options or SpanOptions()
        return cls(ChatRenderer(tokenizer), LayoutTokens.for_tokenizer(tokenizer,
                                                                        options.pad_text),
                   block_size, crop, options, end_ids)

    def pad_id(self, options: SpanOptions | None = None) -> int:
        """The pad token of ``options`` (one token of ``options.pad_text``)."""
        options = options or self.options
        if options.pad_text == "\n":
            return self.tokens.pad
        return LayoutTokens.for_tokenizer(self.renderer.tokenizer, options.pad_text).pad

    def inner_prompt(self, g: Generate, options: SpanOptions | None = None) -> SpanPrompt:
        """Prompt of a G nested under a plus: an isolated span of its own messages from
        position 0, ending with the generation prompt."""
        options = options or self.options
        messages = _messages_of(g.input, "input")
        chunk = self.renderer.span_chunk(messages, generation_prompt=True)
        tokens = [self.tokens.marker, *chunk] if options.marker else chunk
        return SpanPrompt(tuple(tokens), ((0, ISOLATED),))

    def compile_generate(
        self,
        g: Generate,
        nested: Mapping[str, NestedOutput] | None = None,
        *,
        span_mode: bool = True,
        max_model_len: int | None = None,
        options: SpanOptions | None = None,
    ) -> TokenizedQuery:
        """Token form of ``g`` (optimized), given the outputs of its nested G's by path.

        ``span_mode=False`` gives the stock prompt: the same messages as one ordered chat,
        plus children in the order given, nested outputs as assistant messages.
        """
        nested = nested or {}
        options = options or self.options
        items = _top_items(g.input)
        if span_mode:
            tq = _Builder(self, nested, replace(options, align=alignment(g, options))).build(
                items, g)
        else:
            tokens = self.renderer.conversation(
                _flatten_stock(items, nested), generation_prompt=True
            )
            spans = [Span(0, len(tokens), "prefix", len(tokens), "chat")]
            tq = TokenizedQuery(tokens, spans, self.block_size, g.max_tokens, g.temperature, g.n,
                                options=options)
        if max_model_len is not None:
            check_fits(tq, max_model_len)
        return tq


class _Builder:
    """Accumulates the span-mode token form."""

    def __init__(self, compiler: Compiler, nested: Mapping[str, NestedOutput],
                 options: SpanOptions) -> None:
        self.c = compiler
        self.nested = nested
        self.options = options
        self.pad_id = compiler.pad_id(options)
        self.align: Align = options.align
        self.tokens: list[int] = []
        self.spans: list[Span] = []
        self.segments: list[tuple] = []
        self.links: list[list[tuple[int, int]]] = []  # per stage: (segment index, blocks)
        self.stages: list[list[SpanPrompt]] = []
        #: per stage, whether its plus is one anchored span (computed in its own context
        #: wherever the main request meets it), and where it starts and ends
        self.single: list[tuple[bool, int, int]] = []
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
                base = child_path(path, node) if isinstance(node, Prepare) else path
                self._group(base, plus)
            else:
                run.extend(self._ordered_messages(path, node))
        if not has_plus:
            tokens = self.c.renderer.ordered_chunk((), run, generation_prompt=True)
            self.tokens = tokens
            self.spans = [Span(0, len(tokens), "prefix", len(tokens), "chat")]
        else:
            self._ordered(run, generation_prompt=True)
            first = self.spans[0]
            if first.kind == "prefix":
                prefix = SpanPrompt(tuple(self.tokens[: first.length]))
                self.stages[0].insert(0, prefix)
        segments = tuple(self.segments)
        link_stages = [[self._link_prompt(segments, index, count) for index, count in stage]
                       for stage in self.links]
        computes_from = self._main_computes_from()
        # Nothing the main request computes in its own context is prepared.
        stages = [stage if end <= computes_from else []
                  for stage, (_, _, end) in zip(self.stages, self.single, strict=True)]
        return TokenizedQuery(
            self.tokens, self.spans, self.c.block_size, g.max_tokens, g.temperature, g.n,
            stages, segments, self.options, link_stages, computes_from,
        )

    def _link_prompt(self, segments: Segments, index: int, count: int) -> SpanPrompt:
        """The link request of segment ``index``: the prompt to the end of its link blocks,
        the earlier spans of its plus unlinked (read as cached)."""
        end = segments[index][0] + count * self.c.block_size
        first = index
        while first > 0 and segments[first - 1][1] != ORDERED:
            first -= 1  # the first span of this plus
        own = [s[:2] if first <= j < index else s for j, s in enumerate(segments[: index + 1])]
        return SpanPrompt(tuple(self.tokens[:end]), tuple(own))

    def _main_computes_from(self) -> int:
        """Walking back from the end: ordered runs and pluses of one anchored span are
        computed by the main request in their own context; the first plus that is not stops
        the walk (its spans must come from the cache, and so must everything before them)."""
        for single, _, end in reversed(self.single):
            if not single:
                return end
        return 0

    def _group(self, base: str, plus: Plus) -> None:
        """One plus: its children as spans, all anchored at the context before them."""
        start = len(self.tokens)
        context = SpanPrompt(tuple(self.tokens), tuple(self.segments))
        stage: list[SpanPrompt] = []
        links: list[tuple[int, int]] = []
        kinds: list[str] = []
        for i, child in enumerate(plus.children):
            offset = len(self.tokens)
            kind, seg = self._span(child_path(base, plus, i), child)
            kinds.append(kind)
            # Link blocks: a span that does not already follow its context directly.
            link = 0
            if not isinstance(child, Generate) and (kind == ISOLATED or i > 0):
                link = self.options.links_of(len(seg) // self.c.block_size)
            if link:
                links.append((len(self.segments), link))
                self.segments.append((offset, kind, link))
            else:
                self.segments.append((offset, kind))
            if kind == ANCHORED:
                stage.append(SpanPrompt(context.token_ids + tuple(seg),
                                        (*context.segments, (start, ANCHORED))))
            else:
                stage.append(SpanPrompt(tuple(seg), ((0, ISOLATED),)))
        self.stages.append(stage)
        self.links.append(links)
        self.single.append((kinds == [ANCHORED], start, len(self.tokens)))

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
                msgs.extend(self._ordered_messages(child_path(path, node, i), child))
            return msgs
        raise SpanQueryError(path, f"cannot place {type(node).__name__} in an ordered run")

    def _ordered(self, messages: list[Message], *, generation_prompt: bool) -> None:
        at_start = not self.tokens
        chunk, content_end = self.c.renderer.ordered_chunk_parts(
            self.roles, messages, generation_prompt=generation_prompt
        )
        kind: SpanKind = "prefix" if at_start else "cross"
        if not at_start:
            self.segments.append((len(self.tokens), ORDERED))
        opener = [self.c.tokens.marker] if self.options.marker and not at_start else []
        if generation_prompt:
            seg, pad_at = [*opener, *chunk], -1
        else:
            # An ordered run before spans ends on a block boundary; its padding never goes
            # before it (that would put padding first in the prompt).
            where = "inside" if self.options.pad != "after" else "after"
            seg, pad_at = self._pad(opener, chunk, content_end, where)
        content = len(opener) + len(chunk)
        self._emit(seg, kind, content, ",".join(role_of(m) for m in messages), pad_at)
        self.roles += tuple(role_of(m) for m in messages)

    def _span(self, path: str, node: Node) -> tuple[str, list[int]]:
        if isinstance(node, Generate):
            out = self.nested.get(path)
            if out is None:
                raise SpanQueryError(path, "nested generation has no output yet")
            seg = [*out.prompt_ids, *out.output_ids]
            content = len(seg)
            computed = len(seg) - 1  # the last sampled token never had its KV computed
            keep = (computed // self.c.block_size) * self.c.block_size
            if self.align == "crop" and keep >= len(out.prompt_ids):
                seg = seg[:keep]
            else:
                seg, _ = self._pad([], seg, len(seg), "after")
            self._emit(seg, "generated", min(content, len(seg)), f"G@{path}", -1)
            kind = ISOLATED
        else:
            messages = _messages_of(node, path)
            chunk, content_end = self.c.renderer.span_chunk_parts(messages)
            opener = [self.c.tokens.marker] if self.options.marker else []
            seg, pad_at = self._pad(opener, chunk, content_end, self.options.pad)
            self._emit(seg, "plus", len(opener) + len(chunk),
                       ",".join(role_of(m) for m in messages), pad_at)
            kind = ANCHORED if self.options.attend == "prefix" else ISOLATED
        self.roles += ("user",)
        return kind, seg

    def _pad(self, opener: list[int], chunk: list[int], content_end: int,
             where: str) -> tuple[list[int], int]:
        """``opener + chunk`` padded to whole blocks; the padding goes after the chunk, inside
        it (after its content, before the template's end-of-message tokens) or before it."""
        rest = (-(len(opener) + len(chunk))) % self.c.block_size
        pad = [self.pad_id] * rest
        if where == "before":
            return [*opener, *pad, *chunk], len(opener)
        if where == "inside":
            cut = content_end
            return [*opener, *chunk[:cut], *pad, *chunk[cut:]], len(opener) + cut
        return [*opener, *chunk, *pad], len(opener) + len(chunk)

    def _emit(self, seg: list[int], kind: SpanKind, content: int, label: str,
              pad_at: int) -> None:
        self.spans.append(Span(len(self.tokens), len(seg), kind, content, label, pad_at))
        self.tokens.extend(seg)


def alignment(g: Generate, options: SpanOptions) -> Align:
    """How ``g`` reads the G's nested under its plus: its own ``align``, else the query's."""
    return g.align or options.align  # type: ignore[return-value]


def _top_items(node: Node) -> list[tuple[str, Node]]:
    if isinstance(node, Cross):
        return [(child_path("input", node, i), c) for i, c in enumerate(node.children)]
    return [("input", node)]


def _messages_of(node: Node, path: str) -> list[Message]:
    if isinstance(node, MESSAGE_TYPES):
        return [node]  # type: ignore[list-item]
    if isinstance(node, Cross):
        msgs: list[Message] = []
        for i, child in enumerate(node.children):
            msgs.extend(_messages_of(child, child_path(path, node, i)))
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
            stack.extend(
                (child_path(path, node, i), c)
                for i, c in reversed(list(enumerate(node.children)))
            )
        elif isinstance(node, Prepare):
            stack.append((child_path(path, node), node.child))
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


def check_fits(tq: TokenizedQuery, max_model_len: int) -> None:
    """Raise :class:`SpanQueryError` if ``tq`` and its generation budget exceed the context."""
    budget = max(tq.max_tokens, 1)
    if len(tq.token_ids) + budget > max_model_len:
        raise SpanQueryError(
            "input",
            f"query is {len(tq.token_ids)} tokens (+{budget} to generate), longer than the "
            f"model's context of {max_model_len} tokens",
        )
