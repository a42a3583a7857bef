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
