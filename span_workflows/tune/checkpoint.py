"""The resumable state of a tuning run on disk, small enough to commit.

A checkpoint is a directory of three files, written atomically (a new directory renamed over
the old one):

* ``adapter.safetensors`` — the LoRA weights (float32, as trained);
* ``optimizer.safetensors`` — AdamW's two moments per parameter, stored in bfloat16 (half the
  size of float32; they are running averages, and bfloat16 keeps float32's exponent range), and
  the torch random-number state (LoRA dropout draws from it);
* ``state.json`` — the config it belongs to, the position in the example stream, the optimizer's
  step counts and parameter groups, the learning-rate schedule, the loss curves, the seconds
  spent, the run's *segments* (one per process that trained it: commit, machine, examples,
  seconds) and its dev-set learning curve.

For the bundled adapter's recipe (rank 16 on seven projections of SmolLM2-135M, 4.9 M
parameters) that is about 39 MB: 19.5 MB of weights and 19.5 MB of moments.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from span_workflows.errors import SpanQueryError

#: What the optimizer's moments are stored in.
MOMENT_DTYPE = "bfloat16"
#: Bumped when the files change meaning; a checkpoint of another format is refused.
FORMAT = 2


@dataclass
class RunState:
    """A run's progress besides its tensors: examples done, the loss curve and its two terms
    (one point per optimizer step), seconds over all segments, the segments themselves and
    the dev-set learning curve (one point per segment end)."""

    examples: int = 0
    losses: list[float] = field(default_factory=list)
    curves: dict[str, list[float]] = field(default_factory=lambda: {"ce": [], "kl": []})
    seconds: float = 0.0
    segments: list[dict[str, Any]] = field(default_factory=list)
    dev: list[dict[str, Any]] = field(default_factory=list)


def load_state(checkpoint: Path, config: dict[str, Any], model: str | None) -> RunState | None:
    """The saved progress of a run with this config and base model, or ``None`` (no
    checkpoint). A checkpoint of another config, base or format is refused, naming ``--out``:
    resuming it would train something else."""
    path = checkpoint / "state.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if saved.get("format") != FORMAT:
        raise SpanQueryError("--out", f"{checkpoint} was written by another version of the "
                                      f"trainer (format {saved.get('format', 1)}, this one "
                                      f"reads {FORMAT}); use another --out or delete it")
    if saved.get("config") != config or saved.get("model") != model:
        raise SpanQueryError("--out", f"{checkpoint} holds a run with other settings; use "
                                      f"another --out or delete it")
    fields = RunState.__dataclass_fields__
    return RunState(**{k: v for k, v in saved["progress"].items() if k in fields})


def restore(checkpoint: Path, model: Any, optimizer: Any, schedule: Any) -> None:
    """Load the adapter weights, the optimizer (moments back in float32), the schedule and
    the random-number state of ``checkpoint`` into a fresh run's objects."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((checkpoint / "state.json").read_text())
    set_peft_model_state_dict(model, load_file(str(checkpoint / "adapter.safetensors")))
    tensors = load_file(str(checkpoint / "optimizer.safetensors"))
    state = {int(index): {"step": torch.tensor(float(step)),
                          "exp_avg": tensors[f"{index}.exp_avg"].float(),
                          "exp_avg_sq": tensors[f"{index}.exp_avg_sq"].float()}
             for index, step in saved["optimizer"]["steps"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["optimizer"]["groups"]})
    schedule.load_state_dict(saved["schedule"])
    torch.set_rng_state(tensors["rng.torch"])


def save(checkpoint: Path, model: Any, optimizer: Any, schedule: Any, config: dict[str, Any],
         base: str | None, progress: RunState) -> None:
    """Write the resumable state of a run atomically (see the module docstring)."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tmp = checkpoint.with_name(checkpoint.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous()
               for k, v in get_peft_model_state_dict(model).items()}
    save_file(weights, str(tmp / "adapter.safetensors"))
    moments: dict[str, Any] = {"rng.torch": torch.get_rng_state()}
    optimizer_state = optimizer.state_dict()
    steps = {}
    for index, entry in optimizer_state["state"].items():
        steps[str(index)] = float(entry["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            moments[f"{index}.{name}"] = entry[name].detach().to(
                getattr(torch, MOMENT_DTYPE)).cpu().contiguous()
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({
        "format": FORMAT, "config": config, "model": base,
        "optimizer": {"steps": steps, "groups": optimizer_state["param_groups"]},
        "schedule": schedule.state_dict(), "progress": asdict(progress)}))
    old = checkpoint.with_name(checkpoint.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if checkpoint.exists():
        checkpoint.rename(old)
    tmp.rename(checkpoint)
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["FORMAT", "MOMENT_DTYPE", "RunState", "load_state", "restore", "save"]
