"""Span-aware block hashing driven by request segments (no engine)."""

from __future__ import annotations

import hashlib
import pickle
from types import SimpleNamespace

import pytest
from vllm.v1.core import kv_cache_utils

from span_vllm.contract import ANCHORED, ISOLATED, ORDERED, layout_args
from span_vllm.hashing import BlockLayout, hash_blocks, make_request_block_hasher, parse_layout
from span_vllm.patches import register_mask

BS = 4
KEY = "test-layout-key"


def _hash_fn(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj)).digest()


kv_cache_utils.init_none_hash(_hash_fn)


def _request(tokens: list[int], segments=(), key: str = KEY, salt: str | None = None):
    extra = layout_args(segments, key) if segments else None
    return SimpleNamespace(
        block_hashes=[], num_tokens=len(tokens), all_token_ids=tokens, mm_features=[],
        lora_request=None, cache_salt=salt, prompt_embeds=None, prompt_token_ids=tokens,
        num_prompt_tokens=len(tokens), sampling_params=SimpleNamespace(extra_args=extra),
    )


def _hasher():
    return make_request_block_hasher(BS, _hash_fn, KEY)


def _stock_hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    stock = kv_cache_utils.get_request_block_hasher
    stock = getattr(stock, "__span_original__", stock)
    return stock(BS, _hash_fn)(_request(tokens, salt=salt))


SYSTEM = [1, 2, 3, 4]
A, B, C = [10, 10, 10, 10], [20, 20, 20, 20], [30, 30, 30, 30]
TAIL = [50, 51, 52, 53, 54, 55, 56, 57]


def _rag(*spans: list[int], kind: str = ANCHORED) -> tuple[list[int], list[tuple[int, str]]]:
    tokens = list(SYSTEM)
    segments = []
    for span in spans:
        segments.append((len(tokens), kind))
        tokens += span
    segments.append((len(tokens), ORDERED))
    return tokens + TAIL, segments


def test_plain_prompt_hashes_exactly_like_stock_vllm() -> None:
    tokens = list(range(1, 23))
    assert _hasher()(_request(tokens)) == _stock_hashes(tokens)
    assert _hasher()(_request(tokens, salt="t1")) == _stock_hashes(tokens, salt="t1")


def test_a_layout_without_the_key_hashes_as_stock() -> None:
    tokens, segments = _rag(A, B)
    forged = _hasher()(_request(tokens, segments, key="guessed"))
    assert forged == _stock_hashes(tokens)
    assert _hasher()(_request(tokens, segments)) != _stock_hashes(tokens)


@pytest.mark.parametrize("raw", [
    {"span_layout": {"key": KEY, "segments": [[3, ANCHORED]]}},          # not block aligned
    {"span_layout": {"key": KEY, "segments": [[4, "plux"]]}},            # unknown kind
    {"span_layout": {"key": KEY, "segments": [[8, ANCHORED], [4, ORDERED]]}},  # not increasing
    {"span_layout": {"key": KEY, "segments": "x"}},
    {"span_layout": {"key": 7, "segments": [[4, ANCHORED]]}},
    {"span_layout": []},
    None,
])
def test_malformed_layouts_are_ignored(raw) -> None:
    assert parse_layout(raw, BS, KEY) is None


def test_anchored_span_hash_follows_its_prefix_not_its_siblings() -> None:
    ab_tokens, ab = _rag(A, B)
    ba_tokens, ba = _rag(B, A)
    hab = hash_blocks(ab_tokens, BS, _hash_fn, ab)
    hba = hash_blocks(ba_tokens, BS, _hash_fn, ba)
    assert hab[1] == hba[2] and hab[2] == hba[1]  # A and B hash the same in either order
    prepared_b = hash_blocks(SYSTEM + B, BS, _hash_fn, [(4, ANCHORED)])
    assert prepared_b[1] == hab[2]  # ... and the same as B prepared right after the prefix
    assert prepared_b == hash_blocks(SYSTEM + B, BS, _hash_fn)  # which is a stock chain
    other_prefix = hash_blocks([9, 9, 9, 9, *B], BS, _hash_fn, [(4, ANCHORED)])
    assert other_prefix[1] != hab[2]  # computed after another prefix: another key


def test_isolated_span_hash_is_position_and_prefix_independent() -> None:
    alone = hash_blocks(B + C, BS, _hash_fn, [(0, ISOLATED)])
    placed = hash_blocks(SYSTEM + A + B + C, BS, _hash_fn,
                         [(4, ISOLATED), (8, ISOLATED)])
    assert placed[2:4] == alone
    assert placed[1] not in alone


def test_ordered_tail_chains_over_every_block_before_it() -> None:
    first_t, first_s = _rag(A, B)
    second_t, second_s = _rag(C, B)
    first = hash_blocks(first_t, BS, _hash_fn, first_s)
    second = hash_blocks(second_t, BS, _hash_fn, second_s)
    assert first[2] == second[2]  # span B reused after different siblings
    assert first[3] != second[3] and first[4] != second[4]  # the two-block tail is not


def test_salt_separates_every_span_hash() -> None:
    tokens, segments = _rag(A, B)
    plain = hash_blocks(tokens, BS, _hash_fn, segments)
    salted = _hasher()(_request(tokens, segments, salt="tenant-a"))
    other = _hasher()(_request(tokens, segments, salt="tenant-b"))
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)
    iso_a = _hasher()(_request(A + B, [(0, ISOLATED), (4, ISOLATED)], salt="tenant-a"))
    iso_b = _hasher()(_request(A + B, [(0, ISOLATED), (4, ISOLATED)], salt="tenant-b"))
    assert not set(iso_a) & set(iso_b)


def test_incremental_hashing_matches_one_shot() -> None:
    tokens, segments = _rag(A, B, C)
    full = hash_blocks(tokens, BS, _hash_fn, segments)
    request = _request(tokens[:9], segments)
    hasher = _hasher()
    request.block_hashes.extend(hasher(request))
    for end in range(10, len(tokens) + 1):
        request.all_token_ids = tokens[:end]
        request.num_tokens = end
        request.block_hashes.extend(hasher(request))
    assert request.block_hashes == full


class _CountingTokens(list):
    """A token list that counts the elements read through it."""

    reads = 0

    def __getitem__(self, index):  # type: ignore[override]
        item = super().__getitem__(index)
        _CountingTokens.reads += len(item) if isinstance(index, slice) else 1
        return item


def test_hashing_work_per_block_is_constant() -> None:
    """No rescans from block 0: each block costs a bounded number of token reads and hash
    calls, whatever the prompt length (the old scan-back was quadratic)."""
    for blocks in (64, 1024):
        calls = 0

        def counting_hash(obj: object) -> bytes:
            nonlocal calls
            calls += 1
            return _hash_fn(obj)

        tokens = _CountingTokens(range(blocks * BS))
        segments = [(BS * i, ANCHORED) for i in range(1, blocks - 1, 4)]
        _CountingTokens.reads = 0
        request = _request(tokens, segments)
        request.all_token_ids = tokens
        hashes = make_request_block_hasher(BS, counting_hash, KEY)(request)
        assert len(hashes) == blocks
        assert _CountingTokens.reads <= 2 * len(tokens)
        assert calls <= 3 * blocks


def test_block_layout_knows_which_spans_were_computed_in_context() -> None:
    layout = BlockLayout.from_segments(
        [(4, ANCHORED), (8, ANCHORED), (12, ORDERED), (16, ANCHORED), (20, ISOLATED)], BS)
    assert [layout.computed_in_context(b) for b in range(6)] == [
        False,  # prefix
        False,  # the first span of a plus: computed after the prefix, as its hash says
        True,   # a later sibling computed in the request attended to the first
        False,  # ordered
        False,  # first span of the second plus
        True,   # an isolated span not at the start
    ]
    assert not BlockLayout.from_segments([(0, ISOLATED)], BS).computed_in_context(0)


def test_once_a_span_is_computed_in_context_no_later_block_is_registered() -> None:
    tokens, segments = _rag(A, B)
    request = _request(tokens, segments)
    layout = BlockLayout.from_segments(segments, BS)
    # Prefix and A were hits; B (in context) and the two tail blocks are computed now.
    assert register_mask(request, layout, 2, 5, None) == [False, False, False]
    # A later call (more blocks filled by decoding) keeps refusing.
    assert register_mask(request, layout, 5, 6, None) == [False]
    clean = _request(tokens, segments)
    assert register_mask(clean, layout, 0, 2, None) == [True, True]


def test_link_blocks_chain_over_the_context_and_the_span_resumes_its_own_chain() -> None:
    two_block = [40, 41, 42, 43, 44, 45, 46, 47]
    plain_t, plain_s = _rag(A, two_block)
    link_s = [plain_s[0], (plain_s[1][0], ANCHORED, 1), plain_s[2]]
    plain = hash_blocks(plain_t, BS, _hash_fn, plain_s)
    linked = hash_blocks(plain_t, BS, _hash_fn, link_s)
    assert linked[:2] == plain[:2]  # prefix and the first span
    assert linked[2] != plain[2]  # the link block: computed in context, its own key
    assert linked[3] == plain[3]  # the rest of the span: the span's own cached block
    assert linked[4] != plain[4]  # the tail follows a different history
    other_t, _ = _rag(C, two_block)
    other = hash_blocks(other_t, BS, _hash_fn, link_s)
    assert other[2] != linked[2] and other[3] == linked[3]  # link depends on what precedes
    layout = BlockLayout.from_segments(link_s, BS)
    assert not layout.computed_in_context(2) and layout.computed_in_context(3)


def _linked(segments: list, links: dict[int, int]) -> list:
    """``segments`` with ``links[i]`` link blocks on segment ``i``."""
    return [(*s[:2], links[i]) if links.get(i) else s[:2] for i, s in enumerate(segments)]


TWO_A, TWO_B, TWO_C = ([k] * 8 for k in (11, 21, 31))


def test_the_link_blocks_of_one_plus_hash_as_their_own_link_requests_compute_them() -> None:
    """A link request (the prompt up to the end of one span's link blocks, the earlier spans
    of the plus unlinked) computes the link block the main request reads: their hashes are
    equal, whichever earlier spans the main request links. So all link requests of a plus are
    independent and run in one step."""
    tokens, segments = _rag(TWO_A, TWO_B, TWO_C)
    main = hash_blocks(tokens, BS, _hash_fn, _linked(segments, {1: 1, 2: 1}))
    b_start, c_start = segments[1][0] // BS, segments[2][0] // BS
    for index, start in ((1, b_start), (2, c_start)):
        request_tokens = tokens[: (start + 1) * BS]
        request_segments = _linked(segments[: index + 1], {index: 1})
        link_request = hash_blocks(request_tokens, BS, _hash_fn, request_segments)
        assert link_request[-1] == main[start]  # what the main request reads
        assert link_request[:-1] == hash_blocks(request_tokens[:-BS], BS, _hash_fn,
                                                segments[:index])  # the rest: as cached
    only_c = hash_blocks(tokens, BS, _hash_fn, _linked(segments, {2: 1}))
    assert only_c[c_start] == main[c_start]
    # the rest of each span is the span's own cached block; the tail follows the links
    plain = hash_blocks(tokens, BS, _hash_fn, segments)
    assert main[b_start + 1] == plain[b_start + 1] and main[c_start + 1] == plain[c_start + 1]
    assert main[-1] != plain[-1]


def test_a_link_block_depends_on_the_earlier_spans_and_their_order() -> None:
    tokens, segments = _rag(TWO_A, TWO_B, TWO_C)
    swapped, swapped_segments = _rag(TWO_B, TWO_A, TWO_C)
    c_start = segments[2][0] // BS
    links = {1: 1, 2: 1}
    assert (hash_blocks(tokens, BS, _hash_fn, _linked(segments, links))[c_start]
            != hash_blocks(swapped, BS, _hash_fn, _linked(swapped_segments, links))[c_start])


def test_a_later_plus_reads_the_earlier_plus_as_linked() -> None:
    """Across pluses a link block chains over everything before its plus as it is (the
    earlier plus linked or not), so a query that links the first plus never shares the second
    plus's link blocks with one that does not."""
    tokens, first = _rag(TWO_A, TWO_B)
    second_start = len(tokens)
    tokens = tokens + TWO_C + TWO_A + TAIL
    segments = [*first, (second_start, ANCHORED), (second_start + 8, ANCHORED),
                (second_start + 16, ORDERED)]
    link_second = {4: 1}
    a_second = (second_start + 8) // BS
    linked_first = hash_blocks(tokens, BS, _hash_fn, _linked(segments, {1: 1, **link_second}))
    plain_first = hash_blocks(tokens, BS, _hash_fn, _linked(segments, link_second))
    assert linked_first[a_second] != plain_first[a_second]


def test_link_blocks_computed_after_linked_siblings_are_kept_out_of_the_cache() -> None:
    """In the main request an earlier span's first block holds its *linked* KV; a link block
    computed there would have attended to it, not to what its hash names."""
    tokens, segments = _rag(TWO_A, TWO_B, TWO_C)
    b_start, c_start = segments[1][0] // BS, segments[2][0] // BS
    main = BlockLayout.from_segments(_linked(segments, {1: 1, 2: 1}), BS)
    assert not main.computed_in_context(b_start)  # the first linked span: as its hash says
    assert main.computed_in_context(c_start)  # after a linked sibling
    assert main.computed_in_context(c_start + 1)  # the rest of a span after its link block
    own_request = BlockLayout.from_segments(_linked(segments[:3], {2: 1}), BS)
    assert not own_request.computed_in_context(c_start)
