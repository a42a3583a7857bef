"""Compare next-token distributions given as top-k log-probability dicts.

The engine reports the first answer token's distribution as ``{token id: log-probability}``
over its ``k`` most likely tokens (``Result.first_logprobs``, ``logprobs=k``). Two such dicts
rarely list the same tokens, so the divergences here are *top-k estimates*: a token one dict
lists and the other does not is taken at the other's smallest listed log-probability, an upper
bound of its true value (the estimate errs towards a smaller divergence).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping


def kl_top(p: Mapping[int, float], q: Mapping[int, float]) -> float:
    """KL(p || q) from two top-k log-probability dicts: over p's tokens, each missing from q
    taken at q's smallest listed log-probability (an upper bound of its true value).
    ``nan`` when either dict is empty."""
    if not p or not q:
        return float("nan")
    floor = min(q.values())
    return sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items())


def mean_kl(pairs: Iterable[tuple[Mapping[int, float], Mapping[int, float]]]) -> float:
    """The mean of :func:`kl_top` over ``(p, q)`` pairs, pairs without a value (an empty dict)
    left out; ``nan`` when none has one."""
    values = [kl_top(p, q) for p, q in pairs]
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else float("nan")


__all__ = ["kl_top", "mean_kl"]
