"""span_workflows.logprobs: top-k KL estimates of next-token distributions."""

from __future__ import annotations

import math

from span_workflows.logprobs import kl_top, mean_kl


def test_kl_top_is_zero_on_itself_and_grows_with_the_difference() -> None:
    p = {1: math.log(0.7), 2: math.log(0.3)}
    assert kl_top(p, p) == 0.0
    near = kl_top(p, {1: math.log(0.6), 2: math.log(0.4)})
    far = kl_top(p, {1: math.log(0.1), 2: math.log(0.9)})
    assert 0 < near < far
    exact = 0.7 * math.log(0.7 / 0.1) + 0.3 * math.log(0.3 / 0.9)
    assert math.isclose(far, exact)


def test_a_token_missing_from_q_is_taken_at_qs_smallest_value() -> None:
    p = {1: math.log(0.5), 2: math.log(0.5)}
    q = {1: math.log(0.5), 3: math.log(0.2)}
    assert math.isclose(kl_top(p, q), 0.5 * math.log(0.5 / 0.2))


def test_empty_dicts_have_no_value_and_mean_kl_leaves_them_out() -> None:
    p = {1: math.log(0.9), 2: math.log(0.1)}
    q = {1: math.log(0.5), 2: math.log(0.5)}
    assert math.isnan(kl_top({}, p)) and math.isnan(kl_top(p, {}))
    assert math.isclose(mean_kl([(p, q), ({}, q), (p, p)]), kl_top(p, q) / 2)
    assert math.isnan(mean_kl([({}, q)]))
