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
  file, which is never read (and is removed when a store is next opened there, or by an
  eviction pass, once it is :data:`STALE_TEMP_S` old).
* **A size cap for the directory.** ``max_bytes`` bounds the block files of every namespace
  under the root together (an old model's blocks count, and go first when least recently
  used), counted across processes: every writer adds its bytes to the root's ledger
  (:data:`LEDGER`, under an exclusive ``flock``), which each open recounts from the files.
  Past the cap the least recently used blocks (by modification time, refreshed on every read)
  of any namespace are removed down to 90 % of it.

It depends on torch and ``xxhash`` only (no vLLM), so tools can open a store directly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
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
#: the file at a store's root holding the bytes of every namespace's block files
LEDGER = ".bytes"
#: a temporary block file older than this (seconds) was left by a writer that died
STALE_TEMP_S = 600
_TMP = ".tmp-"
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                               torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)}


def namespace(model: Mapping[str, Any], block_size: int, dtype: torch.dtype,
              block_shape: tuple[int, ...]) -> str:
    """The directory name for blocks of one model and KV layout (hex digest of all of it)."""
    text = json.dumps({"format": FORMAT_VERSION, "model": dict(model), "block_size": block_size,
                       "dtype": str(dtype), "block_shape": list(block_shape)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_identity(model_dir: str | Path, *, revision: str | None = None) -> dict[str, Any]:
    """What names a model's weights. A directory with a span-workflows manifest: the SHA-256
    the manifest lists for each file, with each listed file's size and modification time (a
    file changed after the manifest was written changes the identity); a directory without
    one: each weight and config file's name, size, modification time and an xxh3 digest of
    its first and last MiB; a hub id: its name and ``revision`` (``None``: the default
    branch, as the engine resolved it then)."""
    root = Path(model_dir)
    manifest = root / "span-workflows-manifest.json"
    try:
        listed = json.loads(manifest.read_text())["files"]
        return {"files": {name: [digest, *_stat(root / name)]
                          for name, digest in sorted(dict(listed).items())}}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not root.is_dir():
        return {"name": str(model_dir), "revision": revision}
    files = {}
    for path in sorted(root.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".json", ".gguf", ".pt") and path.is_file():
            files[path.name] = [*_stat(path), _ends_digest(path)]
    return {"path": str(root.resolve()), "files": files}


def engine_identity(vllm_config: Any) -> dict[str, Any]:
    """What else an engine's KV bytes depend on besides the weights and the KV layout: the
    weights' dtype, quantization, ``hf_overrides`` (RoPE scaling among them), the revision,
    the attention backend and the device's compute capability (which choose the kernels and
    their block split), the KV cache's dtype setting, and the vLLM and plugin versions."""
    model = vllm_config.model_config
    overrides = getattr(model, "hf_overrides", None)
    attention = getattr(vllm_config, "attention_config", None)
    capability = None
    try:
        from vllm.platforms import current_platform

        found = current_platform.get_device_capability()
        if found is not None:
            capability = f"{found.major}.{found.minor}"
    except Exception:  # noqa: BLE001 (no platform information: the namespace goes without)
        pass
    return {
        "dtype": str(getattr(model, "dtype", None)),
        "quantization": getattr(model, "quantization", None),
        "hf_overrides": (overrides.__qualname__ if callable(overrides)
                         else json.dumps(overrides or {}, sort_keys=True, default=str)),
        "revision": getattr(model, "revision", None),
        "attention_backend": str(getattr(attention, "backend", None)),
        "cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", None)),
        "device_capability": capability,
        "versions": {"vllm": _vllm_version(), "span-vllm": _version("span-vllm")},
    }


def _stat(path: Path) -> list[int]:
    try:
        stat = path.stat()
    except OSError:
        return [-1, -1]
    return [stat.st_size, stat.st_mtime_ns]


def _ends_digest(path: Path, span: int = 1 << 20) -> str:
    """xxh3-64 of the first and last ``span`` bytes of ``path`` (cheap for any size)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        digest.update(f.read(span))
        f.seek(max(0, os.fstat(f.fileno()).st_size - span))
        digest.update(f.read(span))
    return digest.hexdigest()


def _vllm_version() -> str | None:
    """vLLM's version (its CPU build installs under another distribution name)."""
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", None))


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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
        try:  # old temporaries go, the ledger starts from the files
            with self._ledger() as total:
                total[0] = self.root_bytes(clean=True)
        except OSError:  # a read-only store: nothing to count or clean
            pass

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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP, suffix=SUFFIX)
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
        yield from _block_files(self.directory)

    def size_bytes(self) -> int:
        """Bytes of this namespace's block files (scanned)."""
        return sum(_size(entry) for entry in self.files())

    def root_bytes(self, *, clean: bool = False) -> int:
        """Bytes of the block files of every namespace under the root (scanned); ``clean``
        also removes temporary files older than :data:`STALE_TEMP_S`."""
        return sum(size for _, size, _ in self._root_blocks(clean=clean))

    def _root_blocks(self, *, clean: bool) -> list[tuple[int, int, str]]:
        """``(mtime_ns, size, path)`` of every block file under the root."""
        found = []
        for space in _subdirs(self.root):
            for shard in _subdirs(Path(space.path)):
                for entry in _scandir(Path(shard.path)):
                    try:
                        stat = entry.stat()
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(_TMP):
                        if clean and stat.st_mtime < _now() - STALE_TEMP_S:
                            _unlink(entry.path)
                    elif entry.name.endswith(SUFFIX):
                        found.append((stat.st_mtime_ns, stat.st_size, entry.path))
        return found

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[list[int]]:
        """The root's byte count as a one-item list, held under an exclusive ``flock`` (every
        process that opens the store takes it) and written back on leaving."""
        fd = os.open(self.root / LEDGER, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                total = [int(os.pread(fd, 32, 0) or b"0")]
            except ValueError:
                total = [self.root_bytes()]
            yield total
            data = str(max(0, total[0])).encode()
            os.pwrite(fd, data.ljust(32), 0)
        finally:
            os.close(fd)  # and the lock with it

    def _grow(self, size: int) -> None:
        """Count ``size`` new bytes in the root's ledger; past ``max_bytes``, evict."""
        with self._lock, self._ledger() as total:
            total[0] += size
            if self.max_bytes is not None and total[0] > self.max_bytes:
                total[0] = self._evict_locked(int(self.max_bytes * 0.9))

    def evict(self, target_bytes: int) -> int:
        """Remove the least recently used blocks of any namespace under the root (and stale
        temporary files) until the root holds at most ``target_bytes``; returns the bytes
        left."""
        with self._lock, self._ledger() as total:
            total[0] = self._evict_locked(target_bytes)
            return total[0]

    def _evict_locked(self, target_bytes: int) -> int:
        entries = self._root_blocks(clean=True)
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= target_bytes:
                break
            if _unlink(path):
                total -= size
                self.stats.evicted_blocks += 1
        return total


def _block_files(directory: Path) -> Iterator[os.DirEntry[str]]:
    for shard in _subdirs(directory):
        for entry in _scandir(Path(shard.path)):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith(_TMP):
                yield entry


def _subdirs(directory: Path) -> list[os.DirEntry[str]]:
    return [entry for entry in _scandir(directory) if entry.is_dir()]


def _scandir(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _size(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat().st_size
    except FileNotFoundError:
        return 0


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
