"""The patches that teach vLLM 0.32 span queries, and the guard that checks they still fit.

Each patch wraps one vLLM function by name (no fork):

* ``vllm.v1.engine.core.get_request_block_hasher`` → span-aware block hashes (:mod:`hashing`);
* ``KVCacheManager.allocate_slots`` → track block positions, plan rotations/copies
  (:mod:`positions`);
* ``BlockPool.cache_full_blocks`` → never register a plus span's blocks that were computed in
  context (they attended to other spans), so a cached span always means "computed alone";
* ``Scheduler.schedule`` → hand the step's rotations to the workers with the step's output;
* ``GPUModelRunner._update_states`` (the CPU runner inherits it) → apply the rotations after
  vLLM's block copies, before the forward pass (:mod:`rotation`);
* ``EngineCore`` gains the utility calls ``span_probe`` and ``span_stats``.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from span_vllm import config as span_config
from span_vllm.hashing import hash_blocks, make_request_block_hasher, span_root
from span_vllm.positions import PositionTracker
from span_vllm.stats import STATS

#: (module, attribute path, parameter names the patch relies on, in order)
TARGETS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.v1.engine.core", "get_request_block_hasher", ("hash_block_size", "caching_hash_fn")),
    ("vllm.v1.core.kv_cache_utils", "hash_block_tokens",
     ("hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys")),
    ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys",
     ("request", "start_token_idx", "end_token_idx", "start_mm_idx")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots",
     ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks")),
    ("vllm.v1.core.block_pool", "BlockPool.cache_full_blocks",
     ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
      "kv_cache_group_id", "block_mask")),
    ("vllm.v1.core.block_pool", "BlockPool.get_cached_block",
     ("self", "block_hash", "kv_cache_group_ids")),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager._apply_cow",
     ("self", "request_id", "block_idx", "source_block", "cow_block")),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", ("self",)),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states",
     ("self", "scheduler_output")),
    ("vllm.v1.engine.core", "EngineCore.add_request", ("self", "request")),
)
SUPPORTED_VLLM = "0.32.0"

_lock = threading.Lock()
_applied = False
_hashing: dict[str, Any] = {}


class IncompatibleVllmError(RuntimeError):
    """The installed vLLM no longer has what the span plugin patches."""


def _resolve(module: str, path: str) -> Any:
    obj: Any = __import__(module, fromlist=["_"])
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_targets() -> list[str]:
    """Problems with the patch targets in the installed vLLM (empty when all fit)."""
    problems = []
    for module, path, params in TARGETS:
        try:
            target = _resolve(module, path)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{path}: missing ({exc})")
            continue
        names = tuple(inspect.signature(target).parameters)
        if names[: len(params)] != params and not set(params) <= set(names):
            problems.append(f"{module}.{path}: parameters {names} no longer match {params}")
    return problems


def apply() -> None:
    """Apply every patch once (idempotent). Raises :class:`IncompatibleVllmError` if a target
    is missing or its signature changed."""
    global _applied
    with _lock:
        if _applied:
            return
        problems = check_targets()
        if problems:
            raise IncompatibleVllmError(
                f"span_vllm supports vLLM {SUPPORTED_VLLM}; the installed vLLM differs:\n  "
                + "\n  ".join(problems)
            )
        cfg = span_config.load()
        _patch_hashing(cfg)
        _patch_scheduler(cfg)
        _patch_worker()
        _patch_engine_core(cfg)
        _applied = True


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    if getattr(original, "__span_patched__", False):
        return
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped.__span_patched__ = True  # type: ignore[attr-defined]
    wrapped.__span_original__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def _patch_hashing(cfg: span_config.SpanConfig) -> None:
    from vllm.v1.engine import core

    def make(original: Callable) -> Callable:
        def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Callable) -> Callable:
            _hashing.update(hash_fn=caching_hash_fn, block_size=hash_block_size)
            return make_request_block_hasher(hash_block_size, caching_hash_fn, cfg)

        return get_request_block_hasher

    _wrap(core, "get_request_block_hasher", make)


def _patch_scheduler(cfg: span_config.SpanConfig) -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    allocate_sig = inspect.signature(KVCacheManager.allocate_slots)

    def make_allocate(original: Callable) -> Callable:
        def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request, *args, **kwargs)
            if result is not None:
                bound = allocate_sig.bind(self, request, *args, **kwargs)
                new_computed = bound.arguments.get("num_new_computed_tokens", 0)
                _tracker(self).after_allocate(self, request, new_computed)
            return result

        return allocate_slots

    def make_cache(original: Callable) -> Callable:
        def cache_full_blocks(
            self: Any, request: Any, blocks: list, num_cached_blocks: int, num_full_blocks: int,
            block_size: int, kv_cache_group_id: int, block_mask: list[bool] | None = None,
        ) -> None:
            tokens = request.all_token_ids
            mask = list(block_mask) if block_mask is not None else None
            keep: list[bool] = []
            for offset, index in enumerate(range(num_cached_blocks, num_full_blocks)):
                root, kind = span_root(tokens, block_size, index, cfg)
                ok = not (kind == "plus" and root > 0)
                if kind == "plus":
                    STATS.miss_blocks += 1
                if not ok:
                    STATS.unregistered_blocks += 1
                keep.append(ok and (mask is None or mask[offset]))
            return original(
                self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id, None if all(keep) and mask is None else keep,
            )

        return cache_full_blocks

    def make_schedule(original: Callable) -> Callable:
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(self, *args, **kwargs)
            tracker = getattr(self.kv_cache_manager, "_span_tracker", None)
            output.span_rotations = tracker.take_step() if tracker is not None else []
            return output

        return schedule

    _wrap(KVCacheManager, "allocate_slots", make_allocate)
    _wrap(BlockPool, "cache_full_blocks", make_cache)
    _wrap(Scheduler, "schedule", make_schedule)


def _tracker(manager: Any) -> PositionTracker:
    tracker = getattr(manager, "_span_tracker", None)
    if tracker is None:
        managers = manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise IncompatibleVllmError(
                "span mode supports models with one KV cache group (full attention) only"
            )
        tracker = PositionTracker(managers[0].block_size)
        manager._span_tracker = tracker
    return tracker


def _patch_worker() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original: Callable) -> Callable:
        def _update_states(self: Any, scheduler_output: Any) -> Any:
            result = original(self, scheduler_output)
            moves = getattr(scheduler_output, "span_rotations", None)
            if moves:
                from span_vllm.worker import rotator_for

                rotator, layout = rotator_for(self)
                rotator.apply(self.kv_caches, layout, moves)
            return result

        return _update_states

    _wrap(GPUModelRunner, "_update_states", make)


def probe(engine_core: Any, sequences: list[list[int]]) -> list[bool]:
    """For each token sequence (hashed as if it started a request), whether all its full
    blocks are in the prefix cache right now."""
    hash_fn = _hashing.get("hash_fn")
    if hash_fn is None:
        return [False] * len(sequences)
    cfg = span_config.load()
    pool = engine_core.scheduler.kv_cache_manager.block_pool
    answers = []
    for tokens in sequences:
        hashes = hash_blocks(tokens, _hashing["block_size"], hash_fn, cfg)
        answers.append(bool(hashes) and all(pool.get_cached_block(h, [0]) for h in hashes))
    return answers


def _patch_engine_core(cfg: span_config.SpanConfig) -> None:
    from vllm.v1.engine.core import EngineCore

    del cfg
    if not hasattr(EngineCore, "span_probe"):
        EngineCore.span_probe = lambda self, sequences: probe(self, sequences)
        EngineCore.span_stats = lambda self: STATS.snapshot()
