"""How plus spans are laid out in tokens and what they attend to: :class:`SpanOptions`.

A plus span's KV is computed once and reused wherever the span is placed, so it must start a
KV block and fill whole blocks; the compiler pads it. Which *context* that KV was computed in is
a choice with a price in answer quality (``benchmarks/results/quality.md``):

* ``attend="prefix"`` (the default) — each span is computed after the ordered prefix that
  precedes its plus (system prompt, earlier turns), attending to that prefix and to itself,
  never to its sibling spans. Its cache key chains over the prefix, so it is reused in any order
  and by every query with the same prefix;
* ``attend="self"`` — each span is computed alone from position 0 (the paper's isolated spans):
  reused across different prefixes too, but every span then carries attention-sink KV of its
  own, which costs accuracy on small models.

``link_blocks=k`` (default 1) recomputes the first ``k`` KV blocks of every span in the
prompt's context (EPIC's link tokens, at block granularity; ``-1``: every block of a span but
its last): small *link* requests, one per span, compute them after the plus's context and the
earlier spans as cached, in the answer's own engine step (batched before it), so no span's
first tokens carry KV blind to the spans before it; the rest of each span is still its cached
KV. In ``prefix`` mode the first
span of a plus already follows its context and is not linked.

Layout knobs, measured in the quality benchmark: where the padding goes (``pad``: after the
span's message, inside it before the end-of-message tokens, or before the message), which text
pads (``pad_text``, one token), and whether a marker token opens each span (``marker``; the
engine does not need one: span boundaries travel next to the tokens, see
:mod:`span_workflows.runtime.vllm_io`).

The defaults (``prefix``, one link block, padding after) are the most accurate mode measured
that keeps a span hit ≥ 10× faster than stock at 16 documents; ``link_blocks=0`` drops the
link requests (fewer requests, fewer correct answers).

``align`` says how a G reads the nested G's under its plus (drafts a judge reads). Each one's
span is its prompt followed by its output, and its KV is the one computed while it was
generated — but vLLM caches whole blocks only, and the last sampled token never had its KV
computed, so the draft's last block is partial and uncached:

* ``"recompute"`` — the span is padded to a block boundary and a prepare request computes that
  last block (the earlier ones are the draft's own, cached), in the step where the judge's
  other prepares run: nothing is cut, no text changes; costs one block of prefill per draft
  (what ``crop=False`` always did);
* ``"pad"`` — the draft's own request goes on after its text with forced pad tokens up to the
  block boundary (the plugin's logits processor), so its last block is full and cached and the
  judge reads every token from the cache; the draft's text is returned without them; costs 1
  to ``block_size`` more decode steps per draft;
* ``"bias"`` — ``"pad"``, with a logits processor that also nudges the draft to end where its
  block fills (fewer pad steps; the text may change);
* ``"crop"`` — the partial last block is dropped: the judge never sees the last 1 to
  ``block_size`` tokens of each draft (the paper's choice; ``crop=True``).

A G's own ``align`` overrides this one for its drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from span_workflows.errors import SpanQueryError

Attend = Literal["prefix", "self"]
PadPosition = Literal["after", "inside", "before"]

ATTEND_CHOICES: tuple[str, ...] = ("prefix", "self")
PAD_CHOICES: tuple[str, ...] = ("after", "inside", "before")
Align = Literal["recompute", "pad", "bias", "crop"]
ALIGN_CHOICES: tuple[str, ...] = ("recompute", "pad", "bias", "crop")
#: The alignment a query gets when nobody says (chosen by ``bench nested`` and ``bench needle``,
#: see ``benchmarks/results/nested.md`` and ``needle.md``).
DEFAULT_ALIGN: Align = "pad"


def check_align(value: object, where: str) -> None:
    """Raise :class:`SpanQueryError` at ``where`` unless ``value`` is an alignment."""
    if value not in ALIGN_CHOICES:
        raise SpanQueryError(where, f"must be one of {', '.join(ALIGN_CHOICES)}, not {value!r}")


@dataclass(frozen=True, slots=True)
class SpanOptions:
    """What plus spans attend to and how they are padded (see the module docstring)."""

    attend: Attend = "prefix"
    pad: PadPosition = "after"
    pad_text: str = "\n"
    marker: bool = False
    link_blocks: int = 1
    align: Align = DEFAULT_ALIGN

    def __post_init__(self) -> None:
        if self.attend not in ATTEND_CHOICES:
            raise SpanQueryError(
                "span_options.attend", f"must be one of {', '.join(ATTEND_CHOICES)}, not "
                                       f"{self.attend!r}")
        if self.pad not in PAD_CHOICES:
            raise SpanQueryError(
                "span_options.pad", f"must be one of {', '.join(PAD_CHOICES)}, not {self.pad!r}")
        if not isinstance(self.pad_text, str) or not self.pad_text:
            raise SpanQueryError("span_options.pad_text", "must be a non-empty string")
        if not isinstance(self.marker, bool):
            raise SpanQueryError("span_options.marker", "must be true or false")
        if (not isinstance(self.link_blocks, int) or isinstance(self.link_blocks, bool)
                or not -1 <= self.link_blocks <= 64):
            raise SpanQueryError("span_options.link_blocks",
                                 "must be an integer from 0 to 64, or -1 (every block of a "
                                 "span but its last)")
        check_align(self.align, "span_options.align")

    def links_of(self, span_blocks: int) -> int:
        """How many of a linked span's ``span_blocks`` blocks are link blocks."""
        if self.link_blocks < 0:
            return max(span_blocks - 1, 0)
        return min(self.link_blocks, span_blocks)

    @classmethod
    def coerce(cls, value: SpanOptions | str | dict[str, Any] | None,
               default: SpanOptions | None = None) -> SpanOptions:
        """Options from a :class:`SpanOptions`, a preset name (``"prefix"``/``"self"``, the
        value of ``attend``), a dict of fields (JSON), or ``None`` (``default``)."""
        base = default or cls()
        if value is None:
            return base
        if isinstance(value, SpanOptions):
            return value
        if isinstance(value, str):
            return replace(base, attend=value)  # type: ignore[arg-type]
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_FIELDS))
            if unknown:
                raise SpanQueryError("span_options", f"unknown option {unknown[0]!r} (known: "
                                                     f"{', '.join(_FIELDS)})")
            return replace(base, **value)
        raise SpanQueryError("span_options", f"expected an object or a name, not "
                                             f"{type(value).__name__}")

    def as_dict(self) -> dict[str, Any]:
        """The options as JSON."""
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = ("attend", "pad", "pad_text", "marker", "link_blocks", "align")


@dataclass(frozen=True, slots=True)
class LayoutTokens:
    """Token ids a layout uses for one tokenizer: the pad token and the optional marker."""

    pad: int
    marker: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, pad_text: str = "\n") -> LayoutTokens:
        """The pad token (``pad_text`` must be one token) and a marker: the highest-numbered
        added token that is not BOS/EOS/PAD/UNK and that the chat template does not emit."""
        pad = tokenizer.encode(pad_text, add_special_tokens=False)
        if len(pad) != 1:
            raise SpanQueryError("span_options.pad_text",
                                 f"{pad_text!r} is {len(pad)} tokens for this tokenizer, not 1")
        return cls(pad=pad[0], marker=_unused_added_token(tokenizer))


def _unused_added_token(tokenizer: Any) -> int:
    reserved = {
        t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                    tokenizer.unk_token_id) if t is not None
    }
    sample = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
         {"role": "assistant", "content": "a"}],
        tokenize=False, add_generation_prompt=True,
    )
    used = set(tokenizer.encode(sample, add_special_tokens=False))
    candidates = sorted(t for t in tokenizer.added_tokens_decoder
                        if t not in reserved and t not in used)
    if not candidates:
        raise ValueError("the tokenizer has no unused added token to serve as a span marker")
    return candidates[-1]


__all__ = ["ALIGN_CHOICES", "ATTEND_CHOICES", "Align", "Attend", "DEFAULT_ALIGN", "LayoutTokens",
           "PAD_CHOICES", "PadPosition", "SpanOptions", "check_align"]
