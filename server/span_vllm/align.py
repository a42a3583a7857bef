"""Block alignment of nested outputs: a vLLM v1 logits processor (torch and vLLM only).

vLLM caches whole KV blocks only, and the last sampled token of a request never has its KV
computed. A draft that a judge reads whole therefore ends in a partial, uncached block — unless
the draft's own request goes on after its text: with forced pad tokens up to the block boundary
and one forced stop token, every token of the text and the pads is computed and the last block
is full and cached (:data:`span_vllm.contract.ALIGN_KEY` states the contract).

:class:`BlockAlignLogitsProcessor` does that per request, for the requests that carry the key
(others are untouched, and cost nothing but a dictionary lookup when they join the batch):

* while the text goes on, the stop token is masked (it must not end the text by chance) and,
  with ``bias``, the end tokens' logits are nudged toward ending where the block fills: raised
  by ``boost`` at the last position of a block when their probability is at least ``min_prob``,
  lowered by ``boost`` in the first ``window`` positions of a block;
* once the text has ended (an end token sampled, or ``budget`` tokens written), every row is
  forced: the pad token, or the stop token at the position that starts a new block.

The state of a request is read from its output token list, which vLLM hands over by reference
and keeps current (async scheduling included); a preempted request that comes back is read
again from its whole list.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from span_vllm import contract

_NEG_INF = float("-inf")


class _Aligned:
    """One request under alignment: its spec, its prompt length and its live output list."""

    __slots__ = ("boost", "budget", "end", "ends", "min_prob", "out", "pad", "prompt_len",
                 "seen", "stop", "window")

    def __init__(self, spec: Mapping[str, Any], prompt_len: int, out: list[int]) -> None:
        self.pad = int(spec["pad"])
        self.stop = int(spec["stop"])
        self.ends = frozenset(int(e) for e in spec["ends"])
        self.budget = int(spec["budget"])
        bias = spec.get("bias")
        self.boost = float(bias["boost"]) if bias else 0.0
        self.min_prob = float(bias["min_prob"]) if bias else 0.0
        self.window = int(bias["window"]) if bias else 0
        self.prompt_len = prompt_len
        self.out = out
        self.end: int | None = None  # tokens of text, once it has ended
        self.seen = 0  # output tokens already scanned for an end token

    def text_end(self) -> int | None:
        """How many output tokens the text has, or ``None`` while it goes on."""
        if self.end is not None:
            return self.end
        out, limit = self.out, min(len(self.out), self.budget)
        for i in range(self.seen, limit):
            token = out[i]
            if token < 0:  # an async-scheduling placeholder: not sampled yet
                return None
            if token in self.ends:
                self.end = i + 1
                return self.end
            self.seen = i + 1
        if self.seen >= self.budget:
            self.end = self.budget
        return self.end


def parse_spec(value: object) -> dict[str, Any]:
    """The alignment spec of a request's ``extra_args`` entry, checked; ``ValueError`` names
    what is wrong."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{contract.ALIGN_KEY} must be an object")
    for key in ("pad", "stop", "budget"):
        if not isinstance(value.get(key), int) or isinstance(value.get(key), bool):
            raise ValueError(f"{contract.ALIGN_KEY}.{key} must be an integer")
    if value["budget"] < 0:
        raise ValueError(f"{contract.ALIGN_KEY}.budget must be at least 0")
    ends = value.get("ends")
    if (not isinstance(ends, Sequence) or not ends
            or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends)):
        raise ValueError(f"{contract.ALIGN_KEY}.ends must be a non-empty list of token ids")
    if value["stop"] in ends or value["pad"] == value["stop"]:
        raise ValueError(f"{contract.ALIGN_KEY}.stop must differ from the pad and end tokens")
    bias = value.get("bias")
    if bias is not None:
        if not isinstance(bias, Mapping) or set(bias) != set(contract.BIAS_DEFAULTS):
            raise ValueError(f"{contract.ALIGN_KEY}.bias must hold exactly "
                             f"{', '.join(sorted(contract.BIAS_DEFAULTS))}")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in bias.values()):
            raise ValueError(f"{contract.ALIGN_KEY}.bias values must be finite numbers")
    return dict(value)


class BlockAlignLogitsProcessor(LogitsProcessor):
    """Fills the last KV block of a nested output by generation (see the module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        self.requests: dict[int, _Aligned] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Refuse a malformed spec, and one whose request would not stop where it must."""
        spec = (sampling_params.extra_args or {}).get(contract.ALIGN_KEY)
        if spec is None:
            return
        spec = parse_spec(spec)
        if not sampling_params.ignore_eos:
            raise ValueError(f"a request with {contract.ALIGN_KEY} needs ignore_eos=True")
        if spec["stop"] not in (sampling_params.stop_token_ids or ()):
            raise ValueError(f"a request with {contract.ALIGN_KEY} needs its stop token in "
                             "stop_token_ids")

    def is_argmax_invariant(self) -> bool:
        """Forcing and biasing tokens changes greedy choices."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, _new_request)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, req in self.requests.items():
            row = logits[index]
            written = len(req.out)
            position = req.prompt_len + written  # of the token sampled now
            if req.text_end() is None:
                row[req.stop] = _NEG_INF
                if req.boost:
                    self._bias(row, req, position)
            else:
                token = req.stop if position % self.block_size == 0 else req.pad
                row.fill_(_NEG_INF)
                row[token] = 0.0
        return logits

    def _bias(self, row: torch.Tensor, req: _Aligned, position: int) -> None:
        """Nudge the end tokens: ending at ``position`` leaves the request ``position + 1``
        tokens long, a whole number of blocks at the last position of a block."""
        offset = position % self.block_size
        ends = list(req.ends)
        if offset == self.block_size - 1:
            if torch.logsumexp(row.log_softmax(-1)[ends], -1).exp().item() >= req.min_prob:
                row[ends] += req.boost
        elif offset < req.window:
            row[ends] -= req.boost


def _new_request(params: Any, prompt_ids: list[int] | None,
                 out: list[int]) -> _Aligned | None:
    spec = (params.extra_args or {}).get(contract.ALIGN_KEY)
    if spec is None:
        return None
    return _Aligned(spec, len(prompt_ids or ()), out)


__all__ = ["BlockAlignLogitsProcessor", "parse_spec"]
