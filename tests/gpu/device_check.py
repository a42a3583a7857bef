"""Device check of KV repositioning: correctness and throughput on vLLM 0.32's GPU KV layout.

Runs where only torch (and Triton) are installed — no vLLM, no span_workflows, no network:
it loads ``server/span_vllm/rotation.py`` (torch-only) and, on CUDA, ``rotation_triton.py``
straight from this checkout, and builds vLLM 0.32's per-layer KV cache views by hand: one
allocation holding every layer, viewed per layer as ``[blocks * r, heads, tokens, 2 * head]``
with the strides of ``KVCacheLayout.LBNHC`` (FlashAttention / Triton attention default) or
``LBHNC`` (FlashInfer's HND), manager blocks optionally split into ``r`` kernel blocks.

1. correctness — for each layout, dtype (bf16, fp16, fp8 e4m3 with per-layer scales) and
   rotation backend (torch; the fused Triton kernel on CUDA): keys written at position ``p``
   and moved to ``q`` equal keys computed at ``q`` from the same raw keys (within the dtype's
   rounding), values and every other block are bit-identical;
2. throughput — moving 1 / 16 / 256 / 4096 blocks of an 8B-like model (32 layers, 8 KV heads,
   head 128, block 16, bf16) against a plain copy of the same key bytes
   (``index_select`` + ``index_copy_`` per layer): bytes/s of each, and their ratio.

Usage: ``python tests/gpu/device_check.py OUT.json [--device cuda|cpu] [--small]
[--threads N]``. Writes the
JSON report to ``OUT.json`` and exits 1 if a correctness check fails. ``--device cpu --small``
is what ``make test`` runs (``tests/gpu/test_device_check.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "server" / "span_vllm"


def load_rotation() -> tuple[Any, Any]:
    """``span_vllm.rotation`` and ``span_vllm.rotation_triton`` from this checkout, without
    running the package's ``__init__`` (which belongs to the vLLM plugin)."""
    if "span_vllm" not in sys.modules:
        package = types.ModuleType("span_vllm")
        package.__path__ = [str(PACKAGE_DIR)]
        sys.modules["span_vllm"] = package
    return (importlib.import_module("span_vllm.rotation"),
            importlib.import_module("span_vllm.rotation_triton"))


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    head_size: int
    block_size: int

    @property
    def key_bytes_per_block(self) -> int:
        """Key bytes of one manager block over all layers (bf16/fp16)."""
        return self.layers * self.heads * self.block_size * self.head_size * 2


def paged_caches(shape: Shape, num_blocks: int, layout: str, kernel_split: int,
                 dtype: torch.dtype, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM 0.32's per-layer views over one allocation (layer-compact layouts)."""
    kernel_tokens = shape.block_size // kernel_split
    blocks = num_blocks * kernel_split
    content = 2 * shape.head_size
    if layout == "LBNHC":  # physical [L, B, N, H, C]; view [B, H, N, C]
        raw = torch.zeros(shape.layers, blocks, kernel_tokens, shape.heads, content,
                          dtype=dtype, device=device)
        views = [raw[i].transpose(1, 2) for i in range(shape.layers)]
    elif layout == "LBHNC":  # physical [L, B, H, N, C]
        raw = torch.zeros(shape.layers, blocks, shape.heads, kernel_tokens, content,
                          dtype=dtype, device=device)
        views = [raw[i] for i in range(shape.layers)]
    else:
        raise ValueError(layout)
    return raw, views


def rope_keys(raw: torch.Tensor, inv_freq: torch.Tensor, start: int) -> torch.Tensor:
    """Reference RoPE (NeoX pairs), float64: ``raw`` ``[tokens, heads, head]`` placed at
    ``start, start+1, ...``."""
    tokens, _, head = raw.shape
    angles = torch.arange(start, start + tokens, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    half = head // 2
    x1, x2 = raw[..., :half], raw[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _kernel_keys(view: torch.Tensor, block: int, split: int, head: int) -> list[torch.Tensor]:
    """Manager block ``block``'s keys: one ``[tokens, heads, head]`` view per kernel block."""
    return [view[block * split + j][..., :head].transpose(0, 1) for j in range(split)]


def write_keys(view: torch.Tensor, block: int, split: int, keys: torch.Tensor) -> None:
    """Store ``keys`` ``[block_size, heads, head]`` as manager block ``block``'s tokens."""
    parts = _kernel_keys(view, block, split, keys.shape[-1])
    for part, chunk in zip(parts, keys.chunk(split, dim=0), strict=True):
        part.copy_(chunk)


def read_keys(view: torch.Tensor, block: int, split: int, head: int) -> torch.Tensor:
    return torch.cat(_kernel_keys(view, block, split, head), dim=0)


def check_correctness(rotation: Any, device: str, shape: Shape, layout: str, split: int,
                      dtype_name: str, backend: str) -> dict[str, Any]:
    """Move two blocks in a small cache; compare with keys computed at the new positions."""
    torch.manual_seed(0)
    fp8 = dtype_name.startswith("fp8")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "fp8-e4m3": torch.uint8}[dtype_name]
    num_blocks = 8
    raw_alloc, views = paged_caches(shape, num_blocks, layout, split, dtype, device)
    raw_alloc.view(torch.uint8).copy_(
        torch.randint(0, 100, raw_alloc.view(torch.uint8).shape, dtype=torch.uint8))
    rotator = rotation.RopeRotator.from_base(500000.0, shape.head_size)
    rotator.backend = "auto" if backend == "triton" else "torch"
    scales = [0.02 * (i + 1) for i in range(shape.layers)]
    moves = [(2, 4096 - 16), (5, -48)]
    starts = {2: 16, 5: 96}
    raw_keys = {}
    for layer, view in enumerate(views):
        for block, start in starts.items():
            keys = torch.randn(shape.block_size, shape.heads, shape.head_size,
                               dtype=torch.float64)
            raw_keys[layer, block] = keys
            placed = rope_keys(keys, rotator.inv_freq, start)
            if fp8:
                placed = (placed / scales[layer]).float().to(torch.float8_e4m3fn)
                write_keys(view, block, split, placed.view(torch.uint8).to(view.device))
            else:
                write_keys(view, block, split, placed.to(device=view.device, dtype=dtype))
    before = raw_alloc.clone()
    keys_format = rotation.Fp8Keys(torch.float8_e4m3fn, scales) if fp8 else None
    rotator.apply(views, rotation.PagedKeyLayout(shape.head_size, num_blocks), moves,
                  fp8=keys_format)
    worst = 0.0
    for layer, view in enumerate(views):
        for block, delta in moves:
            got = read_keys(view, block, split, shape.head_size)
            got = (got.view(torch.float8_e4m3fn).double() * scales[layer] if fp8
                   else got.double())
            want = rope_keys(raw_keys[layer, block], rotator.inv_freq,
                             starts[block] + delta).to(got.device)
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    bound = {"bf16": 2 ** -7, "fp16": 2 ** -10, "fp32": 1e-5, "fp8-e4m3": 2 ** -2}[dtype_name]
    changed = raw_alloc.view(torch.uint8) != before.view(torch.uint8)
    element = raw_alloc.element_size()
    changed = changed.unflatten(-1, (-1, element)).any(-1)  # per element
    if layout == "LBNHC":
        changed = changed.transpose(2, 3)  # to [L, B*r, H, Nk, C]
    changed = changed.unflatten(1, (num_blocks, split))
    keys_only = not changed[..., shape.head_size:].any().item()
    for block, _ in moves:
        changed[:, block, ..., :shape.head_size] = False
    elsewhere = bool(changed.any().item())
    return {"layout": layout, "kernel_split": split, "dtype": dtype_name, "backend": backend,
            "max_rel_error": worst, "bound": bound, "values_untouched": keys_only,
            "other_blocks_untouched": not elsewhere,
            "ok": worst <= bound and keys_only and not elsewhere}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn: Any, device: str, budget_s: float = 0.3, min_reps: int = 3) -> float:
    """Median seconds of ``fn`` (after a warm-up), repeated within ``budget_s``."""
    fn()
    _sync(device)
    samples = []
    start = time.perf_counter()
    while len(samples) < min_reps or (time.perf_counter() - start < budget_s
                                      and len(samples) < 50):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def measure_throughput(rotation: Any, device: str, shape: Shape, counts: list[int],
                       backends: list[str]) -> list[dict[str, Any]]:
    """Rotation vs plain copy of the same key bytes, per number of moved blocks."""
    num_blocks = 2 * max(counts) + 1
    _, views = paged_caches(shape, num_blocks, "LBNHC", 1, torch.bfloat16, device)
    layout = rotation.PagedKeyLayout(shape.head_size, num_blocks)
    keys = [layout.keys(v) for v in views]
    rows = []
    for count in counts:
        src = torch.arange(count, device=device)
        dst = torch.arange(count, 2 * count, device=device)
        moves = [(int(b), 1000 + int(b)) for b in src]

        def copy(src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
            for k in keys:
                k.index_copy_(0, dst, k.index_select(0, src))

        moved_bytes = 2 * count * shape.key_bytes_per_block  # read + write
        copy_s = _time(copy, device)
        row: dict[str, Any] = {"blocks": count, "key_bytes": count * shape.key_bytes_per_block,
                               "copy_s": copy_s, "copy_gbps": moved_bytes / copy_s / 1e9}
        for backend in backends:
            rotator = rotation.RopeRotator.from_base(500000.0, shape.head_size)
            rotator.backend = "auto" if backend == "triton" else "torch"
            rotate_s = _time(lambda r=rotator, m=moves: r.apply(views, layout, m), device)
            row[f"{backend}_s"] = rotate_s
            row[f"{backend}_gbps"] = moved_bytes / rotate_s / 1e9
            row[f"{backend}_vs_copy"] = copy_s / rotate_s
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the JSON report")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true",
                        help="small shapes and block counts (quick CPU run)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rotation, rotation_triton = load_rotation()
    device = args.device
    triton_ok = device == "cuda" and rotation_triton.available()
    backends = ["torch"] + (["triton"] if triton_ok else [])
    check_shape = Shape(layers=3, heads=2, head_size=64 if args.small else 128, block_size=16)
    started = time.perf_counter()
    correctness = [
        check_correctness(rotation, device, check_shape, layout, split, dtype_name, backend)
        for backend in backends
        for layout, split in (("LBNHC", 1), ("LBHNC", 1), ("LBNHC", 2), ("LBHNC", 2))
        for dtype_name in ("bf16", "fp16", "fp8-e4m3")
    ]
    bench_shape = (Shape(layers=4, heads=2, head_size=64, block_size=16) if args.small
                   else Shape(layers=32, heads=8, head_size=128, block_size=16))
    counts = [1, 16, 64] if args.small else [1, 16, 256, 4096]
    throughput = measure_throughput(rotation, device, bench_shape, counts, backends)
    best = "triton" if triton_ok else "torch"
    at_scale = [r[f"{best}_vs_copy"] for r in throughput if r["blocks"] >= 256]
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": rotation_triton.triton.__version__ if rotation_triton.HAS_TRITON else None,
        "backends": backends,
        "copy_baseline": "per layer k.index_copy_(0, dst, k.index_select(0, src)) of the keys",
        "check_shape": asdict(check_shape), "bench_shape": asdict(bench_shape),
        "correctness": correctness,
        "throughput": throughput,
        "target": {"backend": best, "min_ratio_at_256_blocks": 0.8,
                   "ratios": at_scale, "met": bool(at_scale) and min(at_scale) >= 0.8},
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    failed = [c for c in correctness if not c["ok"]]
    for row in throughput:
        print(f"{row['blocks']:5d} blocks: copy {row['copy_gbps']:7.2f} GB/s  "
              + "  ".join(f"{b} {row[f'{b}_gbps']:7.2f} GB/s ({row[f'{b}_vs_copy']:.2f}x)"
                          for b in backends))
    print(f"correctness: {len(correctness) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
