"""Scheduler side of KV repositioning: where each block's keys were computed, and the moves.

vLLM stores keys after RoPE, so a cached block is only valid at the position its keys were
rotated for. After the scheduler adopts prefix-cache hits for a request, every hit block whose
recorded position differs from where the request needs it is either

* **rotated in place** — only with a float32/float64 cache, when no other live request (and no
  other place in the same request) reads the block; or
* **duplicated** — copied into a fresh block with vLLM's copy-on-write path, and the copy
  rotated. The copy is private to the request and never registered in the prefix cache. With a
  16-bit (or smaller) cache every move is a copy rotated *from the block's home position* (where
  its KV was computed): the cached original is never rewritten, so a popular span moved a
  thousand times is rounded once per use, not once per move.

Safety rules, checked before vLLM adopts the hits (:meth:`PositionTracker.admit`):

* a hit that needs a move on a block whose KV is not computed yet (allocated earlier in the
  same scheduler step: vLLM registers blocks when it allocates them) would copy or rotate memory
  the forward pass has not written before the pass. Where the workers copy *inside* the pass
  (``same_step_copies``: the CPU attention backend, whose layers write the whole batch's KV
  before any token attends), it becomes a **same-step copy**: a fresh block that each layer
  fills from the source block, rotated, right after writing that layer's KV. So an engine's
  first query computes its spans and answers in one step. Elsewhere the hit is **deferred** a
  step;
* the fresh blocks the copies need are **reserved** with the allocation (vLLM's
  ``reserved_blocks``), so a copy never finds the free pool empty. If they do not fit, the
  request waits like any request that does not fit.

The moves of one scheduler step are handed to the workers with that step's output
(``scheduler_output.span_rotations``: ``[(block_id, delta_positions), ...]``), applied after
vLLM's own block copies and before the forward pass; its same-step copies as
``scheduler_output.span_copies``: ``[(source_id, copy_id, delta_positions), ...]``, applied in
every layer of the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from span_vllm.stats import STATS


@dataclass(frozen=True, slots=True)
class Admission:
    """What adopting a request's hits needs: ``copies`` fresh blocks, or to wait a step
    (``defer``)."""

    copies: int = 0
    defer: bool = False


@dataclass
class PositionTracker:
    """Position (of the first token) each physical block's keys currently carry."""

    block_size: int
    #: rotate cached blocks in place when nobody else reads them (exact enough in float32);
    #: ``False``: every move is a copy rotated from the block's home position
    in_place: bool = True
    #: the workers copy blocks computed in this step inside the forward pass (else: defer)
    same_step_copies: bool = False
    positions: dict[int, int] = field(default_factory=dict)
    _step_rotations: dict[int, int] = field(default_factory=dict)
    _step_start: dict[int, int] = field(default_factory=dict)
    _step_copies: list[tuple[int, int, int]] = field(default_factory=list)
    #: blocks allocated for computation in the current step (their KV is not written yet)
    _pending: set[int] = field(default_factory=set)
    #: copies reserved at admission and not placed yet
    _reserved: int = 0

    def admit(self, hits: list[Any], first_index: int) -> Admission:
        """Check a request's prefix-cache hits (``hits[i]`` at block index ``first_index+i``)
        before vLLM adopts them."""
        copies = 0
        seen: set[int] = set()
        for offset, block in enumerate(hits):
            if block.is_null:
                continue
            target = (first_index + offset) * self.block_size
            moves = self.positions.get(block.block_id, target) != target
            pending = block.block_id in self._pending
            if moves and pending and not self.same_step_copies:
                return Admission(defer=True)
            shared = block.ref_cnt > 0 or block.block_id in seen
            if moves and (shared or pending or not self.in_place):
                copies += 1
            seen.add(block.block_id)
        return Admission(copies=copies)

    def reserve(self, copies: int) -> None:
        """Copies admitted with an allocation that succeeded (placed by :meth:`after_allocate`)."""
        self._reserved += copies

    def after_allocate(self, manager: Any, request: Any, num_new_computed_tokens: int, *,
                       in_place: bool | None = None, layout: Any = None) -> None:
        """Record positions for ``request``'s blocks after ``allocate_slots`` succeeded, and plan
        the rotations/copies its newly adopted cache hits need (``in_place=True``: rotate
        unshared blocks in place whatever the cache dtype, when no copy was reserved).
        ``layout`` (the request's :class:`~span_vllm.hashing.BlockLayout`, if any) decides
        which hits count as span hits in the statistics."""
        single = manager.coordinator.single_type_managers[0]
        blocks = single.req_to_blocks[request.request_id]
        first_hit = request.num_computed_tokens // self.block_size
        end_hit = (request.num_computed_tokens + num_new_computed_tokens) // self.block_size
        allow = self.in_place if in_place is None else in_place
        for index in range(first_hit, end_hit):
            self._place_hit(manager, single, request, blocks, index, allow)
            if layout is not None and layout.is_span(index):
                STATS.hit_blocks += 1
        self._reserved = 0
        for index in range(end_hit, len(blocks)):
            block = blocks[index]
            if not block.is_null:
                self.positions[block.block_id] = index * self.block_size
                self._pending.add(block.block_id)

    def _place_hit(self, manager: Any, single: Any, request: Any, blocks: list, index: int,
                   in_place: bool) -> None:
        block = blocks[index]
        if block.is_null:
            return
        target = index * self.block_size
        current = self.positions.get(block.block_id, target)
        if current == target:
            return
        original = self._step_start.get(block.block_id, current)
        computing = block.block_id in self._pending
        if in_place and block.ref_cnt <= 1 and not computing:
            self._rotate(block.block_id, target - current, original)
            self.positions[block.block_id] = target
        else:
            if self._reserved <= 0 and manager.block_pool.get_num_free_blocks() == 0:
                raise RuntimeError(
                    "span_vllm: a span is read at two positions by one request and the KV "
                    "cache has no free block to copy it to; give the engine a larger KV cache")
            copy = manager.block_pool.get_new_blocks(1)[0]
            self._reserved -= 1
            single._apply_cow(request.request_id, index, block, copy)
            STATS.duplicated_blocks += 1
            if computing:  # written in this pass: each layer copies it once it is written
                self._step_copies.append((block.block_id, copy.block_id, target - current))
                STATS.same_step_copies += 1
            else:  # the copy runs before this step's rotations: it sees the step-start content
                self._rotate(copy.block_id, target - original, original)
            self.positions[copy.block_id] = target
        STATS.repositioned_tokens += self.block_size

    def _rotate(self, block_id: int, delta: int, original: int) -> None:
        self._step_start.setdefault(block_id, original)
        total = self._step_rotations.get(block_id, 0) + delta
        if total:
            self._step_rotations[block_id] = total
        else:
            self._step_rotations.pop(block_id, None)

    def take_copies(self) -> list[tuple[int, int, int]]:
        """Drain this step's same-step copies as ``[(source_id, copy_id, delta), ...]``."""
        copies, self._step_copies = self._step_copies, []
        return copies

    def take_step(self) -> list[tuple[int, int]]:
        """Drain this step's rotations as ``[(block_id, delta), ...]``; the blocks allocated in
        this step count as computed from now on (the step's forward pass writes them before the
        next step's moves run)."""
        moves = list(self._step_rotations.items())
        self._step_rotations.clear()
        self._step_start.clear()
        self._pending.clear()
        return moves
