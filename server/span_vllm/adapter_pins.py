"""LoRA adapters pinned to the content their KV blocks are keyed by.

vLLM loads a LoRA adapter from its ``lora_path`` whenever a worker needs it: at ``add_lora``,
at a request's first use, and again after the adapter was evicted from the workers' LoRA slots
(``max_loras``, ``max_cpu_loras``). The plugin keys every KV block computed under an adapter
by the digest of its files (:func:`span_vllm.hashing.weights_key`). Were the files at
``lora_path`` rewritten between two loads (a retraining run saving in place), blocks keyed by
the first content would be read beside tokens computed by the second: an answer of neither.

So the engine core pins each adapter id to an immutable, content-addressed copy of its
``adapter_*`` files (all vLLM reads) and points every request of that id at the copy. Whatever
reloads the adapter, on whichever worker, loads exactly the weights its blocks are keyed by.
An explicit reload (``add_lora`` with ``load_inplace``) pins the files anew, under a new
digest; ``remove_lora`` forgets the pin. A ``lora_path`` that is not a local directory (a hub
id: vLLM's download is immutable per revision) is not copied.

Copies live in ``SPAN_VLLM_ADAPTER_DIR`` (default ``~/.cache/span-vllm/adapters``), one
directory per digest, shared by every engine on the machine; they can be deleted while no
engine runs. An engine whose workers span several nodes needs a directory they all see.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from span_vllm.contract import adapter_digest

logger = logging.getLogger(__name__)

#: Where pinned copies live (one directory per content digest).
ADAPTER_DIR_ENV = "SPAN_VLLM_ADAPTER_DIR"


@dataclass(frozen=True)
class Pin:
    """Adapter ``lora_int_id`` as loaded from ``source``: its copy ``path`` and the copy's
    ``digest`` (the adapter's weights key)."""

    source: str
    path: str
    digest: str


def snapshot_root() -> Path:
    """The directory of pinned copies."""
    configured = os.environ.get(ADAPTER_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "span-vllm" / "adapters"


def snapshot(source: str | Path, root: Path | None = None) -> tuple[Path, str]:
    """An immutable copy of the ``adapter_*`` files of the adapter directory ``source``:
    ``(its directory, its digest)``. The files are copied first and the *copy* hashed, so the
    digest names exactly what the copy holds even if ``source`` is being rewritten. A copy
    of the same content already there is reused."""
    root = snapshot_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".pin-", dir=root))
    try:
        for path in sorted(Path(source).expanduser().glob("adapter_*")):
            if path.is_file():
                shutil.copyfile(path, staging / path.name)
        digest = adapter_digest(staging)
        final = root / digest
        if not final.is_dir():
            try:
                staging.rename(final)
            except OSError:  # another engine pinned the same content meanwhile
                if not final.is_dir():
                    raise
        return final, digest
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


class AdapterPins:
    """The engine core's pins, by ``lora_int_id`` (thread-safe: requests are preprocessed on
    the engine core's input thread, ``add_lora`` runs on its main thread)."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._pins: dict[int, Pin] = {}
        self._lock = threading.Lock()

    def pin(self, lora_request: Any, reload: bool = False) -> Any:
        """``lora_request`` pointed at its adapter id's pinned copy (a copy of the request;
        the caller's object is left as it was), pinning the files at its path if the id has
        none yet, or anew when ``reload``. Every request of an id reads the id's copy,
        whatever path it names: vLLM serves an id with the weights it loaded for it.
        ``lora_request`` itself for ``None``, for a path that is not a local directory, or
        when the copy fails (logged: the adapter is then keyed by its files as they are)."""
        if lora_request is None:
            return None
        lora_id = int(lora_request.lora_int_id)
        with self._lock:
            pin = self._pins.get(lora_id)
            if pin is None or reload:
                pin = self._new_pin(str(lora_request.lora_path))
                if pin is None:
                    return lora_request
                self._pins[lora_id] = pin
        if lora_request.lora_path == pin.path:
            return lora_request
        pinned = copy.copy(lora_request)
        pinned.lora_path = pin.path
        return pinned

    def forget(self, lora_id: int) -> None:
        """The adapter ``lora_id`` was removed: its next load pins its files anew."""
        with self._lock:
            self._pins.pop(int(lora_id), None)

    def pinned(self, lora_id: int) -> Pin | None:
        """The pin of ``lora_id``, if any."""
        with self._lock:
            return self._pins.get(int(lora_id))

    def _new_pin(self, source: str) -> Pin | None:
        root = self._root or snapshot_root()
        where = Path(source).expanduser()
        if not where.is_dir():
            return None
        if where.parent == root:  # already a pinned copy (its name is its digest)
            return Pin(source, source, where.name)
        try:
            path, digest = snapshot(source, root)
        except OSError as error:
            logger.warning("span_vllm: could not copy the LoRA adapter %s to %s (%s); it is "
                           "keyed by its files as they are now, and a rewrite of them before "
                           "a reload would not be seen", source, root, error)
            return None
        return Pin(source, str(path), digest)


#: The pins of this process's engine core.
PINS = AdapterPins()

__all__ = ["ADAPTER_DIR_ENV", "PINS", "AdapterPins", "Pin", "snapshot", "snapshot_root"]
