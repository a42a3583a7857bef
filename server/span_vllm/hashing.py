"""Span-aware KV block hashing.

Rules, per full block of ``block_size`` tokens:

* a block whose first token is the **plus marker** starts a new chain: its hash depends only on
  its own tokens (and the blocks of its span after it chain from it), so a span's blocks have
  the same hashes wherever the span is placed;
* a block whose first token is the **cross marker** chains over *every* block before it (the
  tuple of all earlier hashes), so an ordered tail is never reused after different spans;
* any other block chains from the previous block, exactly like stock vLLM. A prompt without
  markers therefore hashes exactly as stock vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core import kv_cache_utils

from span_vllm.config import SpanConfig

_PLUS_ROOT_SEED = "span-workflows/plus-root"
_CROSS_SEED = "span-workflows/cross"


def block_parent(
    hash_fn: Callable[[Any], bytes],
    config: SpanConfig,
    first_token: int,
    previous: Sequence[bytes],
) -> bytes | None:
    """The parent hash of a block given its first token and all earlier block hashes."""
    if first_token == config.plus_token:
        return kv_cache_utils.BlockHash(hash_fn(_PLUS_ROOT_SEED))
    if first_token == config.cross_token:
        return kv_cache_utils.BlockHash(hash_fn((_CROSS_SEED, tuple(previous))))
    return previous[-1] if previous else None


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: Callable[[Any], bytes],
    config: SpanConfig,
    previous: Sequence[bytes] = (),
    extra_keys: Callable[[int, int], Any] | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` after the ``len(previous)`` already hashed."""
    hashes = list(previous)
    start = len(previous) * block_size
    new: list[bytes] = []
    while start + block_size <= len(token_ids):
        end = start + block_size
        block = token_ids[start:end]
        parent = block_parent(hash_fn, config, block[0], hashes)
        keys = extra_keys(start, end) if extra_keys is not None else None
        block_hash = kv_cache_utils.hash_block_tokens(hash_fn, parent, block, keys)
        hashes.append(block_hash)
        new.append(block_hash)
        start = end
    return new


def span_root(token_ids: Sequence[int], block_size: int, index: int,
              config: SpanConfig) -> tuple[int, str]:
    """The block that opens the segment holding block ``index``, and that segment's kind:
    ``"plus"`` (a commutative span), ``"cross"`` (an ordered tail) or ``"prefix"``."""
    for j in range(index, -1, -1):
        first = token_ids[j * block_size]
        if first == config.plus_token:
            return j, "plus"
        if first == config.cross_token:
            return j, "cross"
    return 0, "prefix"


def isolated_span_block(token_ids: Sequence[int], block_size: int, index: int,
                        config: SpanConfig) -> bool:
    """Whether block ``index`` belongs to a plus span that does *not* start the sequence.

    Such a block, when computed inside a request, attended to what precedes its span, so its KV
    must not be registered under the span's position-free hash.
    """
    root, kind = span_root(token_ids, block_size, index, config)
    return kind == "plus" and root > 0


def make_request_block_hasher(
    hash_block_size: int, caching_hash_fn: Callable[[Any], bytes], config: SpanConfig
) -> Callable[[Any], list[bytes]]:
    """A drop-in for vLLM's ``get_request_block_hasher`` result, with the span rules."""

    def request_block_hasher(request: Any) -> list[bytes]:
        start = len(request.block_hashes) * hash_block_size
        if start + hash_block_size > request.num_tokens:
            return []

        def extra_keys(begin: int, end: int) -> Any:
            keys, _ = kv_cache_utils.generate_block_hash_extra_keys(request, begin, end, 0)
            return keys

        return hash_blocks(
            request.all_token_ids, hash_block_size, caching_hash_fn, config,
            request.block_hashes, extra_keys,
        )

    return request_block_hasher
