"""The plugin's patch targets exist in the installed vLLM, and registration is opt-in."""

from __future__ import annotations

import importlib.metadata

import pytest

from span_vllm import patches
from span_vllm.contract import KEY_ENV, enabled, layout_key


def test_every_patch_target_exists_with_the_expected_signature() -> None:
    assert patches.check_targets() == []


def test_guard_reports_a_changed_target(monkeypatch) -> None:
    monkeypatch.setattr(
        patches, "TARGETS", patches.TARGETS + (("vllm.v1.core.block_pool", "BlockPool.nope", ()),)
    )
    problems = patches.check_targets()
    assert len(problems) == 1 and "BlockPool.nope" in problems[0]


def test_plugin_is_registered_as_a_vllm_general_plugin() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "span_vllm:register" for ep in eps)


def test_span_mode_is_off_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("SPAN_VLLM", raising=False)
    assert not enabled()
    monkeypatch.setenv("SPAN_VLLM", "1")
    assert enabled()


def test_a_launcher_makes_the_layout_key_an_engine_only_reads_it(monkeypatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=KEY_ENV):
        layout_key(create=False)
    key = layout_key()
    assert len(key) == 32 and layout_key(create=False) == key == layout_key()


def _executor(monkeypatch, **env: str) -> str:
    """The executor vLLM's CPU platform leaves a one-worker engine core of the default model,
    with the patches applied and the engine core in a process of its own (a server's case)."""
    from vllm.engine.arg_utils import EngineArgs

    from span_workflows.compiler.model import resolve_model

    patches._patch_cpu_executor()  # what apply() runs in span mode
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv("SPAN_VLLM_CPU_EXECUTOR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = EngineArgs(model=str(resolve_model(progress=False)), enforce_eager=True,
                      dtype="float32", block_size=32, max_model_len=1024)
    return args.create_engine_config().parallel_config.distributed_executor_backend


def test_a_one_worker_cpu_engine_core_runs_its_worker_in_its_own_process(monkeypatch) -> None:
    """vLLM's CPU platform turns ``uni`` into ``mp`` (a spawned worker process, about 8 s of
    every server start); span mode keeps ``uni``, and ``SPAN_VLLM_CPU_EXECUTOR=mp`` keeps
    vLLM's choice."""
    assert _executor(monkeypatch) == "uni"
    assert _executor(monkeypatch, SPAN_VLLM_CPU_EXECUTOR="mp") == "mp"


def _vllms_own(monkeypatch) -> dict[str, object]:
    """Put vLLM's own CPU-only targets back for this test (``monkeypatch`` restores whatever
    an earlier test or engine of this session installed) and return them by name."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.platforms.cpu import CpuPlatform

    from span_vllm import lora_cpu

    wrapper = punica_cpu.PunicaWrapperCPU
    update = wrapper.update_metadata
    own = {
        "_apply_sync": lora_cpu._VLLMS.get("_apply_sync", BaseLinearLayerWithLoRA._apply_sync),
        "add_lora_linear": lora_cpu._VLLMS.get("add_lora_linear", wrapper.add_lora_linear),
        "update_metadata": getattr(update, "__span_original__", update),
        "check_and_update_config": getattr(
            vars(CpuPlatform)["check_and_update_config"].__func__, "__span_original__",
            vars(CpuPlatform)["check_and_update_config"].__func__),
        **{name: getattr(torch_ops, name) for name in lora_cpu.OPS},
    }
    assert not getattr(own["update_metadata"], "_span_wrapped", False)
    monkeypatch.setattr(BaseLinearLayerWithLoRA, "_apply_sync", own["_apply_sync"])
    monkeypatch.setattr(wrapper, "add_lora_linear", own["add_lora_linear"])
    monkeypatch.setattr(wrapper, "update_metadata", own["update_metadata"])
    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(own["check_and_update_config"]))
    for name in lora_cpu.OPS:
        monkeypatch.setattr(punica_cpu, name, own[name])
    return own


def _installed(own: dict[str, object]) -> dict[str, bool]:
    """Which of ``own``'s targets no longer hold vLLM's own function."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.platforms.cpu import CpuPlatform

    now = {"_apply_sync": BaseLinearLayerWithLoRA._apply_sync,
           "add_lora_linear": punica_cpu.PunicaWrapperCPU.add_lora_linear,
           "update_metadata": punica_cpu.PunicaWrapperCPU.update_metadata,
           "check_and_update_config": vars(CpuPlatform)["check_and_update_config"].__func__,
           **{name: getattr(punica_cpu, name) for name in own if name.startswith(("bgmv",
                                                                                  "sgmv"))}}
    return {name: now[name] is not own[name] for name in now}


def test_no_cpu_only_patch_is_installed_on_a_gpu(monkeypatch) -> None:
    """On a CUDA platform the CPU LoRA ops, the merged-weights ``_apply_sync`` (whose per-step
    group cache only ``PunicaWrapperCPU.update_metadata`` clears), the CPU executor choice and
    the CPU malloc thresholds stay out: vLLM's own LoRA kernels run. On CPU they go in."""
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    from span_vllm import cpu_memory

    class FakeCuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"

    kept: list[bool] = []
    monkeypatch.setattr(cpu_memory, "keep_activation_memory", lambda: kept.append(True))
    own = _vllms_own(monkeypatch)
    monkeypatch.setattr(vllm.platforms, "_current_platform", FakeCuda())
    patches._patch_lora()
    patches._patch_cpu_executor()
    patches._keep_cpu_activation_memory()
    assert not any(_installed(own).values()), _installed(own)
    assert not kept
    monkeypatch.undo()  # the real (CPU) platform: all of them go in
    own = _vllms_own(monkeypatch)
    monkeypatch.setattr(cpu_memory, "keep_activation_memory", lambda: kept.append(True))
    patches._patch_lora()
    patches._patch_cpu_executor()
    patches._keep_cpu_activation_memory()
    assert all(_installed(own).values()), _installed(own)
    assert kept == [True]
