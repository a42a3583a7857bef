"""``device_check.py`` — the script a GPU machine with only torch + Triton runs — works on CPU
(small sizes) without vLLM or span_workflows, and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("device_check.py")

#: Runs the script with vllm and span_workflows made unimportable.
RUNNER = ("import runpy, sys; sys.modules['vllm'] = None; sys.modules['span_workflows'] = None;"
          " sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "device_check.json"
    subprocess.run([sys.executable, "-c", RUNNER, str(SCRIPT), str(out), *args],
                   check=True, capture_output=True, text=True, timeout=600)
    return json.loads(out.read_text())


def test_device_check_runs_on_cpu_without_vllm(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cpu", "--small", "--threads", "1")
    assert report["backends"] == ["torch"]
    cases = {(c["layout"], c["kernel_split"], c["dtype"]) for c in report["correctness"]}
    assert ("LBNHC", 2, "bf16") in cases and ("LBHNC", 1, "fp8-e4m3") in cases
    assert all(c["ok"] for c in report["correctness"]), report["correctness"]
    assert [row["blocks"] for row in report["throughput"]] == [1, 16, 64]
    for row in report["throughput"]:
        assert row["copy_gbps"] > 0 and row["torch_gbps"] > 0


@pytest.mark.gpu
def test_device_check_on_cuda_meets_the_throughput_target(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cuda")
    assert all(c["ok"] for c in report["correctness"]), report["correctness"]
    assert "triton" in report["backends"]
    assert report["target"]["met"], report["throughput"]
