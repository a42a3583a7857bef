"""What span mode can serve, checked when the engine starts — never at the first request.

Span mode moves cached keys by re-rotating them (RoPE) and tracks one position per KV block.
That is exact only for a model whose KV cache is one group of full-attention layers with dense
K/V pages (float, or fp8 with one scale per layer), on one sequence shard. Everything else is
refused with an :class:`UnsupportedModelError` that says what and why, from

* :func:`engine_problems` — the engine's configuration (``Scheduler.__init__``), including
  :func:`store_problems`, what the span store needs (also checked by the store's connector
  before it opens the store, in every worker);
* :func:`kv_cache_problems` — the KV cache configuration (``KVCacheManager.__init__``), as soon
  as vLLM knows it, before a block is handed out;
* the worker check (:mod:`span_vllm.worker`) — layout, attention backend, RoPE — when the
  runner has allocated its KV cache.

Each ``*_problems`` function returns the list of reasons (empty: supported) so tests can
assert them one by one; :func:`refuse` raises with all of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from span_vllm.contract import STORE_CONNECTOR

#: What to tell a user whose model is refused.
ADVICE = ("serve this model without span mode (unset SPAN_VLLM), or pick a model with full "
          "attention and RoPE only")

#: KV cache quantization modes whose keys the rotator can decode and re-encode.
SUPPORTED_QUANT_MODES = ("NONE", "FP8_PER_TENSOR")

#: ``--prefix-caching-hash-algo`` values for which vLLM 0.32 seeds the first block's parent
#: hash (``NONE_HASH``) at random in every process unless ``PYTHONHASHSEED`` is set (its
#: ``kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS``).
RANDOM_FIRST_HASH_ALGOS = ("xxhash", "xxhash_cbor")


class UnsupportedModelError(RuntimeError):
    """Span mode cannot serve this model/configuration (raised at engine start)."""

    def __init__(self, problems: Sequence[str], stage: str) -> None:
        self.problems = list(problems)
        self.stage = stage
        super().__init__(
            f"span mode (SPAN_VLLM=1) cannot serve this configuration ({stage}):\n  - "
            + "\n  - ".join(self.problems) + f"\n{ADVICE}."
        )


def refuse(problems: Sequence[str], stage: str) -> None:
    """Raise :class:`UnsupportedModelError` if there is any problem."""
    if problems:
        raise UnsupportedModelError(problems, stage)


def engine_problems(vllm_config: Any) -> list[str]:
    """Engine features that move or fill KV blocks behind the span position tracker."""
    problems = store_problems(vllm_config)
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None and getattr(transfer, "kv_connector", None) != STORE_CONNECTOR:
        problems.append("a KV connector (--kv-transfer-config) loads KV blocks computed "
                        "elsewhere, at positions span mode does not track (the span store's "
                        f"{STORE_CONNECTOR} is the one it supports)")
    parallel = getattr(vllm_config, "parallel_config", None)
    for name, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                       ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        size = int(getattr(parallel, name, 1) or 1)
        if size > 1:
            problems.append(f"context parallelism ({flag} {size}) shards a block's tokens "
                            "across ranks")
    data_parallel = int(getattr(parallel, "data_parallel_size", 1) or 1)
    if data_parallel > 1:
        problems.append(f"data parallelism (--data-parallel-size {data_parallel}) runs one "
                        "engine per rank, each with its own span cache, and routes a query's "
                        "prepare and main requests to different ones; run one server per "
                        "rank behind span-aware routing instead")
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "hisparse_config", None) is not None:
        problems.append("HiSparse keeps KV pages on the host and moves them itself")
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        if getattr(model, "uses_mrope", False):
            problems.append("multimodal RoPE (MRoPE): positions are not token indices")
        if getattr(model, "is_encoder_decoder", False):
            problems.append("encoder-decoder models keep cross-attention KV")
    return problems


def store_problems(vllm_config: Any) -> list[str]:
    """What keeps the span store (:data:`STORE_CONNECTOR`) of this engine configuration from
    being exact and shared (empty without a store):

    * more than one tensor or pipeline parallel rank: each rank holds its own slice of a
      block's KV (its heads, or its layers) while a store file is named by the block hash
      alone, so ranks would overwrite and read each other's slices;
    * a prefix hash whose first parent (vLLM's ``NONE_HASH``) is random per process
      (:data:`RANDOM_FIRST_HASH_ALGOS` without ``PYTHONHASHSEED``): no other process would
      ever find this one's blocks."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or getattr(transfer, "kv_connector", None) != STORE_CONNECTOR:
        return []
    problems = []
    parallel = getattr(vllm_config, "parallel_config", None)
    sizes = {flag: int(getattr(parallel, name, 1) or 1) for name, flag in (
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("pipeline_parallel_size", "--pipeline-parallel-size"))}
    if any(size > 1 for size in sizes.values()):
        given = ", ".join(f"{flag} {size}" for flag, size in sizes.items() if size > 1)
        problems.append(f"the span store (--span-store) with more than one rank ({given}): "
                        "each rank holds a slice of a block's KV and a store file is keyed by "
                        "the block alone; serve a span store on one GPU, or drop the store")
    cache = getattr(vllm_config, "cache_config", None)
    algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
    if algo in RANDOM_FIRST_HASH_ALGOS and os.environ.get("PYTHONHASHSEED") is None:
        problems.append(f"the span store (--span-store) with --prefix-caching-hash-algo {algo}: "
                        "vLLM seeds the first block hash at random in every process for it, so "
                        "no other process would ever find a stored block; use sha256 (the "
                        "default) or sha256_cbor, or set PYTHONHASHSEED to one value for every "
                        "engine sharing the store")
    return problems


def kv_cache_problems(kv_cache_config: Any, dcp_world_size: int = 1,
                      pcp_world_size: int = 1) -> list[str]:
    """Problems with a ``KVCacheConfig`` for span mode (empty list: supported)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    problems = []
    if dcp_world_size > 1 or pcp_world_size > 1:
        problems.append(f"context parallel KV (dcp={dcp_world_size}, pcp={pcp_world_size}) "
                        "shards a block's tokens across ranks")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []))
    if len(groups) != 1:
        kinds = ", ".join(sorted({_spec_name(g.kv_cache_spec) for g in groups})) or "none"
        problems.append(
            f"{len(groups)} KV cache groups ({kinds}): span mode needs exactly one group of "
            "full-attention layers (hybrid, sliding-window, Mamba, encoder-decoder and "
            "HiSparse models have several)"
        )
        return problems
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        problems.append(
            f"KV cache spec {_spec_name(spec)}: only full attention (FullAttentionSpec) is "
            "supported (MLA stores a compressed latent, sliding-window/chunked caches drop "
            "blocks, per-layer spec mixes differ per layer)"
        )
        return problems
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        problems.append("sliding-window or chunked-local attention layers")
    if spec.non_causal:
        problems.append("non-causal (prefix-LM) attention: a span's keys depend on what "
                        "follows it")
    if spec.head_size_v != spec.head_size:
        problems.append(f"K and V head sizes differ ({spec.head_size} vs {spec.head_size_v})")
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or (
            spec.tokens_per_state != 1):
        problems.append("a packed KV page layout (head slots, packed content or compressed "
                        "tokens)")
    mode = getattr(spec.kv_quant_mode, "name", str(spec.kv_quant_mode))
    if mode not in SUPPORTED_QUANT_MODES:
        problems.append(f"KV cache quantization {mode}: only fp8 with one scale per layer "
                        "(--kv-cache-dtype fp8/fp8_e4m3/fp8_e5m2) can be re-rotated")
    elif mode == "NONE" and spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        problems.append(f"KV cache dtype {spec.dtype} without a float format")
    return problems


def _spec_name(spec: Any) -> str:
    return type(spec).__name__
