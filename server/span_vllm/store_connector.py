"""The span store as a vLLM KV connector: store hits become cache hits, computed spans are kept.

vLLM 0.32's KV-connector API (``KVConnectorBase_V1``, the interface LMCache and vLLM's own
offloading connector implement) already does the scheduling half of a store tier: on a
prefix-cache miss the scheduler asks the connector how many more tokens it can supply
(:meth:`get_num_new_matched_tokens`), allocates blocks for them, counts them as computed (and
as cached tokens in the request's output) and has the worker fill them before the step's
forward pass (:meth:`start_load_kv`); a block the worker cannot fill fails its request and is
evicted with every block after it (``kv_load_failure_policy="fail"``: vLLM's other policy,
``"recompute"``, would compute the block inside the request, in the wrong context for a span;
span-workflows' planner prepares the spans and runs a failed request again). This connector
supplies span blocks from a :class:`~span_vllm.store.SpanStore`:

* **scheduler side** — a request with a span layout gets, after its local prefix-cache hit,
  every following block whose hash has a file in the store (contiguously; never the block of
  the prompt's last token, which the request must compute). The plugin's block hashes make that
  exact: a span block's hash names the context its KV was computed in, so a stored block is
  valid wherever its hash appears. Loaded blocks count like cache hits for the plugin (they do
  not taint the blocks after them, :func:`span_vllm.patches.register_mask`). Blocks the
  scheduler registers in the prefix cache (the plugin decides which are sound) are written to
  the store when they are spans or the prefix before the first span
  (:func:`note_registered`), unless the store is read-only;
* **worker side** — loads read each block's file, check it (:meth:`SpanStore.read`), copy it
  into every layer's KV cache and rotate its keys from the position they were stored at to the
  block's position in this request (the plugin's RoPE rotation, :mod:`span_vllm.worker`).
  Saves copy the step's new blocks after the forward pass and write them from a background
  thread (atomic files), so a miss does not wait for the disk.

Configured by ``kv_transfer_config`` (``kv_connector`` = ``"SpanStoreConnector"``,
``kv_connector_module_path`` = ``"span_vllm.store_connector"``, ``kv_role`` = ``"kv_both"``);
``kv_connector_extra_config``: ``path`` (the store's directory), ``max_gib`` (size cap of the
whole directory, every namespace and process counted; LRU), ``write`` (default true:
write-through of computed spans), ``model`` (the weights' identity, default
:func:`span_vllm.store.model_identity` of the model directory; the namespace adds
:func:`span_vllm.store.engine_identity`), ``queue_mib`` (the most block bytes waiting for the
writer, default :data:`DEFAULT_QUEUE_MIB`: past it a step's saves are dropped and counted, never
held in memory outside the KV budget).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from span_vllm.contract import ORDERED, layout_key
from span_vllm.hashing import request_layout
from span_vllm.stats import STATS
from span_vllm.store import SpanStore, engine_identity, model_identity, namespace
from span_vllm.support import refuse, store_problems

#: The scheduler-side connector of this process (the plugin's hooks report to it), if any.
_SCHEDULER: list[SpanStoreConnector] = []
#: The worker-side connector of this process, if any.
_WORKERS: list[SpanStoreConnector] = []


#: the most block bytes waiting for the writer, by default (MiB)
DEFAULT_QUEUE_MIB = 256


@dataclass
class SpanStoreMetadata(KVConnectorMetadata):
    """One step's work for the workers: ``loads`` ``[(block_id, key, position)]`` to fill
    (``position``: where the block sits in its request) and ``saves`` ``[(block_id, key,
    position)]`` to write after the forward pass."""

    loads: list[tuple[int, bytes, int]] = field(default_factory=list)
    saves: list[tuple[int, bytes, int]] = field(default_factory=list)


def store_for(vllm_config: Any, kv_cache_config: Any) -> tuple[SpanStore, bool]:
    """The store a connector of this engine opens (same namespace in every process), and
    whether it writes. Raises :class:`~span_vllm.support.UnsupportedModelError` where the
    configuration cannot share a store exactly (:func:`~span_vllm.support.store_problems`:
    more than one tensor/pipeline rank, a per-process random first block hash)."""
    refuse(store_problems(vllm_config), "span store")  # before a rank opens anything
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {})
    if not extra.get("path"):
        raise ValueError("SpanStoreConnector needs kv_connector_extra_config['path']")
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    config = vllm_config.model_config
    model = {"weights": extra.get("model") or model_identity(
                 config.model, revision=getattr(config, "revision", None)),
             "engine": engine_identity(vllm_config)}
    shape = (len(group.layer_names), int(spec.num_kv_heads), int(spec.head_size),
             str(vllm_config.device_config.device_type))
    space = namespace(model, int(spec.block_size), spec.dtype, shape)  # type: ignore[arg-type]
    max_gib = extra.get("max_gib")
    store = SpanStore(extra["path"], space,
                      max_bytes=None if max_gib is None else int(float(max_gib) * 2**30))
    return store, bool(extra.get("write", True))


class SpanStoreConnector(KVConnectorBase_V1):
    """See the module doc."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.store, self.writes = store_for(vllm_config, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._queue_bytes = int(float(extra.get("queue_mib", DEFAULT_QUEUE_MIB)) * 2**20)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        # scheduler side
        self._key = layout_key(create=False)
        self._matched: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: list[tuple[int, bytes, int]] = []
        self._saves: list[tuple[int, bytes, int]] = []
        self._saving: set[bytes] = set()
        # worker side
        self._caches: list[torch.Tensor] = []
        self._failed: set[int] = set()
        self._writer: _Writer | None = None
        if role == KVConnectorRole.SCHEDULER:
            _SCHEDULER[:] = [self]
        else:
            _WORKERS[:] = [self]

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens of ``request`` after its ``num_computed_tokens`` (block-aligned) local hit
        that the store holds, block by block; loaded synchronously (``False``)."""
        self._matched.pop(request.request_id, None)
        request._span_loaded = range(0)
        if request_layout(request, self.block_size, self._key) is None:
            return 0, False
        hashes = list(request.block_hashes)
        start = num_computed_tokens // self.block_size
        end = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        found: list[bytes] = []
        for index in range(start, end):
            key = bytes(hashes[index])
            if not self.store.has(key):
                break
            found.append(key)
        if not found:
            return 0, False
        self._matched[request.request_id] = (start, found)
        # read by the plugin when vLLM registers the request's blocks (inside the allocation)
        request._span_loaded = range(start, start + len(found))
        return len(found) * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Plan the loads of ``request``'s matched blocks into the blocks allocated for them."""
        matched = self._matched.pop(request.request_id, None)
        count = num_external_tokens // self.block_size
        if matched is None or count <= 0:
            request._span_loaded = range(0)
            return
        start, keys = matched
        block_ids = blocks.get_block_ids()[0]
        for offset, key in enumerate(keys[:count]):
            index = start + offset
            self._loads.append((block_ids[index], key, index * self.block_size))
        request._span_loaded = range(start, start + count)
        STATS.store_hit_blocks += count

    def note_registered(self, request: Any, layout: Any, blocks: list, first: int,
                        keep: list[bool]) -> None:
        """The plugin registered ``request``'s blocks ``first..first+len(keep)`` (where
        ``keep``): queue the span and span-prefix ones the store lacks for writing."""
        if not self.writes:
            return
        loaded = getattr(request, "_span_loaded", range(0))
        first_span = next((start for start, kind in zip(layout.starts, layout.kinds,
                                                        strict=True) if kind != ORDERED), None)
        hashes = request.block_hashes
        for offset, ok in enumerate(keep):
            index = first + offset
            if not ok or index in loaded or index >= len(hashes):
                continue
            if not (layout.is_span(index) or (first_span is not None and index < first_span)):
                continue
            key = bytes(hashes[index])
            if key in self._saving or self.store.has(key):
                continue
            self._saving.add(key)
            self._saves.append((blocks[index].block_id, key, index * self.block_size))

    def build_connector_meta(self, scheduler_output: Any) -> SpanStoreMetadata:
        """This step's loads and saves (then forgotten here)."""
        meta = SpanStoreMetadata(self._loads, self._saves)
        self._loads, self._saves = [], []
        self._saving.clear()  # a block saved again later is skipped by the writer if it exists
        return meta

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep every layer's KV cache, in the KV cache group's layer order."""
        self._caches = [kv_caches[name] for name in self._layer_names]

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.unflatten(0, (self._num_blocks, -1))

    def block_shape(self) -> tuple[int, ...]:
        """The payload shape of one block: ``[layers, *one layer's block]``."""
        return (len(self._caches), *self._blocks(self._caches[0]).shape[1:])

    def block_dtype(self) -> torch.dtype:
        """The KV cache's dtype (what a block's payload holds)."""
        return self._caches[0].dtype

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Fill this step's loaded blocks (checked, then rotated to their positions)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpanStoreMetadata) or not meta.loads:
            return
        views = [self._blocks(cache) for cache in self._caches]
        moves: list[tuple[int, int]] = []
        for block_id, key, position in meta.loads:
            targets = [view[block_id] for view in views]
            direct = all(t.device.type == "cpu" and t.is_contiguous() for t in targets)
            staging = targets if direct else [torch.empty(t.shape, dtype=t.dtype)
                                              for t in targets]
            stored_at = self.store.read_into(key, staging)  # straight into the KV cache
            if stored_at is None:
                self._failed.add(block_id)
                STATS.store_bad_blocks += 1
                continue
            if not direct:
                for target, layer in zip(targets, staging, strict=True):
                    target.copy_(layer)
            if stored_at != position:
                moves.append((block_id, position - stored_at))
        if moves:
            from span_vllm.worker import active_rotation

            rotation = active_rotation()
            if rotation is None:  # cannot rotate: recompute those blocks
                self._failed.update(block_id for block_id, _ in moves)
            else:
                rotation.apply(moves)
                STATS.repositioned_tokens += len(moves) * self.block_size

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole before the forward pass: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Blocks are saved whole after the forward pass (:meth:`wait_for_save`)."""

    def wait_for_save(self) -> None:
        """Copy this step's new blocks out of the KV cache into host memory and hand them to
        the writer. On a GPU the copies are queued on the current stream after the forward
        pass, into pinned memory, and the writer waits for their event before reading; a
        block that would take the writer's queue past its bound is dropped (counted)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, SpanStoreMetadata) or not meta.saves:
            return
        views = [self._blocks(cache) for cache in self._caches]
        if self._writer is None:
            self._writer = _Writer(self.store, self._queue_bytes)
        for block_id, key, position in meta.saves:
            layers = [view[block_id] for view in views]
            nbytes = sum(layer.numel() * layer.element_size() for layer in layers)
            if not self._writer.reserve(nbytes):
                STATS.store_dropped_blocks += 1
                continue
            payload, ready = _to_host(layers)
            self._writer.put((key, position, payload, ready, nbytes))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose file was missing or unsound this step: vLLM evicts them and fails
        their requests (which the planner runs again, the spans prepared)."""
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        """Finish the queued writes."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _to_host(layers: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """One block's layers stacked in host memory, and what to wait on before reading it (a
    CUDA event recorded after the copies on the current stream; ``None`` on the CPU)."""
    if layers[0].device.type == "cpu":
        return torch.stack(layers), None
    host = torch.empty((len(layers), *layers[0].shape), dtype=layers[0].dtype,
                       pin_memory=True)
    for target, layer in zip(host.unbind(0), layers, strict=True):
        target.copy_(layer, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


class _Writer:
    """One background thread writing queued blocks to the store, in order, holding at most
    ``max_bytes`` of them at once (:meth:`reserve`)."""

    def __init__(self, store: SpanStore, max_bytes: int) -> None:
        self._store = store
        self._max_bytes = max_bytes
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, int, torch.Tensor, Any, int] | None] = (
            queue.Queue())
        self._thread = threading.Thread(target=self._run, name="span-store-writer",
                                        daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` may be queued now (then counted until written)."""
        with self._bytes_lock:
            if self._queued_bytes + nbytes > self._max_bytes:
                return False
            self._queued_bytes += nbytes
            return True

    def put(self, item: tuple[bytes, int, torch.Tensor, Any, int]) -> None:
        self._queue.put(item)

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, position, payload, ready, nbytes = item
                try:
                    if ready is not None:
                        ready.synchronize()  # the copies out of the KV cache are done
                    if self._store.write(key, position, payload):
                        STATS.store_written_blocks += 1
                finally:
                    with self._bytes_lock:
                        self._queued_bytes -= nbytes
            except OSError:  # a full or read-only disk: the block stays unsaved
                STATS.store_write_errors += 1
            finally:
                self._queue.task_done()


def scheduler_connector() -> SpanStoreConnector | None:
    """The scheduler-side span store connector of this process, if one was built."""
    return _SCHEDULER[0] if _SCHEDULER else None


def local_store() -> tuple[SpanStore, tuple[int, ...], torch.dtype] | None:
    """The store of the engine in this process (scheduler and worker here: an in-process
    engine), with the shape (``[layers, *one layer's block]``) and dtype of its blocks;
    ``None`` without one."""
    if not _WORKERS or not _WORKERS[0]._caches:
        return None
    worker = _WORKERS[0]
    return worker.store, worker.block_shape(), worker.block_dtype()


def flush_writes() -> None:
    """Wait for this process's queued store writes (tests and tools; serving never waits)."""
    for connector in _WORKERS:
        if connector._writer is not None:
            connector._writer.flush()

