"""The span store: KV blocks of spans in a directory, keyed by their block hash.

One file per KV block, ``<root>/<namespace>/<key[:2]>/<key>.kv``, where ``key`` is the block's
hash as the plugin computes it (:mod:`span_vllm.hashing`: it names the block's tokens, the
context its KV was computed in, the tenant's ``cache_salt`` and the LoRA adapter's content
digest) and ``namespace`` digests everything else the bytes depend on: the model's weights,
the block size, the KV cache's dtype and per-block shape, and this format's version. A changed
model, adapter or tenant therefore never reads another's blocks: its keys differ.

A file (format :data:`FORMAT_VERSION`) is ``MAGIC``, an xxh3-64 checksum, the header's length
(``u32``), the header (JSON: format, namespace, key, position, dtype, shape) and the payload:
the block's K and V in every layer, exactly as the KV cache holds them, keys rotated for the
position the block was computed at (the header's ``position``; the loader rotates them to where
the reader needs them, as for any cached block). The checksum covers everything after it — the
header's length, the header and the payload — so a changed ``position`` digit is a corrupt
file, not keys rotated for the wrong position; the header's namespace must be the reader's, so
a file of another model or layout placed under the same key is foreign.

Guarantees:

* **Never wrong bytes.** :meth:`SpanStore.read_into` returns ``None`` for a missing,
  truncated, corrupt or foreign file (wrong magic or format, namespace, key, shape, dtype or
  checksum), counts why and removes such an unsound file; the caller then computes the block
  (and writes it anew). A file that cannot be opened or read right now (no permission, no
  file descriptor left, an I/O error) is a miss too, but says nothing about its content: it is
  counted as unreadable and left in place.
* **Atomic writes.** A block is written to a temporary file in its directory and renamed into
  place (``os.replace``): readers see the whole file or none, two engines writing the same
  block at once leave one whole copy, and a writer killed mid-write leaves only a temporary
  file, which is never read (and is removed by the next eviction pass).
* **A size cap.** ``max_bytes`` bounds the namespace's files; past it the least recently used
  blocks (by modification time, refreshed on every read) are removed down to 90 % of the cap.

It depends on torch and ``xxhash`` only (no vLLM), so tools can open a store directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

#: Every format version's magic starts so; this one's ends with its version.
_MAGIC_STEM = b"SPANKV"
FORMAT_VERSION = 2
MAGIC = _MAGIC_STEM + str(FORMAT_VERSION).encode() + b"\n"
SUFFIX = ".kv"
#: xxh3-64 of everything after it (header length, header, payload)
_CHECKSUM = struct.Struct("<Q")
_HEADER_LEN = struct.Struct("<I")
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                               torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)}


def namespace(model: Mapping[str, Any], block_size: int, dtype: torch.dtype,
              block_shape: tuple[int, ...]) -> str:
    """The directory name for blocks of one model and KV layout (hex digest of all of it)."""
    text = json.dumps({"format": FORMAT_VERSION, "model": dict(model), "block_size": block_size,
                       "dtype": str(dtype), "block_shape": list(block_shape)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_identity(model_dir: str | Path) -> dict[str, Any]:
    """What names a model's weights: the SHA-256 of every file its span-workflows manifest
    lists (bundled and converted models carry one), else the name, size and modification time
    of each weight and config file (a local directory without a manifest; a hub id: its name)."""
    root = Path(model_dir)
    manifest = root / "span-workflows-manifest.json"
    try:
        return {"files": json.loads(manifest.read_text())["files"]}
    except (OSError, ValueError, KeyError):
        pass
    if not root.is_dir():
        return {"name": str(model_dir)}
    files = {}
    for path in sorted(root.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".json", ".gguf", ".pt") and path.is_file():
            stat = path.stat()
            files[path.name] = [stat.st_size, stat.st_mtime_ns]
    return {"path": str(root.resolve()), "files": files}


@dataclass
class StoreStats:
    """What a store did since it was opened (this process)."""

    read_blocks: int = 0
    missing_blocks: int = 0
    bad_blocks: int = 0
    #: files there that could not be opened or read (left in place: their content is unknown)
    unreadable_blocks: int = 0
    written_blocks: int = 0
    evicted_blocks: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def bad(self, reason: str) -> None:
        """Count an unsound file, by ``reason``."""
        self.bad_blocks += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class SpanStore:
    """One namespace of a span store directory (see the module doc)."""

    def __init__(self, root: str | Path, space: str, *, max_bytes: int | None = None) -> None:
        self.root = Path(root).expanduser()
        #: the namespace (:func:`namespace`): the directory name, recorded in every header
        self.space = space
        self.directory = self.root / space
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._bytes: int | None = None

    # -- keys ----------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        """Where the block of hash ``key`` lives."""
        name = key.hex()
        return self.directory / name[:2] / (name + SUFFIX)

    def has(self, key: bytes) -> bool:
        """Whether a file for ``key`` exists and this process may read it (not yet whether it
        is sound: :meth:`read` says). A file without read permission is left on disk but not
        offered, so its block is computed instead of promised and failed on every try."""
        path = self.path(key)
        return path.is_file() and os.access(path, os.R_OK)

    # -- reading -------------------------------------------------------------------------------
    def read(self, key: bytes, shape: tuple[int, ...], dtype: torch.dtype
             ) -> tuple[int, torch.Tensor] | None:
        """``(position, payload)`` of the block ``key`` (payload of ``shape`` and ``dtype``), or
        ``None`` where the file is missing, unreadable or not sound (as :meth:`read_into`)."""
        payload = torch.empty(shape, dtype=dtype)
        position = self.read_into(key, list(payload.unbind(0)))
        return None if position is None else (position, payload)

    def read_into(self, key: bytes, layers: list[torch.Tensor]) -> int | None:
        """Read the block ``key`` straight into ``layers`` (one contiguous CPU tensor per
        layer, in the payload's order: a KV cache's blocks) and return the position its keys
        are rotated for; ``None`` where the file is missing, cannot be opened or read, or is
        not sound (counted in :attr:`stats`). After ``None`` the tensors may hold part of the
        file: the caller must not use them (the loader has vLLM recompute the block).

        Only a file whose content is wrong is removed (so the block is computed and written
        anew), and only if it is still the file that was read; one that could not be opened
        or read (``OSError``: permissions, file descriptors, I/O) is left as it is."""
        path = self.path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            self.stats.missing_blocks += 1
            return None
        except OSError:
            self.stats.unreadable_blocks += 1
            return None
        with f:
            try:
                checked = self._check(f, key, layers)
                opened = os.fstat(f.fileno())
            except OSError:
                self.stats.unreadable_blocks += 1
                return None
        if isinstance(checked, str):
            self.stats.bad(checked)
            _unlink_if_same(path, opened)
            return None
        position, size = checked
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass
        self.stats.read_blocks += 1
        self.stats.read_bytes += size
        return position

    def _check(self, f: Any, key: bytes, layers: list[torch.Tensor]) -> tuple[int, int] | str:
        """``(position, payload bytes)`` of the open block file ``f``, its payload read into
        ``layers``, or why it is not block ``key`` of this namespace (``OSError`` passes)."""
        shape = (len(layers), *layers[0].shape)
        dtype = layers[0].dtype
        preamble = len(MAGIC) + _CHECKSUM.size + _HEADER_LEN.size
        head = f.read(preamble)
        if len(head) < preamble or not head.startswith(MAGIC):
            return ("another format version" if head.startswith(_MAGIC_STEM)
                    else "not a span store block")
        (checksum,) = _CHECKSUM.unpack_from(head, len(MAGIC))
        (length,) = _HEADER_LEN.unpack_from(head, len(MAGIC) + _CHECKSUM.size)
        data = f.read(length)
        if len(data) != length:
            return "truncated"
        digest = xxhash.xxh3_64(head[len(MAGIC) + _CHECKSUM.size:])
        digest.update(data)
        header = _header(data, self.space, key, shape, dtype)
        if isinstance(header, str):
            return header
        size = 0
        for layer in layers:
            target = memoryview(layer.view(torch.uint8).numpy()).cast("B")
            got = f.readinto(target)
            if got != len(target):
                return "truncated"
            digest.update(target)
            size += got
        if f.read(1):
            return "longer than its header says"
        if digest.intdigest() != checksum:
            return "checksum mismatch"
        return header, size

    # -- writing -------------------------------------------------------------------------------
    def write(self, key: bytes, position: int, payload: torch.Tensor) -> bool:
        """Store ``payload`` (the block's bytes, keys at ``position``) under ``key`` atomically;
        ``False`` if a file for it exists already (it is left alone)."""
        path = self.path(key)
        if path.exists():
            return False
        payload = payload.detach().contiguous().cpu()
        raw = payload.view(torch.uint8).numpy().tobytes() if payload.numel() else b""
        header = json.dumps({"format": FORMAT_VERSION, "namespace": self.space,
                             "key": key.hex(), "position": int(position),
                             "dtype": str(payload.dtype),
                             "shape": list(payload.shape)}).encode()
        length = _HEADER_LEN.pack(len(header))
        digest = xxhash.xxh3_64(length)
        digest.update(header)
        digest.update(raw)
        checksum = _CHECKSUM.pack(digest.intdigest())
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + checksum + length + header + raw)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        size = len(MAGIC) + len(checksum) + len(length) + len(header) + len(raw)
        self.stats.written_blocks += 1
        self.stats.written_bytes += size
        self._grow(size)
        return True

    # -- size ----------------------------------------------------------------------------------
    def files(self) -> Iterator[os.DirEntry[str]]:
        """Every block file of this namespace (temporary files excluded)."""
        for shard in os.scandir(self.directory):
            if shard.is_dir():
                for entry in os.scandir(shard.path):
                    if entry.name.endswith(SUFFIX) and not entry.name.startswith(".tmp-"):
                        yield entry

    def size_bytes(self) -> int:
        """Bytes of this namespace's block files (scanned)."""
        return sum(entry.stat().st_size for entry in self.files())

    def _grow(self, size: int) -> None:
        if self.max_bytes is None:
            return
        with self._lock:
            if self._bytes is None:
                self._bytes = self.size_bytes()
            else:
                self._bytes += size
            if self._bytes > self.max_bytes:
                self._bytes = self.evict(int(self.max_bytes * 0.9))

    def evict(self, target_bytes: int) -> int:
        """Remove least recently used blocks (and stale temporary files) until the namespace
        holds at most ``target_bytes``; returns the bytes left."""
        entries = []
        for shard in os.scandir(self.directory):
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard.path):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".tmp-"):
                    if stat.st_mtime < _now() - 600:  # a writer that died long ago
                        _unlink(entry.path)
                    continue
                entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= target_bytes:
                break
            if _unlink(path):
                total -= size
                self.stats.evicted_blocks += 1
        return total


def _header(data: bytes, space: str, key: bytes, shape: tuple[int, ...], dtype: torch.dtype
            ) -> int | str:
    """The position from a block's header, or why the file is not block ``key`` of namespace
    ``space`` with this ``shape`` and ``dtype``."""
    try:
        header = json.loads(data)
        position = int(header["position"])
        stored_shape = tuple(int(n) for n in header["shape"])
        stored_dtype = _DTYPES[header["dtype"]]
        stored_key = str(header["key"])
        stored_space = str(header["namespace"])
        stored_format = int(header["format"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return "bad header"
    if stored_format != FORMAT_VERSION:
        return "another format version"
    if stored_space != space:
        return "another namespace"
    if stored_key != key.hex():
        return "another block's file"
    if stored_shape != tuple(shape) or stored_dtype != dtype:
        return "another layout"
    return position


def _now() -> float:
    import time

    return time.time()


def _unlink_if_same(path: Path, read: os.stat_result) -> None:
    """Remove the unsound file at ``path`` if it is still the one that was read (``read``: its
    ``fstat``), not a sound one a writer renamed into place meanwhile."""
    try:
        now = os.stat(path)
    except OSError:
        return
    if (now.st_dev, now.st_ino) == (read.st_dev, read.st_ino):
        _unlink(str(path))


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
