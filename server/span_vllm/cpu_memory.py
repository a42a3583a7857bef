"""Steady activation memory for CPU engines: freed tensors stay in the process's heap.

glibc's ``malloc`` serves a request above its *mmap threshold* with fresh pages from the
kernel and hands them back on ``free``; the threshold starts at 128 KiB and rises to the size
of the largest such chunk freed so far. A prefill's activations are megabytes (1 200 tokens x
1 536 floats is 7 MiB), so whether a step's tensors reuse memory the process holds or come
fresh from the kernel, every page faulted in and zeroed on first touch, depends on the sizes
the process happened to free before. Measured on a 2-core machine: the same 4-document span
miss took 0.70 s in some engine processes and 0.93 s in others (stock 0.75 s in both), the slow
ones losing the difference in the page faults of their elementwise ops; a step whose tensors
are a little larger than the last freed ones is the one that pays.

:func:`keep_activation_memory` fixes the thresholds (which also stops glibc adjusting them):
requests up to :data:`MMAP_THRESHOLD` (32 MiB, glibc's largest) come from the heap, and the
heap is not trimmed below :data:`TRIM_THRESHOLD`, so steps reuse the memory earlier steps
freed. The plugin calls it in every CPU engine process; a user's own choice wins (see there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

from span_vllm.contract import CPU_MALLOC_ENV

#: Requests up to this many bytes are served from the heap (glibc caps it at 32 MiB).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top is returned to the kernel only above this many bytes.
TRIM_THRESHOLD = 1 << 30
#: ``mallopt`` parameters (glibc's ``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Settings through which a user already chose how this process allocates.
USER_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def keep_activation_memory() -> bool:
    """Fix glibc's mmap and trim thresholds in this process (see the module docstring).

    Does nothing, and returns ``False``, where :data:`CPU_MALLOC_ENV` is ``0``, where the user
    set glibc's malloc thresholds or tunables, where ``LD_PRELOAD`` brings another allocator,
    or where the C library is not glibc; returns ``True`` once both thresholds are set."""
    if os.environ.get(CPU_MALLOC_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if any(os.environ.get(name) for name in USER_CHOICES):
        return False
    preload = os.environ.get("LD_PRELOAD", "").lower()
    if any(name in preload for name in OTHER_ALLOCATORS):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or ``None`` on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    if not version():
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_activation_memory"]
