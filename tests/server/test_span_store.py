"""The span store's files (no engine): what is read back is what was written, and nothing else.

Every unsound file — truncated, corrupt, another block's, another layout's, left by a killed
writer — reads as a miss, never as bytes; concurrent writers leave one whole file; the size cap,
the whole directory's and shared by every process, evicts the least recently used blocks
first; the namespace separates models, engines and layouts; the writer's queue is bounded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import xxhash

import span_vllm.store as store_module
from span_vllm.store import (
    LEDGER,
    STALE_TEMP_S,
    SpanStore,
    engine_identity,
    model_identity,
    namespace,
)
from span_vllm.store_connector import _to_host, _Writer

SHAPE = (3, 2, 4, 8)  # layers, heads, block size, 2 x head size


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def key(n: int) -> bytes:
    return n.to_bytes(32, "big")


def read(store: SpanStore, k: bytes) -> tuple[int, torch.Tensor] | None:
    return store.read(k, SHAPE, torch.float32)


def test_a_block_reads_back_exactly_with_its_position(tmp_path: Path) -> None:
    store = SpanStore(tmp_path, "ns")
    payload = block(0)
    assert store.write(key(1), 96, payload)
    assert not store.write(key(1), 96, block(1))  # the first copy stays
    position, back = read(store, key(1))
    assert position == 96
    assert torch.equal(back, payload)
    layers = [torch.empty(SHAPE[1:]) for _ in range(SHAPE[0])]
    assert store.read_into(key(1), layers) == 96
    assert torch.equal(torch.stack(layers), payload)
    assert store.stats.read_blocks == 2 and store.stats.bad_blocks == 0


def test_a_missing_block_is_a_miss(tmp_path: Path) -> None:
    store = SpanStore(tmp_path, "ns")
    assert read(store, key(2)) is None
    assert store.stats.missing_blocks == 1 and not store.has(key(2))


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "garbage", "header"])
def test_a_damaged_file_is_a_miss_and_counted(tmp_path: Path, damage: str) -> None:
    store = SpanStore(tmp_path, "ns")
    store.write(key(3), 0, block(3))
    path = store.path(key(3))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 17]
    elif damage == "flip":
        data[-5] ^= 0x40
    elif damage == "extend":
        data += b"\0"
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data[data.index(b'{"')] = ord("}")  # the header's JSON broken
    path.write_bytes(bytes(data))
    assert read(store, key(3)) is None
    assert store.stats.bad_blocks == 1, store.stats.reasons
    assert not store.has(key(3))  # removed: computed and written anew next time
    assert store.write(key(3), 0, block(3)) and read(store, key(3)) is not None


def test_another_blocks_file_under_a_key_is_a_miss(tmp_path: Path) -> None:
    store = SpanStore(tmp_path, "ns")
    store.write(key(4), 0, block(4))
    store.path(key(5)).parent.mkdir(parents=True, exist_ok=True)
    store.path(key(5)).write_bytes(store.path(key(4)).read_bytes())
    assert read(store, key(5)) is None
    assert store.stats.reasons == {"another block's file": 1}


def test_a_block_of_another_layout_is_a_miss(tmp_path: Path) -> None:
    store = SpanStore(tmp_path, "ns")
    store.write(key(6), 0, block(6))
    assert store.read(key(6), (3, 2, 4, 4), torch.float32) is None
    store.write(key(6), 0, block(6))
    assert store.read(key(6), SHAPE, torch.float16) is None
    assert store.stats.reasons == {"another layout": 2}


def _write_many(root: str, seed: int) -> None:
    store = SpanStore(root, "ns")
    for n in range(40):
        store.write(key(1000 + n), n * 32, block(n))


def test_concurrent_writers_leave_whole_files(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), s)) for s in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = SpanStore(tmp_path, "ns")
    for n in range(40):
        position, back = read(store, key(1000 + n))
        assert position == n * 32 and torch.equal(back, block(n))
    assert not [p for p in (tmp_path / "ns").rglob(".tmp-*")]


def test_a_writer_killed_mid_write_leaves_a_store_that_loads(tmp_path: Path) -> None:
    store = SpanStore(tmp_path, "ns")
    store.write(key(7), 0, block(7))
    # A writer that dies (SIGKILL) after writing part of a block's temporary file.
    script = textwrap.dedent(f"""
        import os, signal, tempfile
        import span_vllm.store as s
        real = os.replace
        def die(src, dst):
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = die
        import torch
        store = s.SpanStore({str(tmp_path)!r}, "ns")
        store.write((8).to_bytes(32, "big"), 0, torch.ones{SHAPE!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert list((tmp_path / "ns").rglob(".tmp-*")), "the killed writer left no partial file"
    store = SpanStore(tmp_path, "ns")
    assert read(store, key(8)) is None and not store.has(key(8))
    assert torch.equal(read(store, key(7))[1], block(7))
    assert store.size_bytes() == store.path(key(7)).stat().st_size  # partial files not counted


def test_the_cap_evicts_the_least_recently_used_blocks(tmp_path: Path) -> None:
    one = SpanStore(tmp_path / "probe", "ns")
    one.write(key(0), 0, block(0))
    size = one.size_bytes()
    store = SpanStore(tmp_path / "store", "ns", max_bytes=int(size * 4.5))
    for n in range(4):
        store.write(key(n), 0, block(n))
        os.utime(store.path(key(n)), ns=(n * 10**9, n * 10**9))  # written in this order
    assert read(store, key(0)) is not None  # used again: now the most recent
    store.write(key(4), 0, block(4))  # over the cap: down to 90 % of it
    left = {n for n in range(5) if store.has(key(n))}
    assert 0 in left and 4 in left and 1 not in left
    assert store.size_bytes() <= int(size * 4.5)
    assert store.stats.evicted_blocks == 5 - len(left)


def test_the_namespace_separates_models_and_layouts(tmp_path: Path) -> None:
    model = {"files": {"model.safetensors": "ab"}}
    base = namespace(model, 32, torch.float32, (30, 3, 64, "cpu"))
    assert base == namespace(dict(model), 32, torch.float32, (30, 3, 64, "cpu"))  # stable
    others = {namespace({"files": {"model.safetensors": "cd"}}, 32, torch.float32,
                        (30, 3, 64, "cpu")),
              namespace(model, 16, torch.float32, (30, 3, 64, "cpu")),
              namespace(model, 32, torch.bfloat16, (30, 3, 64, "cpu")),
              namespace(model, 32, torch.float32, (30, 3, 64, "cuda"))}
    assert base not in others and len(others) == 4


def test_a_model_is_named_by_its_manifest_or_its_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    plain = model_identity(tmp_path)
    assert set(plain["files"]) == {"config.json", "model.safetensors"}
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    assert model_identity(tmp_path) != plain
    (tmp_path / "span-workflows-manifest.json").write_text(
        '{"files": {"model.safetensors": "1"}}')
    listed = model_identity(tmp_path)
    assert set(listed["files"]) == {"model.safetensors"}
    assert listed["files"]["model.safetensors"][0] == "1"


def test_a_file_changed_after_its_manifest_changes_the_identity(tmp_path: Path) -> None:
    """A manifest's SHA-256s are not trusted alone: the files' sizes and times go with them."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "span-workflows-manifest.json").write_text(
        '{"files": {"model.safetensors": "ab"}}')
    before = model_identity(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights, retrained")
    assert model_identity(tmp_path) != before


def test_a_same_sized_same_time_rewrite_without_a_manifest_changes_the_identity(
        tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"a" * 4096)
    stat = path.stat()
    before = model_identity(tmp_path)
    path.write_bytes(b"b" * 4096)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert model_identity(tmp_path) != before


def test_a_hub_model_is_named_with_its_revision() -> None:
    assert model_identity("org/model", revision="abc") != model_identity("org/model",
                                                                         revision="def")


def _vllm_config(**changes: object) -> SimpleNamespace:
    model = {"dtype": "float32", "quantization": None, "hf_overrides": {}, "revision": None}
    engine = {"backend": None, "cache_dtype": "auto"}
    for name, value in changes.items():
        (model if name in model else engine)[name] = value
    return SimpleNamespace(model_config=SimpleNamespace(**model),
                           attention_config=SimpleNamespace(backend=engine["backend"]),
                           cache_config=SimpleNamespace(cache_dtype=engine["cache_dtype"]))


def test_the_engine_identity_separates_what_changes_the_kv_bytes() -> None:
    """Weights dtype, quantization, RoPE overrides, revision, attention backend (the kernel
    split) and KV dtype each give another namespace; the same settings the same one."""
    base = engine_identity(_vllm_config())
    assert base == engine_identity(_vllm_config())
    assert base["versions"]["vllm"] and base["versions"]["span-vllm"]
    others = [engine_identity(_vllm_config(**change)) for change in (
        {"dtype": "bfloat16"}, {"quantization": "fp8"},
        {"hf_overrides": {"rope_scaling": {"type": "yarn", "factor": 4.0}}},
        {"revision": "main"}, {"backend": "FLASH_ATTN"}, {"cache_dtype": "fp8"})]
    spaces = {namespace({"weights": {}, "engine": e}, 32, torch.float32, (30, 3, 64, "cuda"))
              for e in [base, *others]}
    assert len(spaces) == 1 + len(others)


def test_the_cap_holds_for_the_whole_directory_old_namespaces_first(tmp_path: Path) -> None:
    """An old model's namespace counts against the cap and its least recently used blocks go
    first; the cap is the directory's, not one namespace's."""
    old = SpanStore(tmp_path, "old-model")
    for n in range(3):
        old.write(key(n), 0, block(n))
        os.utime(old.path(key(n)), ns=(n * 10**9, n * 10**9))
    size = old.path(key(0)).stat().st_size
    new = SpanStore(tmp_path, "new-model", max_bytes=int(size * 4.5))
    for n in range(3):
        new.write(key(10 + n), 0, block(10 + n))
    assert new.root_bytes() <= size * 4.5
    assert not old.has(key(0)) and not old.has(key(1))
    assert all(new.has(key(10 + n)) for n in range(3))


def _write_capped(root: str, first: int, cap: int) -> None:
    store = SpanStore(root, "ns", max_bytes=cap)
    for n in range(first, first + 12):
        store.write(key(n), 0, block(n))


def test_engines_in_several_processes_share_one_cap(tmp_path: Path) -> None:
    """Each process counts every process's bytes (the root's ledger), so three writers of
    twelve blocks each under a ten-block cap leave at most ten blocks."""
    probe = tmp_path / "probe"
    SpanStore(probe, "ns").write(key(0), 0, block(0))
    size = next(probe.rglob("*.kv")).stat().st_size
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_capped, args=(str(tmp_path / "store"), 100 * i,
                                                     size * 10)) for i in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    store = SpanStore(tmp_path / "store", "ns")
    assert store.root_bytes() <= size * 10
    assert int((tmp_path / "store" / LEDGER).read_text()) == store.root_bytes()


def test_opening_a_store_removes_a_dead_writers_old_temporaries(tmp_path: Path) -> None:
    shard = tmp_path / "another-namespace" / "ab"
    shard.mkdir(parents=True)
    stale, fresh = shard / ".tmp-dead.kv", shard / ".tmp-busy.kv"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    SpanStore(tmp_path, "ns")
    assert not stale.exists() and fresh.exists()


def test_the_writer_holds_a_bounded_number_of_bytes() -> None:
    """A disk slower than the engine: blocks past the writer's bound are refused (the
    connector drops and counts them), and the bound frees as blocks are written."""
    release = threading.Event()

    class SlowStore:
        def write(self, key: bytes, position: int, payload: torch.Tensor) -> bool:
            release.wait(30)
            return True

    writer = _Writer(SlowStore(), max_bytes=3 * 100)  # type: ignore[arg-type]
    payload, ready = _to_host([torch.zeros(5, 5), torch.zeros(5, 5)])
    assert ready is None and payload.shape == (2, 5, 5)
    taken = [writer.reserve(100) for _ in range(4)]
    assert taken == [True, True, True, False]
    for n in range(3):
        writer.put((key(n), 0, payload, None, 100))
    release.set()
    writer.flush()
    assert writer.reserve(300)
    writer.close()


@pytest.mark.gpu
def test_a_gpu_block_is_copied_to_pinned_memory_before_the_writer_reads_it() -> None:
    layers = [torch.randn(4, 32, 64, device="cuda") for _ in range(3)]
    expected = torch.stack([layer.cpu() for layer in layers])
    host, ready = _to_host(layers)
    for layer in layers:
        layer.add_(1.0)  # later work on the stream changes the cache, not the copy
    ready.synchronize()
    assert host.is_pinned() and torch.equal(host, expected)


def test_a_changed_position_in_the_header_is_a_miss(tmp_path: Path) -> None:
    """The header is under the checksum: a changed ``position`` digit would rotate the keys
    for the wrong position, so the file is a miss (and removed), not a wrong answer."""
    store = SpanStore(tmp_path, "ns")
    store.write(key(9), 96, block(9))
    path = store.path(key(9))
    data = path.read_bytes()
    assert data.count(b'"position": 96') == 1
    path.write_bytes(data.replace(b'"position": 96', b'"position": 97'))
    assert read(store, key(9)) is None
    assert store.stats.reasons == {"checksum mismatch": 1}
    assert not store.has(key(9))


def test_a_file_from_another_namespace_under_the_same_key_is_a_miss(tmp_path: Path) -> None:
    """The header records the namespace: another model's block copied under the same key
    passes no check."""
    mine, theirs = SpanStore(tmp_path, "ns-mine"), SpanStore(tmp_path, "ns-theirs")
    theirs.write(key(10), 0, block(10))
    mine.path(key(10)).parent.mkdir(parents=True, exist_ok=True)
    mine.path(key(10)).write_bytes(theirs.path(key(10)).read_bytes())
    assert read(mine, key(10)) is None
    assert mine.stats.reasons == {"another namespace": 1}
    assert read(theirs, key(10)) is not None  # where it belongs, it still loads


def test_a_file_of_the_previous_format_is_a_miss(tmp_path: Path) -> None:
    """A file written by format 1 (payload-only checksum, no namespace) is a miss, not an
    error; the format's version is part of the namespace, so such files are not even found
    where a store of this format looks."""
    store = SpanStore(tmp_path, "ns")
    payload = block(11)
    raw = payload.numpy().tobytes()
    header = json.dumps({"key": key(11).hex(), "position": 0, "dtype": "torch.float32",
                         "shape": list(SHAPE), "xxh3": xxhash.xxh3_64_hexdigest(raw)}).encode()
    store.path(key(11)).parent.mkdir(parents=True, exist_ok=True)
    old_file = b"SPANKV1\n" + struct.pack("<I", len(header)) + header + raw
    store.path(key(11)).write_bytes(old_file)
    assert read(store, key(11)) is None and store.stats.bad_blocks == 1
    assert store_module.FORMAT_VERSION > 1
    model = {"files": {"model.safetensors": "ab"}}
    old = json.dumps({"format": 1, "model": model, "block_size": 32, "dtype": "torch.float32",
                      "block_shape": [30, 3, 64, "cpu"]}, sort_keys=True)
    assert namespace(model, 32, torch.float32, (30, 3, 64, "cpu")) != (
        hashlib.sha256(old.encode()).hexdigest()[:32])


@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Permission denied"),
                                   OSError(errno.EMFILE, "Too many open files")])
def test_a_file_that_cannot_be_opened_is_a_miss_and_stays(tmp_path: Path, monkeypatch,
                                                          error: OSError) -> None:
    """Only a file whose content is wrong is removed: one that cannot be opened now (no
    permission, no file descriptor left) is a miss and loads once it can be opened again."""
    store = SpanStore(tmp_path, "ns")
    payload = block(12)
    store.write(key(12), 64, payload)

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(store_module, "open", refuse, raising=False)
    assert read(store, key(12)) is None
    assert store.has(key(12))
    assert store.stats.bad_blocks == 0 and store.stats.unreadable_blocks == 1
    monkeypatch.undo()
    position, back = read(store, key(12))
    assert position == 64 and torch.equal(back, payload)


def test_a_file_without_read_permission_is_not_offered_and_stays(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """The scheduler asks :meth:`SpanStore.has` before it promises a block: a file this
    process may not read is not offered (its block is computed, not promised and failed on
    every retry), and it is left on disk."""
    store = SpanStore(tmp_path, "ns")
    store.write(key(13), 0, block(13))
    path = store.path(key(13))
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        False if Path(p) == path else real(p, mode, **kw)))
    assert not store.has(key(13)) and path.is_file()
    assert not store.write(key(13), 0, block(13))  # the file there is left alone
    monkeypatch.undo()
    assert store.has(key(13)) and read(store, key(13)) is not None
