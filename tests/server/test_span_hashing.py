"""Span-aware block hashing (no engine)."""

from __future__ import annotations

import hashlib
import pickle
from types import SimpleNamespace

import pytest
from vllm.v1.core import kv_cache_utils

from span_vllm.config import SpanConfig
from span_vllm.hashing import hash_blocks, isolated_span_block, make_request_block_hasher

BS = 4
CFG = SpanConfig(plus_token=900, cross_token=901)
P, X = CFG.plus_token, CFG.cross_token


def _hash_fn(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj)).digest()


kv_cache_utils.init_none_hash(_hash_fn)


def _request(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        block_hashes=[], num_tokens=len(tokens), all_token_ids=tokens, mm_features=[],
        lora_request=None, cache_salt=None, prompt_embeds=None, prompt_token_ids=tokens,
        num_prompt_tokens=len(tokens),
    )


def _stock_hashes(tokens: list[int]) -> list[bytes]:
    stock = kv_cache_utils.get_request_block_hasher.__wrapped__ if hasattr(
        kv_cache_utils.get_request_block_hasher, "__wrapped__"
    ) else kv_cache_utils.get_request_block_hasher
    return stock(BS, _hash_fn)(_request(tokens))


def test_plain_prompt_hashes_exactly_like_stock_vllm() -> None:
    tokens = list(range(1, 23))
    ours = make_request_block_hasher(BS, _hash_fn, CFG)(_request(tokens))
    assert ours == _stock_hashes(tokens)
    assert len(ours) == len(tokens) // BS


def test_plus_span_hash_is_position_independent() -> None:
    span = [P, 11, 12, 13, 14, 15, 16, 17]
    alone = hash_blocks(span, BS, _hash_fn, CFG)
    placed = hash_blocks([1, 2, 3, 4] + [P, 7, 7, 7] + span, BS, _hash_fn, CFG)
    assert placed[2:4] == alone
    assert placed[1] not in alone


def test_cross_block_chains_over_everything_before_it() -> None:
    system, q = [1, 2, 3, 4], [X, 50, 51, 52, 53, 54, 55, 56]
    a, b, c = [P, 10, 10, 10], [P, 20, 20, 20], [P, 30, 30, 30]
    first = hash_blocks(system + a + b + q, BS, _hash_fn, CFG)
    second = hash_blocks(system + c + b + q, BS, _hash_fn, CFG)
    assert first[2] == second[2]  # span B reused
    assert first[3] != second[3] and first[4] != second[4]  # the tail is not (spnl's bug)


def test_block_after_a_span_without_marker_chains_normally() -> None:
    h1 = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS, _hash_fn, CFG)
    h2 = hash_blocks([1, 2, 3, 4, 5, 6, 7, 9], BS, _hash_fn, CFG)
    assert h1[0] == h2[0] and h1[1] != h2[1]


def test_incremental_hashing_matches_one_shot() -> None:
    tokens = [1, 2, 3, 4, P, 5, 6, 7, 8, 9, 10, 11, X, 12, 13, 14]
    full = hash_blocks(tokens, BS, _hash_fn, CFG)
    part = hash_blocks(tokens, BS, _hash_fn, CFG, previous=full[:2])
    assert full[2:] == part


@pytest.mark.parametrize(
    ("index", "expected"), [(0, False), (1, True), (2, True), (3, False)]
)
def test_isolated_span_blocks_are_spans_not_at_the_start(index: int, expected: bool) -> None:
    tokens = [1, 2, 3, 4] + [P, 5, 5, 5] + [6, 6, 6, 6] + [X, 7, 7, 7]
    assert isolated_span_block(tokens, BS, index, CFG) is expected
    assert isolated_span_block([P, 1, 1, 1, 2, 2, 2, 2], BS, 1, CFG) is False
