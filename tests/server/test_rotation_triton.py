"""The fused Triton kernel equals the torch path, checked on CPU with Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess so no compiled kernel is mixed in), and on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

#: Builds vLLM-0.32-like paged caches (layers as views of one allocation, LBNHC order,
#: manager blocks split into 2 kernel blocks), rotates them with the kernel and with torch.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from span_vllm import rotation_triton
    from span_vllm.rotation import Fp8Keys, PagedKeyLayout, RopeRotator

    device = sys.argv[1]
    torch.manual_seed(0)
    L, NB, H, BS, D, R = 3, 6, 2, 32, 64, 2
    layout = PagedKeyLayout(D, NB)
    moves = [(1, 37), (4, -5), (5, 1000)]
    report = {}
    for name, dtype, neox, rotary, fp8 in [
        ("fp32-neox", torch.float32, True, D, None),
        ("fp32-gptj", torch.float32, False, D, None),
        ("bf16-partial", torch.bfloat16, True, D // 2, None),
        ("fp8-e4m3", torch.uint8, True, D, torch.float8_e4m3fn),
        ("fp8-e5m2", torch.uint8, True, D, torch.float8_e5m2),
    ]:
        raw = torch.randn(L, NB * R, BS // R, H, 2 * D, device=device)
        if fp8 is not None:
            raw = raw.to(fp8).view(torch.uint8)
        else:
            raw = raw.to(dtype)
        kernel = [raw[l].transpose(1, 2) for l in range(L)]
        torch_side = [c.clone() for c in kernel]
        rotator = RopeRotator.from_base(10000.0, rotary, neox)
        keys = None if fp8 is None else Fp8Keys(fp8, [0.5, 1.0, torch.tensor(2.0)])
        rotator.backend = "torch"
        rotator.apply(torch_side, layout, moves, fp8=keys)
        deltas = torch.tensor([d for _, d in moves], dtype=torch.float64)
        cos, sin = rotator.cos_sin(deltas, torch.float32, raw.device)
        rotation_triton.rotate_paged_keys(
            kernel, layout, [b for b, _ in moves], cos, sin, rotary_dim=rotary,
            neox_style=neox, fp8_dtype=fp8,
            scales=None if keys is None else keys.scale_tensor(range(L), raw.device))
        diff = 0.0
        for a, b in zip(kernel, torch_side):
            if fp8 is not None:
                a, b = a.view(fp8).float(), b.view(fp8).float()
            diff = max(diff, (a.float() - b.float()).abs().max().item())
        report[name] = diff
    print(json.dumps(report))
""")


def _run(device: str, interpret: bool) -> dict[str, float]:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT, device], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(report: dict[str, float]) -> None:
    assert set(report) == {"fp32-neox", "fp32-gptj", "bf16-partial", "fp8-e4m3", "fp8-e5m2"}
    assert report["fp32-neox"] < 1e-5 and report["fp32-gptj"] < 1e-5
    assert report["bf16-partial"] <= 2 ** -4  # at most one bf16 ulp apart (|x| < 8)
    # fp8: both requantize the same float32 values; a tie may round to a neighbour code
    assert report["fp8-e4m3"] <= 2.0 and report["fp8-e5m2"] <= 4.0


def test_fused_kernel_equals_the_torch_path_under_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    _check(_run("cpu", interpret=True))


@pytest.mark.gpu
def test_fused_kernel_equals_the_torch_path_on_cuda() -> None:
    _check(_run("cuda", interpret=False))


def test_kernel_is_only_chosen_where_it_can_run() -> None:
    from span_vllm import rotation_triton
    from span_vllm.rotation import PagedKeyLayout, RopeRotator

    rotator = RopeRotator.from_base(10000.0, 64)
    cpu_cache = torch.zeros(4, 2, 16, 128)
    assert not rotator._use_triton([cpu_cache], PagedKeyLayout(64, 4))
    assert rotation_triton.layer_offsets([cpu_cache, cpu_cache[:2]]) is None  # other shape
    big = torch.zeros(2, 4, 2, 16, 128)
    assert rotation_triton.layer_offsets(list(big)) == [0, big[1].data_ptr() // 4
                                                        - big[0].data_ptr() // 4]
