"""The span-ready bundled model: merged from the committed LoRA adapter once, verified on reuse,
served by name, and recording the span options it was trained for; one name away from the
default, the base."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from span_workflows.compiler.model import (
    ADAPTERS_DIR,
    BASE_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    SPAN_MODEL_NAME,
    base_model_dir,
    resolve_model,
    span_defaults,
)
from span_workflows.runtime.engine import available_models
from span_workflows.serving.launch import ServerOptions
from span_workflows.tune.train import TRAINED_OPTIONS


def test_the_span_ready_model_is_the_base_with_the_adapter_folded_in() -> None:
    merged = resolve_model(SPAN_MODEL_NAME, progress=False)
    assert resolve_model(SPAN_MODEL_NAME.upper(), progress=False) == merged  # verified, reused
    assert span_defaults(merged) == TRAINED_OPTIONS
    manifest = json.loads((merged / "span-workflows-manifest.json").read_text())
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    base = load_file(str(base_model_dir(progress=False) / "model.safetensors"))
    tuned = load_file(str(merged / "model.safetensors"))
    assert base.keys() == tuned.keys()
    adapter = load_file(str(ADAPTERS_DIR / SPAN_MODEL_NAME / "adapter_model.safetensors"))
    changed = [k for k in base if not torch.equal(base[k], tuned[k])]
    # exactly the adapted projections moved, and only by a small delta
    targets = {k.split("base_model.model.")[-1].replace(".lora_A.weight", ".weight")
               for k in adapter if ".lora_A." in k}
    assert set(changed) == targets
    for key in changed[:4]:
        delta = (tuned[key] - base[key]).norm() / base[key].norm()
        assert 0 < float(delta) < 0.5


def test_the_base_is_the_default_and_the_span_ready_model_one_name_away() -> None:
    assert DEFAULT_MODEL_NAME == BASE_MODEL_NAME
    base = resolve_model(None, progress=False)
    assert base == resolve_model(BASE_MODEL_NAME, progress=False) == base_model_dir(
        progress=False)
    assert resolve_model(SPAN_MODEL_NAME, progress=False) != base
    assert span_defaults(base) == {}  # the base records no span options: the library's own
    cmd = ServerOptions().command(device="cpu")
    assert str(base) in cmd and BASE_MODEL_NAME in cmd and SPAN_MODEL_NAME not in cmd


def test_the_span_ready_model_is_served_by_its_name() -> None:
    assert SPAN_MODEL_NAME in available_models()
    cmd = ServerOptions(SPAN_MODEL_NAME).command(device="cpu")
    merged = str(resolve_model(SPAN_MODEL_NAME, progress=False))
    assert merged in cmd
    names = cmd[cmd.index("--served-model-name") + 1:][:2]
    assert names == [merged, SPAN_MODEL_NAME]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-spam"])
def test_a_misspelt_bundled_name_is_not_taken_for_it(name: str) -> None:
    from span_workflows.errors import ModelNotAvailableError

    with pytest.raises(ModelNotAvailableError):
        resolve_model(name, progress=False)
