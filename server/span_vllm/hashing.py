"""Span-aware KV block hashing, driven by the segments a request carries.

A block's hash names the context its KV was computed in. Per full block of ``block_size``
tokens (see :mod:`span_vllm.contract` for the segment kinds):

* the first block of an **anchored** span chains from the *anchor*: the hash of the last block
  before its plus group (the root, salted, if the group starts the prompt). Every span of one
  plus therefore hashes as if it directly followed that context, whatever its siblings;
* the first block of an **isolated** span chains from a fixed root salted with the request's
  ``cache_salt``: its hash depends on its own tokens only;
* the first block of an **ordered** run chains from a digest of *every* block before it, so an
  ordered tail is never reused after different spans;
* a span's *link blocks* (its first blocks, recomputed in the prompt's context) chain from a
  digest of every block before them *as cached*: link blocks of earlier spans of the same plus
  group count with the hash they would have without linking, because a link block is computed
  after the group's context and the earlier spans' own KV (all link blocks of a group are
  independent, so they are computed together in one step). The block after them chains from
  the hash the last one would have without linking: the rest of the span is the span's own
  cached KV;
* any other block chains from the block before it, exactly like stock vLLM. A request without a
  (valid) layout therefore hashes exactly as stock vLLM does.

Hashing is O(1) per block: the chain state (anchor, digest, segment cursor) is carried along
with the request, not recomputed from block 0.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core import kv_cache_utils

from span_vllm.contract import ANCHORED, ISOLATED, LAYOUT_KEY, ORDERED, SEGMENT_KINDS
from span_vllm.contract import adapter_digest as contract_adapter_digest

_ROOT_SEED = "span-workflows/root"
_ORDERED_SEED = "span-workflows/ordered"
_DIGEST_SEED = "span-workflows/digest"
_LINK_SEED = "span-workflows/link"


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """A request's segments in block units: ``starts[i]`` is the first block of segment ``i``,
    ``kinds[i]`` its kind, ``group_first[i]`` whether it opens its plus group, ``links[i]`` how
    many of its first blocks are link blocks."""

    starts: tuple[int, ...]
    kinds: tuple[str, ...]
    group_first: tuple[bool, ...]
    links: tuple[int, ...] = ()

    @classmethod
    def from_segments(cls, segments: Sequence[Sequence[Any]], block_size: int) -> BlockLayout:
        """Validate ``[[offset, kind], ...]``; raises ``ValueError`` if malformed."""
        starts: list[int] = []
        kinds: list[str] = []
        group_first: list[bool] = []
        links: list[int] = []
        previous_kind = ORDERED
        for item in segments:
            offset, kind, *rest = item
            link = rest[0] if rest else 0
            if (not isinstance(offset, int) or isinstance(offset, bool) or offset < 0
                    or offset % block_size or kind not in SEGMENT_KINDS or len(rest) > 1
                    or not isinstance(link, int) or isinstance(link, bool) or link < 0
                    or (link and kind == ORDERED)):
                raise ValueError(f"bad segment {item!r}")
            links.append(link)
            block = offset // block_size
            if starts and block <= starts[-1]:
                raise ValueError("segments must start at increasing offsets")
            starts.append(block)
            kinds.append(kind)
            # A span opens its group unless the segment before it (ending right here) is a
            # span too; the prefix counts as ordered.
            follows_span = len(kinds) > 1 and previous_kind != ORDERED
            group_first.append(kind != ORDERED and not follows_span)
            previous_kind = kind
        return cls(tuple(starts), tuple(kinds), tuple(group_first), tuple(links))

    def segment_of(self, block: int) -> int:
        """Index of the segment holding ``block`` (-1 for the ordered prefix)."""
        return bisect.bisect_right(self.starts, block) - 1

    def is_span(self, block: int) -> bool:
        """Whether ``block`` belongs to a commutative span (anchored or isolated)."""
        i = self.segment_of(block)
        return i >= 0 and self.kinds[i] != ORDERED

    def computed_in_context(self, block: int) -> bool:
        """Whether ``block``, if this request computes it, attends to more than its hash says:
        it belongs to a span that does not open its group (anchored) or does not start the
        prompt (isolated), so it would attend to sibling spans or to a prefix."""
        i = self.segment_of(block)
        if i < 0:
            return False
        kind = self.kinds[i]
        if self.links[i]:
            # The rest of the span, computed here, would attend to the link blocks instead
            # of its own first blocks. Link blocks attend to everything before them: as their
            # hash says only if no earlier span of their group is linked here (their hash
            # names the earlier spans' unlinked KV).
            return block >= self.starts[i] + self.links[i] or self.linked_before(i)
        if kind == ANCHORED:
            return not self.group_first[i]
        if kind == ISOLATED:
            return self.starts[i] > 0
        return False


    def linked_before(self, index: int) -> bool:
        """Whether a span before segment ``index`` in its plus group has link blocks."""
        j = index
        while j > 0 and not self.group_first[j]:
            j -= 1
            if self.links[j]:
                return True
        return False


def request_layout(request: Any, block_size: int, key: str | None) -> BlockLayout | None:
    """The validated layout ``request`` carries (cached on it), or ``None`` for plain requests
    and for layouts without the right key."""
    cached = getattr(request, "_span_layout", _UNSET)
    if cached is not _UNSET:
        return cached
    layout = parse_layout(_extra_args(request), block_size, key)
    try:
        request._span_layout = layout
    except AttributeError:  # pragma: no cover - a slotted request type
        pass
    return layout


def parse_layout(extra_args: Any, block_size: int, key: str | None) -> BlockLayout | None:
    """The layout in a request's ``extra_args`` if it is well formed and carries ``key``."""
    if not key or not isinstance(extra_args, dict):
        return None
    raw = extra_args.get(LAYOUT_KEY)
    if not isinstance(raw, dict):
        return None
    given = raw.get("key")
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), key.encode()):
        return None
    segments = raw.get("segments")
    if not isinstance(segments, list) or not segments:
        return None
    try:
        return BlockLayout.from_segments(segments, block_size)
    except (TypeError, ValueError):
        return None


class _Unset:
    pass


_UNSET = _Unset()


def _extra_args(request: Any) -> Any:
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None)


@dataclass(slots=True)
class SpanChain:
    """Incremental hasher of one token sequence under a layout (``None`` = stock rules)."""

    hash_fn: Callable[[Any], bytes]
    layout: BlockLayout | None
    salt: str | None = None
    hashes: list[bytes] = field(default_factory=list)
    _digest: bytes | None = None
    #: the digest with every link block counted by its unlinked hash (what link blocks chain
    #: from: the prompt's KV as cached)
    _cached_digest: bytes | None = None
    _anchor: bytes | None = None
    _next: int = 0
    #: while in link blocks: the hash chain the span would have without linking
    _virtual: bytes | None = None
    _links_left: int = 0
    #: the parent of the block after the link blocks
    _resume: bytes | None = None

    def parent(self, block: int) -> bytes | None:
        """Parent hash of ``block`` (the next one to hash); updates the segment cursor."""
        previous = self.hashes[-1] if self.hashes else None
        layout = self.layout
        if layout is None or self._next >= len(layout.starts) or layout.starts[self._next] != block:
            if self._resume is not None:
                resume, self._resume = self._resume, None
                return resume
            return previous
        self._resume = None
        i = self._next
        self._next += 1
        kind = layout.kinds[i]
        if kind == ORDERED:
            return kv_cache_utils.BlockHash(self.hash_fn((_ORDERED_SEED, self._digest)))
        if layout.group_first[i]:
            self._anchor = previous
            # link blocks count earlier spans of their own group as cached, and everything
            # before the group as it is
            self._cached_digest = self._digest
        if kind == ANCHORED and self._anchor is not None:
            own = self._anchor
        else:
            own = kv_cache_utils.BlockHash(self.hash_fn((_ROOT_SEED, self.salt)))
        if layout.links[i]:
            self._virtual, self._links_left = own, layout.links[i]
            return kv_cache_utils.BlockHash(self.hash_fn((_LINK_SEED, self._cached_digest)))
        return own

    def extend(self, token_ids: Sequence[int], block_size: int,
               extra_keys: Callable[[int, int], Any] | None = None) -> list[bytes]:
        """Hash the full blocks of ``token_ids`` not hashed yet; return the new hashes."""
        new: list[bytes] = []
        block = len(self.hashes)
        while (block + 1) * block_size <= len(token_ids):
            begin, end = block * block_size, (block + 1) * block_size
            parent = self.parent(block)
            keys = extra_keys(begin, end) if extra_keys is not None else None
            tokens = token_ids[begin:end]
            block_hash = kv_cache_utils.hash_block_tokens(self.hash_fn, parent, tokens, keys)
            as_cached = block_hash
            if self._links_left:
                self._virtual = as_cached = kv_cache_utils.hash_block_tokens(
                    self.hash_fn, self._virtual, tokens, keys)
                self._links_left -= 1
                if not self._links_left:
                    self._resume = self._virtual
            self.hashes.append(block_hash)
            if self.layout is not None:
                self._digest = self.hash_fn((_DIGEST_SEED, self._digest, block_hash))
                self._cached_digest = self.hash_fn((_DIGEST_SEED, self._cached_digest,
                                                    as_cached))
            new.append(block_hash)
            block += 1
        return new


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: Callable[[Any], bytes],
    segments: Sequence[Sequence[Any]] = (),
    *,
    salt: str | None = None,
    extra_keys: Callable[[int, int], Any] | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` under ``segments`` (none = stock rules)."""
    layout = BlockLayout.from_segments(segments, block_size) if segments else None
    return SpanChain(hash_fn, layout, salt).extend(token_ids, block_size, extra_keys)


def routing_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    segments: Sequence[Sequence[Any]] = (),
    salt: str | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of a span prompt under the engine's chain rules, for routing
    outside the engine: the same parents as :func:`hash_blocks` (a span's blocks name its own
    tokens and its anchor, not its position among its siblings), hashed with SHA-256 of the
    pickled block (the engine's own hash function may differ, so these keys name blocks
    consistently across queries but are not the engine's block hashes)."""
    import pickle

    def sha256_pickle(obj: Any) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()

    def salt_keys(begin: int, end: int) -> Any:  # vLLM keys the first block by the salt
        return (salt,) if salt and begin == 0 else None

    if not hasattr(kv_cache_utils, "NONE_HASH"):  # set by the engine; not in other processes
        kv_cache_utils.init_none_hash(sha256_pickle)
    return hash_blocks(token_ids, block_size, sha256_pickle, segments, salt=salt,
                       extra_keys=salt_keys)


def make_request_block_hasher(
    hash_block_size: int, caching_hash_fn: Callable[[Any], bytes], key: str | None
) -> Callable[[Any], list[bytes]]:
    """A drop-in for vLLM's ``get_request_block_hasher`` result, with the span rules for
    requests whose layout carries ``key``."""

    def request_block_hasher(request: Any) -> list[bytes]:
        start = len(request.block_hashes) * hash_block_size
        if start + hash_block_size > request.num_tokens:
            return []
        chain: SpanChain | None = getattr(request, "_span_chain", None)
        if chain is None or len(chain.hashes) != len(request.block_hashes):
            chain = _replay(request, hash_block_size, caching_hash_fn, key)
            try:
                request._span_chain = chain
            except AttributeError:  # pragma: no cover - a slotted request type
                pass

        return chain.extend(request.all_token_ids, hash_block_size,
                            lambda begin, end: request_extra_keys(request, begin, end))

    return request_block_hasher


def _replay(request: Any, block_size: int, hash_fn: Callable[[Any], bytes],
            key: str | None) -> SpanChain:
    """A chain positioned after the request's existing hashes (rebuilt from its tokens: only
    when the request's hashes were produced elsewhere, e.g. on a fresh request: O(0))."""
    layout = request_layout(request, block_size, key)
    chain = SpanChain(hash_fn, layout, getattr(request, "cache_salt", None))
    done = len(request.block_hashes)
    if done:
        chain.extend(list(request.all_token_ids)[: done * block_size], block_size,
                     lambda begin, end: request_extra_keys(request, begin, end))
    return chain


def request_extra_keys(request: Any, begin: int, end: int) -> Any:
    """vLLM's extra keys of the block ``begin:end`` of ``request``, with its LoRA named by the
    adapter's *content* (:func:`adapter_digest`) instead of vLLM's ``(name, path)``: a span
    computed under one adapter is never served to another, to the base, or to an adapter
    retrained at the same path and loaded anew."""
    keys, _ = kv_cache_utils.generate_block_hash_extra_keys(request, begin, end, 0)
    lora = getattr(request, "lora_request", None)
    if not keys or lora is None:
        return keys
    own = weights_key(lora.lora_int_id, lora.lora_path)
    return tuple(own if isinstance(k, tuple) and k[:1] == ("lora",) else k for k in keys)


def weights_key(lora_int_id: int, lora_path: str) -> tuple[str, str]:
    """The extra hash key of every block computed under the LoRA adapter ``lora_int_id``
    loaded from ``lora_path``: ``("lora", <sha256 of its adapter files>)``, as they were when
    the engine core loaded it (:func:`note_adapter`), or when first seen."""
    key = (int(lora_int_id), str(lora_path))
    digest = _LOADED.get(key)
    if digest is None:
        digest = _LOADED[key] = contract_adapter_digest(lora_path)
    return ("lora", digest)


def note_adapter(lora_int_id: int, lora_path: str, digest: str | None = None) -> None:
    """The engine core loads (or reloads in place) the adapter ``lora_int_id`` from
    ``lora_path``, whose files have the digest ``digest`` (taken now if not given): blocks
    computed under the weights now loaded are keyed by exactly those weights (blocks of
    earlier weights at the same path stop hitting)."""
    _LOADED[(int(lora_int_id), str(lora_path))] = digest or contract_adapter_digest(lora_path)


#: (lora_int_id, lora_path) -> digest of the adapter files the engine core loaded
_LOADED: dict[tuple[int, str], str] = {}


__all__ = ["BlockLayout", "SpanChain", "hash_blocks", "make_request_block_hasher",
           "note_adapter", "parse_layout", "request_extra_keys", "request_layout",
           "routing_block_keys", "weights_key"]
