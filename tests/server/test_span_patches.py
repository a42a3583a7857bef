"""The plugin's patch targets exist in the installed vLLM, and registration is opt-in."""

from __future__ import annotations

import importlib.metadata

from span_vllm import patches
from span_vllm.config import enabled


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


def _executor(monkeypatch, **env: str) -> str:
    """The executor vLLM's CPU platform leaves a one-worker engine core of the default model,
    with the patches applied and the engine core in a process of its own (a server's case)."""
    from vllm.engine.arg_utils import EngineArgs

    from span_workflows.model import resolve_model

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
