"""span_vllm.cpu_memory: with the thresholds fixed, a freed activation-sized buffer is reused
from the heap (no page faults the second time); without, glibc maps it afresh; a user's own
allocator settings are left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from span_vllm import cpu_memory
from span_vllm.contract import CPU_MALLOC_ENV

#: Run in a fresh interpreter (glibc's thresholds are per process): malloc, touch and free a
#: 24 MiB buffer twice and print the page faults of the second round.
SECOND_ROUND_FAULTS = """
import ctypes, resource, sys
from span_vllm.cpu_memory import keep_activation_memory
if sys.argv[1] == "keep":
    assert keep_activation_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
size = 24 << 20
def round_trip():
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    libc.free(buffer)
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_trip()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_round_faults(mode: str) -> int:
    env = {"PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", SECOND_ROUND_FAULTS, mode], env=env,
                         capture_output=True, text=True, check=True)
    return int(run.stdout.strip())


@pytest.mark.skipif(cpu_memory._glibc_mallopt() is None, reason="the C library is not glibc")
def test_a_freed_activation_buffer_is_reused_instead_of_faulted_in_again() -> None:
    pages = (24 << 20) // 4096
    assert _second_round_faults("glibc") > pages // 2  # mapped afresh, every page faulted
    assert _second_round_faults("keep") < pages // 20  # reused from the heap


@pytest.mark.parametrize("name, value", [
    (CPU_MALLOC_ENV, "0"), ("MALLOC_MMAP_THRESHOLD_", "65536"),
    ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1"),
    ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"),
])
def test_a_users_own_allocator_choice_is_left_alone(monkeypatch, name, value) -> None:
    monkeypatch.setenv(name, value)
    assert cpu_memory.keep_activation_memory() is False
