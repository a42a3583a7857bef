"""Every load of a LoRA adapter reads the content its blocks are keyed by: the engine core
pins each adapter id to a content-addressed copy of its files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from vllm.lora.request import LoRARequest

from span_vllm import contract
from span_vllm.adapter_pins import ADAPTER_DIR_ENV, AdapterPins, snapshot, snapshot_root


def _adapter(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (root / "adapter_model.safetensors").write_bytes(weights)
    (root / "optimizer.pt").write_bytes(b"not read by vLLM")
    return root


def test_a_snapshot_is_the_adapter_files_under_their_digest(tmp_path: Path) -> None:
    source = _adapter(tmp_path / "run", b"weights-a")
    path, digest = snapshot(source, tmp_path / "pins")
    assert digest == contract.adapter_digest(source) and path == tmp_path / "pins" / digest
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json",
                                                      "adapter_model.safetensors"]
    again, _ = snapshot(source, tmp_path / "pins")  # the same content: the same copy
    assert again == path and len(list((tmp_path / "pins").iterdir())) == 1


def test_an_id_reads_its_pinned_copy_until_it_is_reloaded(tmp_path: Path) -> None:
    source = _adapter(tmp_path / "run", b"weights-a")
    pins = AdapterPins(tmp_path / "pins")
    asked = LoRARequest("a", 3, str(source))
    first = pins.pin(asked)
    assert asked.lora_path == str(source)  # the caller's request is left as it was
    assert first.lora_path != str(source) and first.lora_int_id == 3
    digest = contract.adapter_digest(source)
    assert contract.adapter_digest(first.lora_path) == digest
    # the run saves new weights in place: a request of the same id (a lazy reload after an
    # eviction) still reads the weights its blocks are keyed by
    _adapter(source, b"weights-a-retrained")
    later = pins.pin(LoRARequest("a", 3, str(source)))
    assert later.lora_path == first.lora_path
    assert (Path(later.lora_path) / "adapter_model.safetensors").read_bytes() == b"weights-a"
    # another path under the same id: vLLM serves an id with the weights it loaded for it
    other = _adapter(tmp_path / "other", b"weights-b")
    assert pins.pin(LoRARequest("a", 3, str(other))).lora_path == first.lora_path
    # an explicit reload (add_lora with load_inplace) pins the files anew
    reloaded = pins.pin(LoRARequest("a", 3, str(source), load_inplace=True), reload=True)
    assert reloaded.lora_path != first.lora_path
    assert pins.pinned(3).digest == contract.adapter_digest(source) != digest
    # a removed adapter's next load pins whatever its files are then
    pins.forget(3)
    assert pins.pin(LoRARequest("a", 3, str(other))).lora_path.endswith(
        contract.adapter_digest(other))
    # a pinned copy named again is not copied again
    assert pins.pin(LoRARequest("c", 4, reloaded.lora_path)).lora_path == reloaded.lora_path


def test_what_is_not_a_local_adapter_is_left_alone(tmp_path: Path, caplog) -> None:
    pins = AdapterPins(tmp_path / "pins")
    hub = LoRARequest("hub", 5, "someone/some-adapter")
    assert pins.pin(hub) is hub and pins.pinned(5) is None
    assert pins.pin(None) is None
    # a copy that cannot be written: the request keeps its path, and the log says why
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    stuck = AdapterPins(blocked / "pins")
    request = LoRARequest("a", 6, str(_adapter(tmp_path / "run", b"w")))
    with caplog.at_level(logging.WARNING, logger="span_vllm.adapter_pins"):
        assert stuck.pin(request) is request
    assert "could not copy the LoRA adapter" in caplog.text


def test_the_copies_live_where_the_environment_says(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv(ADAPTER_DIR_ENV, str(tmp_path / "here"))
    assert snapshot_root() == tmp_path / "here"
    monkeypatch.delenv(ADAPTER_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert snapshot_root() == tmp_path / "cache" / "span-vllm" / "adapters"
