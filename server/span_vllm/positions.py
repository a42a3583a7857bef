"""Scheduler side of KV repositioning: where each block's keys were computed, and the moves.

vLLM stores keys after RoPE, so a cached block is only valid at the position its keys were
rotated for. After the scheduler adopts prefix-cache hits for a request, every hit block whose
recorded position differs from where the request needs it is either

* **rotated in place** (no other live request uses it), or
* **duplicated** — copied into a fresh block with vLLM's copy-on-write path, and the copy rotated
  — when another live request (or another place in the same request) still reads it at its old
  position. The copy is private to the request and never registered in the prefix cache.

The moves of one scheduler step are handed to the workers with that step's output
(``scheduler_output.span_rotations``: ``[(block_id, delta_positions), ...]``), applied after
vLLM's own block copies and before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from span_vllm.stats import STATS


@dataclass
class PositionTracker:
    """Position (of the first token) each physical block's keys currently carry."""

    block_size: int
    positions: dict[int, int] = field(default_factory=dict)
    _step_rotations: dict[int, int] = field(default_factory=dict)
    _step_start: dict[int, int] = field(default_factory=dict)

    def after_allocate(self, manager: Any, request: Any, num_new_computed_tokens: int) -> None:
        """Record positions for ``request``'s blocks after ``allocate_slots`` succeeded, and plan
        the rotations/copies its newly adopted cache hits need."""
        single = manager.coordinator.single_type_managers[0]
        blocks = single.req_to_blocks[request.request_id]
        first_hit = request.num_computed_tokens // self.block_size
        end_hit = (request.num_computed_tokens + num_new_computed_tokens) // self.block_size
        for index in range(first_hit, end_hit):
            self._place_hit(manager, single, request, blocks, index)
        for index in range(end_hit, len(blocks)):
            block = blocks[index]
            if not block.is_null:
                self.positions[block.block_id] = index * self.block_size

    def _place_hit(self, manager: Any, single: Any, request: Any, blocks: list, index: int) -> None:
        block = blocks[index]
        if block.is_null:
            return
        target = index * self.block_size
        current = self.positions.get(block.block_id, target)
        if current == target:
            STATS.hit_blocks += 1
            return
        original = self._step_start.get(block.block_id, current)
        if block.ref_cnt <= 1:
            self._rotate(block.block_id, target - current, original)
            self.positions[block.block_id] = target
        else:
            copy = manager.block_pool.get_new_blocks(1)[0]
            single._apply_cow(request.request_id, index, block, copy)
            STATS.duplicated_blocks += 1
            # The copy runs before this step's rotations: it sees the step-start content.
            self._rotate(copy.block_id, target - original, original)
            self.positions[copy.block_id] = target
        STATS.hit_blocks += 1
        STATS.repositioned_tokens += self.block_size

    def _rotate(self, block_id: int, delta: int, original: int) -> None:
        self._step_start.setdefault(block_id, original)
        total = self._step_rotations.get(block_id, 0) + delta
        if total:
            self._step_rotations[block_id] = total
        else:
            self._step_rotations.pop(block_id, None)

    def take_step(self) -> list[tuple[int, int]]:
        """Drain this step's rotations as ``[(block_id, delta), ...]``."""
        moves = list(self._step_rotations.items())
        self._step_rotations.clear()
        self._step_start.clear()
        return moves
