"""Render messages to tokens with the model's own chat template, safely.

The tokenizer's Jinja chat template decides the text around each message. Message *content* is
tokenized with ``split_special_tokens=True``, so user text can never produce a special token
(e.g. the literal text ``<|im_start|>`` or a span marker's text stays ordinary characters).

Messages are rendered in chunks: the tokens a message contributes are the difference between
rendering the conversation with and without it, so any prefix-stable template works. A span of
commuting messages is rendered in a fixed neutral context, so its tokens do not depend on where
it is placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from span_workflows.query.ir import Message, role_of

_SENTINEL = "\x1fSPANCONTENT{}\x1f"
_NEUTRAL_SYSTEM = {"role": "system", "content": _SENTINEL.format("ctx")}


@dataclass
class ChatRenderer:
    """Turns messages into token ids with ``tokenizer``'s chat template."""

    tokenizer: Any

    def __post_init__(self) -> None:
        self._encode_text = lru_cache(maxsize=65536)(self._encode_text_uncached)
        self._template = lru_cache(maxsize=4096)(self._template_pieces)

    # -- public ---------------------------------------------------------------------------------
    def conversation(self, messages: list[Message], *, generation_prompt: bool) -> list[int]:
        """Tokens of a whole ordered conversation (the stock, marker-free prompt)."""
        roles = tuple(role_of(m) for m in messages)
        pieces = self._template(("conv", roles, generation_prompt))
        return self._assemble(pieces, [m.text for m in messages])

    def ordered_chunk(
        self, before: tuple[str, ...], messages: list[Message], *, generation_prompt: bool = False
    ) -> list[int]:
        """Tokens that ``messages`` add after messages with roles ``before`` (plus the
        generation prompt if asked). Content of earlier messages does not matter."""
        return self.ordered_chunk_parts(before, messages, generation_prompt=generation_prompt)[0]

    def ordered_chunk_parts(
        self, before: tuple[str, ...], messages: list[Message], *, generation_prompt: bool = False
    ) -> tuple[list[int], int]:
        """:meth:`ordered_chunk` and the index just after the last message's content (where
        the template's end-of-message tokens begin)."""
        roles = tuple(role_of(m) for m in messages)
        pieces = self._template(("chunk", before, roles, generation_prompt))
        return self._assemble_parts(pieces, [m.text for m in messages])

    def span_chunk(self, messages: list[Message], *, generation_prompt: bool = False) -> list[int]:
        """Tokens of a commuting span, rendered in a fixed neutral context (position-free)."""
        return self.span_chunk_parts(messages, generation_prompt=generation_prompt)[0]

    def span_chunk_parts(
        self, messages: list[Message], *, generation_prompt: bool = False
    ) -> tuple[list[int], int]:
        """:meth:`span_chunk` and the index just after its last content."""
        return self.ordered_chunk_parts(("system",), messages, generation_prompt=generation_prompt)

    def generation_prompt(self, before: tuple[str, ...]) -> list[int]:
        """Tokens the template adds to ask the assistant to answer."""
        return self._assemble(self._template(("gen", before)), [])

    def encode_text(self, text: str) -> list[int]:
        """Tokens of plain content text, special-token text kept literal."""
        return list(self._encode_text(text))

    # -- internals ------------------------------------------------------------------------------
    def _assemble(self, pieces: tuple[tuple[str, Any], ...], contents: list[str]) -> list[int]:
        return self._assemble_parts(pieces, contents)[0]

    def _assemble_parts(
        self, pieces: tuple[tuple[str, Any], ...], contents: list[str]
    ) -> tuple[list[int], int]:
        out: list[int] = []
        content_end = 0
        for kind, value in pieces:
            if kind == "tokens":
                out.extend(value)
            else:
                out.extend(self._encode_text(contents[value]))
                content_end = len(out)
        return out, content_end

    def _encode_text_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(
            self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        )

    def _render(self, roles: tuple[str, ...], generation_prompt: bool, offset: int = 0) -> str:
        messages = [
            {"role": role, "content": _SENTINEL.format(offset + i)} for i, role in enumerate(roles)
        ]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _template_pieces(self, key: tuple) -> tuple[tuple[str, Any], ...]:
        """Template text split into literal token runs and content slots, for one role layout."""
        kind = key[0]
        if kind == "conv":
            _, roles, gen = key
            text = self._render(roles, gen) if roles else ""
            return self._split(text, 0)
        if kind == "chunk":
            _, before, roles, gen = key
            ctx = [_NEUTRAL_SYSTEM] if before == ("system",) else None
            prefix = self._render_before(before, ctx)
            full = self._render_before(before, ctx, extra=roles, gen=gen)
            if not full.startswith(prefix):
                raise ValueError("chat template is not prefix-stable; cannot render spans")
            return self._split(full[len(prefix):], len(before))
        _, before = key
        prefix = self._render_before(before, None)
        full = self._render_before(before, None, gen=True)
        return self._split(full[len(prefix):], len(before))

    def _render_before(
        self,
        before: tuple[str, ...],
        ctx: list[dict] | None,
        extra: tuple[str, ...] = (),
        gen: bool = False,
    ) -> str:
        messages = list(ctx) if ctx is not None else [
            {"role": role, "content": _SENTINEL.format(f"b{i}")} for i, role in enumerate(before)
        ]
        n = len(messages)
        messages += [
            {"role": role, "content": _SENTINEL.format(n + i)} for i, role in enumerate(extra)
        ]
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )

    def _split(self, text: str, first_index: int) -> tuple[tuple[str, Any], ...]:
        pieces: list[tuple[str, Any]] = []
        rest = text
        index = first_index
        while True:
            marker = _SENTINEL.format(index)
            at = rest.find(marker)
            if at < 0:
                break
            if at:
                pieces.append(("tokens", self._encode_template(rest[:at])))
            pieces.append(("content", index - first_index))
            rest = rest[at + len(marker):]
            index += 1
        if "\x1fSPANCONTENT" in rest:
            raise ValueError("chat template reorders or drops messages; cannot render spans")
        if rest:
            pieces.append(("tokens", self._encode_template(rest)))
        return tuple(pieces)

    def _encode_template(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))
