"""Counters of span-cache behaviour in this process (scheduler side)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SpanStats:
    """Totals since start; names and meanings in :data:`span_vllm.contract.STAT_HELP`."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    repositioned_tokens: int = 0
    duplicated_blocks: int = 0
    unregistered_blocks: int = 0
    deferred_hits: int = 0
    same_step_copies: int = 0
    refused_hits: int = 0
    store_hit_blocks: int = 0
    store_bad_blocks: int = 0
    store_written_blocks: int = 0
    store_write_errors: int = 0
    store_dropped_blocks: int = 0

    def snapshot(self) -> dict[str, int]:
        """A plain dict copy of the counters."""
        return asdict(self)


STATS = SpanStats()
