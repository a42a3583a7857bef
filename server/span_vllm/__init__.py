"""span_vllm — a vLLM general plugin that makes the KV cache span-aware.

Registered under the ``vllm.general_plugins`` entry point; vLLM calls :func:`register` in every
process it starts (API server, engine core, workers). It patches vLLM only when span mode is on
(``SPAN_VLLM=1``), so installing the package changes nothing for plain vLLM users. It depends on
vLLM alone and knows nothing of the planner that sends it span requests.

Public API (everything else is private to the plugin):

* :func:`register` — the entry point;
* :mod:`span_vllm.contract` — what the planner and the plugin agree on: environment names and
  defaults, the layout key, segment kinds, utility-call names, counter names (no vLLM import);
* :func:`span_probe` ``(engine_core, prompts, salt=None, lora=None)`` — in the engine-core
  process, which prompts have all their blocks in the prefix cache (under the LoRA adapter
  ``[lora_int_id, lora_path]``, or the base);
* :func:`span_stats` ``()`` — this process's span-cache counters;
* :func:`span_steps` ``(tags)`` — engine steps of the requests with these step tags
  (:data:`contract.TAG_KEY`): ``[to_first_token, to_end]`` each;

  other processes ask the engine core with the utility calls of the same names, which run
  these three functions there;
* :func:`routing_block_keys` ``(token_ids, block_size, segments, salt=None)`` — block keys
  of a span prompt under the engine's chain rules, for routers outside the engine;
* :func:`hash_blocks` ``(token_ids, block_size, hash_fn, segments=(), salt=None)`` — the
  block hashes the plugin gives a prompt under a span layout, for tools and benchmarks;
* :func:`span_store_local` ``()`` — the span store of the engine in this process (with a
  ``span_store``), as ``(SpanStore, block_shape, dtype)``, or ``None``; :func:`span_store_flush`
  ``()`` waits for its queued writes (:mod:`span_vllm.store`, for tools and benchmarks);
* :class:`RopeRotator`, :class:`CpuKeyLayout`, :class:`PagedKeyLayout` — the torch-only key
  rotation, for benchmarks and device checks;
* ``span_vllm.align:BlockAlignLogitsProcessor`` — the vLLM v1 logits processor that fills a
  draft's last KV block by generation (:data:`contract.ALIGN_KEY`); vLLM loads it by that
  name (:data:`contract.LOGITS_PROCESSORS`), given where the engine is built.

``import span_vllm`` imports neither vLLM nor torch; each name above loads what it needs on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from span_vllm import contract
from span_vllm.contract import enabled

if TYPE_CHECKING:
    from span_vllm.hashing import hash_blocks, routing_block_keys
    from span_vllm.lora_cpu import restore_vllms as restore_vllm_lora_ops
    from span_vllm.patches import probe as span_probe
    from span_vllm.patches import span_stats, span_steps
    from span_vllm.rotation import CpuKeyLayout, PagedKeyLayout, RopeRotator
    from span_vllm.store_connector import flush_writes as span_store_flush
    from span_vllm.store_connector import local_store as span_store_local

#: Public name -> (module, attribute), imported on first use.
_LAZY = {
    "span_probe": ("span_vllm.patches", "probe"),
    "span_stats": ("span_vllm.patches", "span_stats"),
    "span_steps": ("span_vllm.patches", "span_steps"),
    "hash_blocks": ("span_vllm.hashing", "hash_blocks"),
    "routing_block_keys": ("span_vllm.hashing", "routing_block_keys"),
    "RopeRotator": ("span_vllm.rotation", "RopeRotator"),
    "CpuKeyLayout": ("span_vllm.rotation", "CpuKeyLayout"),
    "PagedKeyLayout": ("span_vllm.rotation", "PagedKeyLayout"),
    "restore_vllm_lora_ops": ("span_vllm.lora_cpu", "restore_vllms"),
    "span_store_flush": ("span_vllm.store_connector", "flush_writes"),
    "span_store_local": ("span_vllm.store_connector", "local_store"),
}


def register() -> None:
    """Entry point for vLLM: apply the span patches if span mode is enabled (idempotent)."""
    if not enabled():
        return
    from span_vllm.patches import apply

    apply()


def __getattr__(name: str) -> Any:
    """The public names that need vLLM or torch, imported on first use."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'span_vllm' has no attribute {name!r}")
    module, attribute = target
    return getattr(importlib.import_module(module), attribute)


__all__ = [
    "CpuKeyLayout", "PagedKeyLayout", "RopeRotator", "contract", "hash_blocks", "register",
    "restore_vllm_lora_ops", "routing_block_keys", "span_probe", "span_stats", "span_steps",
    "span_store_flush", "span_store_local",
]
