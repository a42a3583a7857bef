"""Span marker tokens: which token ids open a plus span, open a cross tail, and pad.

Markers must be impossible to produce from user text. We pick *added* tokens of the tokenizer
that the chat template does not use (SmolLM2: ``<empty_output>`` and ``<jupyter_script>``) and
encode all content with ``split_special_tokens=True`` (see :mod:`span_workflows.render`), so the
literal marker text in a document stays ordinary characters. Padding needs no such property: it
only fills a block up to the next marker, so it is a newline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

PLUS_ENV = "SPAN_VLLM_PLUS_TOKEN"
CROSS_ENV = "SPAN_VLLM_CROSS_TOKEN"


@dataclass(frozen=True, slots=True)
class Markers:
    """Token ids of the plus marker, the cross marker and the pad token."""

    plus: int
    cross: int
    pad: int

    def export_env(self) -> None:
        """Publish the marker ids to the vLLM plugin (it reads them from the environment)."""
        os.environ[PLUS_ENV] = str(self.plus)
        os.environ[CROSS_ENV] = str(self.cross)


def choose_markers(tokenizer: Any) -> Markers:
    """Pick marker tokens for ``tokenizer``: the two highest-numbered added tokens that are not
    BOS/EOS/PAD/UNK and do not occur in the chat template's own output."""
    reserved = {
        t for t in (
            tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
            tokenizer.unk_token_id,
        ) if t is not None
    }
    sample = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
         {"role": "assistant", "content": "a"}],
        tokenize=False, add_generation_prompt=True,
    )
    used = set(tokenizer.encode(sample, add_special_tokens=False))
    candidates = sorted(
        token_id for token_id in tokenizer.added_tokens_decoder
        if token_id not in reserved and token_id not in used
    )
    if len(candidates) < 2:
        raise ValueError("the tokenizer has no two unused added tokens to serve as span markers")
    pad = tokenizer.encode("\n", add_special_tokens=False)
    if len(pad) != 1:
        raise ValueError("cannot find a single-token newline to pad spans with")
    return Markers(plus=candidates[-1], cross=candidates[-2], pad=pad[0])
