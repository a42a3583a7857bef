"""The scheduler-side position tracker on stand-in blocks (no engine): deferral or same-step
copies of hits on uncomputed blocks, reservation of copies, and copy-from-home for 16-bit
caches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from span_vllm.positions import Admission, PositionTracker
from span_vllm.rotation import RopeRotator

BS = 4


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_cnt: int = 0
    is_null: bool = False


@dataclass
class _Pool:
    next_id: int = 100
    free: int = 10

    def get_num_free_blocks(self) -> int:
        return self.free

    def get_new_blocks(self, n: int) -> list[_Block]:
        if n > self.free:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        self.free -= n
        out = [_Block(self.next_id + i, 1) for i in range(n)]
        self.next_id += n
        return out


@dataclass
class _Single:
    req_to_blocks: dict[str, list[_Block]] = field(default_factory=dict)
    cows: list[tuple[int, int]] = field(default_factory=list)

    def _apply_cow(self, request_id: str, index: int, source: _Block, copy: _Block) -> None:
        self.req_to_blocks[request_id][index] = copy
        self.cows.append((source.block_id, copy.block_id))


class _Manager:
    def __init__(self) -> None:
        self.single = _Single()
        self.block_pool = _Pool()
        self.coordinator = type("C", (), {"single_type_managers": [self.single]})()


@dataclass
class _Request:
    request_id: str
    num_computed_tokens: int = 0


def _allocate(tracker: PositionTracker, manager: _Manager, rid: str, blocks: list[_Block],
              hits: int) -> None:
    """What the patched ``allocate_slots`` does: admit, adopt (ref counts), place."""
    admission = tracker.admit(blocks[:hits], 0)
    assert not admission.defer
    tracker.reserve(admission.copies)
    for block in blocks:
        block.ref_cnt += 1
    manager.single.req_to_blocks[rid] = list(blocks)
    tracker.after_allocate(manager, _Request(rid), hits * BS)


def test_a_hit_that_must_move_a_block_computed_this_step_is_deferred() -> None:
    tracker, manager = PositionTracker(BS), _Manager()
    span = [_Block(1), _Block(2)]
    _allocate(tracker, manager, "prepare", span, hits=0)  # computes the span at blocks 0-1
    prefix = _Block(3)
    assert tracker.admit([prefix, *span][:0], 0).copies == 0
    # Same step: another request wants the span at blocks 1-2: its KV is not written yet.
    assert tracker.admit([_Block(9), *span], 0).defer
    tracker.take_step()  # the forward pass ran
    assert not tracker.admit([_Block(9), *span], 0).defer
    # A hit that needs no move may read a block of this step (vLLM's own rule).
    _allocate(tracker, manager, "again", [_Block(5)], hits=0)
    assert not tracker.admit([_Block(5)], 0).defer


def test_where_workers_copy_inside_the_pass_a_hit_on_a_block_of_this_step_is_copied() -> None:
    """A hit that must move a block computed in this step: a fresh copy, filled by the
    workers inside the pass (``take_copies``), never rotated before it and never in place
    (the source is the span's home copy, even when nobody else holds it)."""
    tracker, manager = PositionTracker(BS, same_step_copies=True), _Manager()
    span = [_Block(1), _Block(2)]
    _allocate(tracker, manager, "prepare", span, hits=0)  # computes the span at blocks 0-1
    wanted = [_Block(9), *span]  # the main request reads it at blocks 1-2
    assert tracker.admit(wanted, 0) == Admission(copies=2)
    for block in span:
        block.ref_cnt = 0  # even unshared: its KV is not written yet
    assert tracker.admit(wanted, 0) == Admission(copies=2)
    _allocate(tracker, manager, "main", wanted, hits=3)
    copies = manager.single.req_to_blocks["main"][1:]
    assert [b.block_id for b in copies] == [100, 101]
    assert tracker.take_copies() == [(1, 100, BS), (2, 101, BS)]
    assert tracker.take_step() == []  # nothing rotated before the pass
    assert tracker.take_copies() == []
    assert tracker.positions[100] == BS and tracker.positions[1] == 0


def test_copies_are_counted_for_shared_blocks_and_repeats_and_reserved() -> None:
    tracker, manager = PositionTracker(BS), _Manager()
    span = _Block(1)
    _allocate(tracker, manager, "a", [span], hits=0)
    tracker.take_step()
    # "a" still holds the span (ref 1): moving it for "b" needs a copy.
    assert tracker.admit([_Block(7), span], 0).copies == 1
    # The same span twice in one request: the second occurrence needs a copy.
    span.ref_cnt = 0
    assert tracker.admit([span, _Block(8), span], 0).copies == 1
    # A float32 cache rotates an unshared block in place: no copy.
    assert tracker.admit([_Block(7), span], 0).copies == 0
    # A 16-bit cache copies every move.
    copying = PositionTracker(BS, in_place=False, positions=dict(tracker.positions))
    assert copying.admit([_Block(7), span], 0).copies == 1


def test_sixteen_bit_caches_rotate_copies_from_the_home_position() -> None:
    """A bf16 block moved back and forth 1000 times stays within one rounding of a single
    rotation, because the cached original is never rewritten (in place, it drifts)."""
    tracker, manager = PositionTracker(BS, in_place=False), _Manager()
    manager.block_pool.free = 10_000
    home = _Block(1)
    _allocate(tracker, manager, "prepare", [home], hits=0)
    tracker.take_step()
    manager.single.req_to_blocks.clear()
    deltas = []
    for i in range(1000):
        index = 1 + (i % 2) * 6  # block 1 or block 7
        blocks = [_Block(10_000 + j) for j in range(index)] + [home]
        home.ref_cnt = 0
        _allocate(tracker, manager, f"r{i}", blocks, hits=index + 1)
        moves = dict(tracker.take_step())
        assert home.block_id not in moves  # the original is never rotated
        copy_id = manager.single.req_to_blocks[f"r{i}"][index].block_id
        deltas.append(moves[copy_id])
    assert set(deltas) == {BS, 7 * BS}  # always measured from home (position 0)

    rotator = RopeRotator.from_base(10000.0, 64)
    torch.manual_seed(0)
    pristine = torch.randn(1, 2, BS, 64).to(torch.bfloat16)
    exact = rotator.rotate(pristine.double(), torch.tensor([7.0 * BS]))
    from_home = rotator.rotate(pristine, torch.tensor([float(deltas[-1])]))
    chained, at = pristine, 0
    for i in range(1000):  # what in-place rotation would do: one rounding per move
        target = (1 + (i % 2) * 6) * BS
        chained = rotator.rotate(chained, torch.tensor([float(target - at)]))
        at = target
    # "ulp-equivalents": error over one bf16 ulp of the largest value of each key vector
    ulp = exact.abs().amax(dim=-1, keepdim=True) * 2.0 ** -8
    assert ((from_home.double() - exact).abs() / ulp).max() <= 2.0
    assert ((chained.double() - exact).abs() / ulp).max() > 2.0
