"""The patches that teach vLLM 0.32 span queries, and the guard that checks they still fit.

Each patch wraps one vLLM function by name (no fork):

* ``vllm.v1.engine.core.get_request_block_hasher`` → span-aware block hashes (:mod:`hashing`);
* ``KVCacheManager.allocate_slots`` → track block positions, plan rotations/copies
  (:mod:`positions`);
* ``BlockPool.cache_full_blocks`` → never register a plus span's blocks that were computed in
  context (they attended to other spans), so a cached span always means "computed alone";
* ``Scheduler.schedule`` → hand the step's rotations to the workers with the step's output;
  count engine steps for tagged requests (:mod:`steps`), noted on arrival by
  ``EngineCore.add_request``;
* ``GPUModelRunner._update_states`` (the CPU runner inherits it) and Model Runner V2's
  ``update_requests`` → apply the rotations after vLLM's block copies, before the forward pass
  (:mod:`rotation`), and stage the step's same-step copies; both runners'
  ``initialize_kv_cache`` → check the model can be rotated;
* ``CPUAttentionBackendImpl.do_kv_cache_update`` → after each layer's KV write, fill the copies
  of blocks this very pass computes (:func:`worker.copy_in_layer`), so a query's prepares and
  its answer run in one step;
* ``Scheduler.__init__`` / ``KVCacheManager.__init__`` → refuse unsupported models at start
  (:mod:`support`);
* ``EngineCore`` gains the utility calls ``span_probe``, ``span_stats`` and ``span_steps``;
* ``vllm.lora.punica_wrapper.punica_cpu``'s LoRA ops → grouped matmuls (:mod:`lora_cpu`);
* ``CpuPlatform.check_and_update_config`` → a one-worker engine core on CPU keeps its worker
  in its own process (:func:`_patch_cpu_executor`).

The last two, and the malloc thresholds below, are CPU-only: they are installed only where
vLLM's ``current_platform.is_cpu()``, so on a GPU vLLM's own LoRA kernels and executor run.

Not a patch of vLLM: on CPU, glibc's malloc thresholds are fixed in the engine process, so
each step's activations reuse the heap (:mod:`cpu_memory`).

Blocks computed under a LoRA adapter are keyed by the adapter's content
(:func:`hashing.request_extra_keys`), not by vLLM's ``(name, path)``.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from span_vllm.adapter_pins import PINS
from span_vllm.contract import (
    CPU_EXECUTOR_ENV,
    PROBE_CALL,
    STATS_CALL,
    STEPS_CALL,
    layout_key,
    note_start,
)
from span_vllm.hashing import (
    hash_blocks,
    make_request_block_hasher,
    note_adapter,
    request_layout,
    weights_key,
)
from span_vllm.positions import PositionTracker
from span_vllm.stats import STATS
from span_vllm.steps import CLOCK
from span_vllm.support import engine_problems, kv_cache_problems, refuse

#: (module, attribute path, parameter names the patch relies on, in order)
TARGETS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("vllm.v1.engine.core", "get_request_block_hasher", ("hash_block_size", "caching_hash_fn")),
    ("vllm.v1.core.kv_cache_utils", "hash_block_tokens",
     ("hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys")),
    ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys",
     ("request", "start_token_idx", "end_token_idx", "start_mm_idx")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots",
     ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
      "reserved_blocks", "has_scheduled_reqs")),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.__init__",
     ("self", "kv_cache_config")),
    ("vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("self", "vllm_config")),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.initialize_kv_cache",
     ("self", "kv_cache_config")),
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
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.do_kv_cache_update",
     ("self", "layer", "key", "value", "kv_cache", "slot_mapping")),
    ("vllm.v1.engine.core", "EngineCore._initialize_kv_caches", ("self", "vllm_config")),
    ("vllm.v1.engine.core", "EngineCore.add_request", ("self", "request")),
    ("vllm.v1.engine.core", "EngineCore.add_lora", ("self", "lora_request")),
    ("vllm.v1.engine.core", "EngineCore.remove_lora", ("self", "lora_id")),
    ("vllm.v1.engine.core", "EngineCore.preprocess_add_request", ("self", "request")),
    ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", ("vllm_config",)),
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
        key = layout_key(create=False)
        _patch_hashing(key)
        _patch_scheduler(key)
        _patch_start_checks()
        _patch_worker()
        _patch_engine_core()
        _patch_lora()
        _patch_cpu_executor()
        _keep_cpu_activation_memory()
        _applied = True


def _keep_cpu_activation_memory() -> None:
    """On CPU, fixed malloc thresholds: each step's activations reuse the heap instead of
    fresh pages (:mod:`span_vllm.cpu_memory`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from span_vllm.cpu_memory import keep_activation_memory

        keep_activation_memory()


def _patch_cpu_executor() -> None:
    """On CPU, vLLM runs even a one-worker engine core's worker in a process of its own (its
    ``mp`` executor, spawned: one more Python start and vLLM import, about 8 s on a 2-core
    machine, for every server start). The worker then computes on one core with the engine
    core's scheduler beside it, which is how an in-process engine (``uni``) already runs, so
    a one-worker engine core here keeps ``uni``: the worker runs in the engine-core process.
    :data:`contract.CPU_EXECUTOR_ENV` ``=mp`` keeps vLLM's choice; an executor asked for
    explicitly, or more than one worker, is left as vLLM decides. Installed on the CPU
    platform only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    def make(original: Callable) -> Callable:
        def check_and_update_config(cls: Any, vllm_config: Any) -> None:
            parallel = vllm_config.parallel_config
            one_worker = (parallel.distributed_executor_backend == "uni"
                          and parallel.world_size == 1)
            original(cls, vllm_config)
            if one_worker and os.environ.get(CPU_EXECUTOR_ENV, "uni").strip().lower() != "mp":
                parallel.distributed_executor_backend = "uni"

        return check_and_update_config

    _wrap(CpuPlatform, "check_and_update_config", make)


def _patch_lora() -> None:
    """Grouped LoRA ops for the CPU punica wrapper (:mod:`span_vllm.lora_cpu`): faster, and
    "no adapter" tokens stay on the base weights in a batch that mixes both.

    Installed on the CPU platform only: :func:`lora_cpu.install` also replaces
    ``BaseLinearLayerWithLoRA._apply_sync`` (every platform's LoRA layers), whose per-step
    token groups only ``PunicaWrapperCPU.update_metadata`` clears; on any other platform they
    would go stale, and vLLM's own LoRA kernels are the ones to run there."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from span_vllm import lora_cpu

    lora_cpu.install()


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)`` once; a classmethod of ``owner`` stays a
    classmethod (``make`` gets and returns the function, ``cls`` first)."""
    defined = vars(owner).get(name) if isinstance(owner, type) else None
    is_classmethod = isinstance(defined, classmethod)
    original = defined.__func__ if is_classmethod else getattr(owner, name)
    if getattr(original, "__span_patched__", False):
        return
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped.__span_patched__ = True  # type: ignore[attr-defined]
    wrapped.__span_original__ = original  # type: ignore[attr-defined]
    setattr(owner, name, classmethod(wrapped) if is_classmethod else wrapped)


def _patch_hashing(key: str) -> None:
    from vllm.v1.engine import core

    def make(original: Callable) -> Callable:
        def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Callable) -> Callable:
            _hashing.update(hash_fn=caching_hash_fn, block_size=hash_block_size)
            return make_request_block_hasher(hash_block_size, caching_hash_fn, key)

        return get_request_block_hasher

    _wrap(core, "get_request_block_hasher", make)


def _patch_scheduler(key: str) -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    allocate_sig = inspect.signature(KVCacheManager.allocate_slots)

    def make_allocate(original: Callable) -> Callable:
        def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            bound = allocate_sig.bind(self, request, *args, **kwargs)
            bound.apply_defaults()
            tracker = _tracker(self)
            new_computed = bound.arguments["num_new_computed_tokens"]
            hits = bound.arguments["new_computed_blocks"]
            copies = 0
            if hits is not None and new_computed:
                admission = tracker.admit(list(hits.blocks[0]),
                                          request.num_computed_tokens // tracker.block_size)
                if admission.defer:
                    STATS.deferred_hits += 1
                    return None
                copies = admission.copies
            bound.arguments["reserved_blocks"] += copies
            result = original(*bound.args, **bound.kwargs)
            if result is None and copies:
                STATS.deferred_hits += 1  # (at least) the copies did not fit: wait
            if result is None and copies and not bound.arguments["has_scheduled_reqs"]:
                # Nothing else runs, so no block will be freed by waiting: adopt the hits
                # without the reserve and move cached blocks in place where nobody reads them.
                STATS.refused_hits += copies
                bound.arguments["reserved_blocks"] -= copies
                result = original(*bound.args, **bound.kwargs)
                if result is not None:
                    tracker.after_allocate(self, request, new_computed, in_place=True,
                                           layout=_layout_of(request, tracker))
                return result
            if result is not None:
                tracker.reserve(copies)
                tracker.after_allocate(self, request, new_computed,
                                       layout=_layout_of(request, tracker))
            return result

        def _layout_of(request: Any, tracker: PositionTracker) -> Any:
            return request_layout(request, tracker.block_size, key)

        return allocate_slots

    def make_cache(original: Callable) -> Callable:
        def cache_full_blocks(
            self: Any, request: Any, blocks: list, num_cached_blocks: int, num_full_blocks: int,
            block_size: int, kv_cache_group_id: int, block_mask: list[bool] | None = None,
        ) -> None:
            layout = request_layout(request, block_size, key)
            if layout is None or num_cached_blocks >= num_full_blocks:
                return original(self, request, blocks, num_cached_blocks, num_full_blocks,
                                block_size, kv_cache_group_id, block_mask)
            keep = register_mask(request, layout, num_cached_blocks, num_full_blocks,
                                 block_mask)
            result = original(
                self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id, None if all(keep) and block_mask is None else keep,
            )
            from span_vllm.store_connector import scheduler_connector

            store = scheduler_connector()
            if store is not None and kv_cache_group_id == 0:
                store.note_registered(request, layout, blocks, num_cached_blocks, keep)
            return result

        return cache_full_blocks

    def make_schedule(original: Callable) -> Callable:
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = original(self, *args, **kwargs)
            tracker = getattr(self.kv_cache_manager, "_span_tracker", None)
            output.span_copies = tracker.take_copies() if tracker is not None else []
            output.span_rotations = tracker.take_step() if tracker is not None else []
            CLOCK.scheduled(self.requests, output.num_scheduled_tokens)
            return output

        return schedule

    _wrap(KVCacheManager, "allocate_slots", make_allocate)
    _wrap(BlockPool, "cache_full_blocks", make_cache)
    _wrap(Scheduler, "schedule", make_schedule)


def register_mask(request: Any, layout: Any, num_cached_blocks: int, num_full_blocks: int,
                  block_mask: list[bool] | None) -> list[bool]:
    """Which of a request's newly computed full blocks may enter the prefix cache.

    A span block computed inside a larger request attended to more than its hash says (its
    sibling spans, or a prefix for an isolated span), so it is kept out; and so is *every later
    block of the request*, which attended to it in turn. The first such block is remembered on
    the request (``_span_tainted_from``), so later calls keep refusing. Blocks loaded from the
    span store (``_span_loaded``) hold their span's own KV, like cache hits: they taint nothing.
    """
    tainted = getattr(request, "_span_tainted_from", None)
    loaded = getattr(request, "_span_loaded", range(0))  # from the span store: as if cached
    keep: list[bool] = []
    for offset, index in enumerate(range(num_cached_blocks, num_full_blocks)):
        if index in loaded:
            keep.append(tainted is None and (block_mask is None or block_mask[offset]))
            continue
        if layout.is_span(index):
            STATS.miss_blocks += 1
        if tainted is None and layout.computed_in_context(index):
            tainted = index
            request._span_tainted_from = index
        ok = tainted is None or index < tainted
        if not ok:
            STATS.unregistered_blocks += 1
        keep.append(ok and (block_mask is None or block_mask[offset]))
    return keep


def _tracker(manager: Any) -> PositionTracker:
    """The position tracker of a KV cache manager (created when the manager was built, after
    its configuration passed the start-time check)."""
    tracker = getattr(manager, "_span_tracker", None)
    if tracker is None:
        # A manager built before the plugin was applied: check it now, still before any of
        # its blocks is given a span position.
        refuse(kv_cache_problems(manager.kv_cache_config), "KV cache manager")
        tracker = _new_tracker(manager)
        manager._span_tracker = tracker
    return tracker


def _new_tracker(manager: Any) -> PositionTracker:
    """A position tracker for a (checked) KV cache manager."""
    from vllm.platforms import current_platform

    return PositionTracker(manager.coordinator.single_type_managers[0].block_size,
                           in_place=_float32_cache(manager),
                           same_step_copies=current_platform.is_cpu())


def _float32_cache(manager: Any) -> bool:
    """Whether the KV cache stores float32 (or wider): then rotating cached blocks in place
    loses nothing measurable; narrower caches are moved as copies from their home position."""
    import torch

    try:
        dtype = manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype
    except (AttributeError, IndexError):
        return False
    return dtype in (torch.float32, torch.float64)


def _patch_start_checks() -> None:
    """Refuse unsupported models when the engine is built, not at their first request:
    ``Scheduler.__init__`` checks the engine configuration, ``KVCacheManager.__init__`` the
    KV cache configuration (and creates the position tracker)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    manager_sig = inspect.signature(KVCacheManager.__init__)

    def make_manager_init(original: Callable) -> Callable:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = manager_sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            refuse(kv_cache_problems(arguments["kv_cache_config"],
                                     int(arguments.get("dcp_world_size") or 1),
                                     int(arguments.get("pcp_world_size") or 1)),
                   "KV cache manager")
            original(self, *args, **kwargs)
            self._span_tracker = _new_tracker(self)

        return __init__

    def make_scheduler_init(original: Callable) -> Callable:
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            refuse(engine_problems(vllm_config), "engine configuration")
            original(self, vllm_config, *args, **kwargs)

        return __init__

    _wrap(KVCacheManager, "__init__", make_manager_init)
    _wrap(Scheduler, "__init__", make_scheduler_init)


def _patch_worker() -> None:
    """Hook both model runners where vLLM applies its own copy-on-write block copies (after
    them, before the forward pass of the step): V1 ``_update_states`` (its CPU subclass
    inherits it) and Model Runner V2 ``update_requests``. After either runner allocated its KV
    cache, check that it can be rotated (refuse at start otherwise). The CPU attention's KV
    write of each layer is followed by the step's same-step copies in that layer."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from span_vllm.worker import build_rotation, copy_in_layer, rotation_for, stage_copies

    def make_step(original: Callable) -> Callable:
        def step(self: Any, scheduler_output: Any) -> Any:
            result = original(self, scheduler_output)
            moves = getattr(scheduler_output, "span_rotations", None)
            if moves:
                rotation_for(self).apply(moves)
            stage_copies(self, getattr(scheduler_output, "span_copies", None) or [])
            return result

        return step

    def make_init_kv(original: Callable) -> Callable:
        def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            self._span_rotation = build_rotation(self)  # refuses an unsupported model
            return result

        return initialize_kv_cache

    def make_kv_update(original: Callable) -> Callable:
        def do_kv_cache_update(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any,
                               slot_mapping: Any) -> None:
            original(self, layer, key, value, kv_cache, slot_mapping)
            copy_in_layer(kv_cache)

        return do_kv_cache_update

    _wrap(GPUModelRunner, "_update_states", make_step)
    _wrap(GPUModelRunner, "initialize_kv_cache", make_init_kv)
    _wrap(CPUAttentionBackendImpl, "do_kv_cache_update", make_kv_update)
    for owner, name in _v2_targets():
        _wrap(owner, name, make_step if name == "update_requests" else make_init_kv)


def _v2_targets() -> list[tuple[Any, str]]:
    """Model Runner V2's hooks, checked like :data:`TARGETS` (empty if V2 cannot load)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except ImportError:  # pragma: no cover - V2 needs Triton; without it V1 runs
        return []
    expected = {"update_requests": ("self", "scheduler_output"),
                "initialize_kv_cache": ("self", "kv_cache_config")}
    for name, params in expected.items():
        names = tuple(inspect.signature(getattr(RunnerV2, name)).parameters)
        if names[: len(params)] != params:
            raise IncompatibleVllmError(
                f"vllm.v1.worker.gpu.model_runner.GPUModelRunner.{name}: parameters {names} "
                f"no longer match {params}"
            )
    return [(RunnerV2, name) for name in expected]


def probe(engine_core: Any, prompts: list[Any], salt: str | None = None,
          lora: Sequence[Any] | None = None) -> list[bool]:
    """For each prompt (``[token_ids, segments]``, hashed as a request with that layout,
    ``cache_salt`` and LoRA adapter ``lora`` = ``[lora_int_id, lora_path]``, ``None`` for the
    base weights), whether all its full blocks are in the prefix cache right now, or in the
    span store (the request then loads them; should one be gone by then, its cached tokens
    fall short and the planner prepares it and retries).

    Public as ``span_vllm.span_probe``; ``engine_core`` is vLLM's ``EngineCore`` in this
    process. Other processes ask the engine core with the ``span_probe`` utility call, which
    runs this."""
    hash_fn = _hashing.get("hash_fn")
    if hash_fn is None:
        return [False] * len(prompts)
    from span_vllm.store_connector import scheduler_connector

    pool = engine_core.scheduler.kv_cache_manager.block_pool
    connector = scheduler_connector()
    store = connector.store if connector is not None else None
    keys = _extra_keys(salt, None if not lora else weights_key(int(lora[0]), str(lora[1])))
    answers = []
    for tokens, segments in prompts:
        hashes = hash_blocks(tokens, _hashing["block_size"], hash_fn, segments, salt=salt,
                             extra_keys=keys)
        answers.append(bool(hashes) and all(
            pool.get_cached_block(h, [0]) or (store is not None and store.has(bytes(h)))
            for h in hashes))
    return answers


def span_stats() -> dict[str, int]:
    """The span-cache counters of this process (names in ``contract.STAT_HELP``).

    Public as ``span_vllm.span_stats``; they live in the engine-core process: other processes
    ask it with the ``span_stats`` utility call, which runs this."""
    return STATS.snapshot()


def _extra_keys(salt: str | None,
                weights: tuple[str, str] | None) -> Callable[[int, int], Any] | None:
    """The extra keys a request with this salt and LoRA gets (as vLLM orders them): the
    adapter's key on every block, then the salt on block 0 only."""
    if not salt and weights is None:
        return None

    def keys(begin: int, end: int) -> Any:
        found = ([weights] if weights is not None else []) + (
            [("cache_salt", salt)] if salt and begin == 0 else [])
        return tuple(found) or None

    return keys


def span_steps(tags: list[str]) -> list[list[int] | None]:
    """For each step tag, ``[to_first_token, to_end]``: the scheduler steps the tagged request
    waited for from its arrival to its first token and to its last step (``None``: unknown).

    Public as ``span_vllm.span_steps``; other processes ask the engine core with the
    ``span_steps`` utility call, which runs this."""
    return CLOCK.steps(tags)


def _pinned(lora_request: Any, reload: bool = False) -> Any:
    """``lora_request`` on its pinned copy, the copy's digest noted as its weights key."""
    pinned = PINS.pin(lora_request, reload=reload)
    pin = PINS.pinned(pinned.lora_int_id)
    if pin is not None and pin.path == pinned.lora_path:
        note_adapter(pinned.lora_int_id, pin.path, pin.digest)
    elif reload:  # not copied (a hub id, a failed copy): keyed by its files as loaded now
        note_adapter(pinned.lora_int_id, pinned.lora_path)
    return pinned


def _patch_engine_core() -> None:
    from vllm.v1.engine.core import EngineCore

    def make_kv_init(original: Callable) -> Callable:
        # once per engine core, in its own process, after the plugins are loaded (vLLM loads
        # them inside EngineCore.__init__, so wrapping __init__ misses server engine cores)
        def _initialize_kv_caches(self: Any, vllm_config: Any, *args: Any, **kwargs: Any
                                  ) -> Any:
            config = original(self, vllm_config, *args, **kwargs)
            note_start(str(getattr(vllm_config.model_config, "model", "?")))
            return config

        return _initialize_kv_caches

    _wrap(EngineCore, "_initialize_kv_caches", make_kv_init)

    def make_add(original: Callable) -> Callable:
        def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            CLOCK.arrive(request)
            return original(self, request, *args, **kwargs)

        return add_request

    _wrap(EngineCore, "add_request", make_add)

    # every load of an adapter, lazy reloads after an eviction included, reads the copy its
    # blocks are keyed by (adapter_pins)
    def make_preprocess(original: Callable) -> Callable:
        def preprocess_add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                request.lora_request = _pinned(lora)
            return original(self, request, *args, **kwargs)

        return preprocess_add_request

    _wrap(EngineCore, "preprocess_add_request", make_preprocess)

    def make_add_lora(original: Callable) -> Callable:
        def add_lora(self: Any, lora_request: Any, *args: Any, **kwargs: Any) -> Any:
            pinned = _pinned(lora_request, reload=bool(getattr(lora_request, "load_inplace",
                                                               False)))
            return original(self, pinned, *args, **kwargs)

        return add_lora

    _wrap(EngineCore, "add_lora", make_add_lora)

    def make_remove_lora(original: Callable) -> Callable:
        def remove_lora(self: Any, lora_id: int, *args: Any, **kwargs: Any) -> Any:
            PINS.forget(lora_id)
            return original(self, lora_id, *args, **kwargs)

        return remove_lora

    _wrap(EngineCore, "remove_lora", make_remove_lora)
    if not hasattr(EngineCore, PROBE_CALL):
        setattr(EngineCore, PROBE_CALL,
                lambda self, prompts, salt=None, lora=None: probe(self, prompts, salt, lora))
        setattr(EngineCore, STATS_CALL, lambda self: span_stats())
        setattr(EngineCore, STEPS_CALL, lambda self, tags: span_steps(list(tags)))
