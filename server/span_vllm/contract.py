"""The contract between the span planner and the patched vLLM: one module, no vLLM import.

A span-mode request carries its *segments* next to its tokens, in
``SamplingParams.extra_args[LAYOUT_KEY]``::

    {"key": "<this server's layout key>", "segments": [[offset, kind], ...]}

``offset`` is a token index on a KV block boundary where a segment starts; tokens before the
first segment are the ordered prefix. A span segment may carry a third element, ``links``: its
first ``links`` blocks are *link blocks*, recomputed after everything before them as cached
(EPIC-style; earlier spans of the same plus count with their own, unlinked KV, so the link
blocks of one plus are independent and computed in one step): their hashes chain from a digest
of every block before them, the earlier link blocks of their plus counted by their unlinked
hashes, and the span's next block chains
from the hash its last link block has without linking (so the rest of the span is the span's
cached KV, computed in its own context). ``kind`` is one of

* :data:`ANCHORED` — a commutative span computed after the ordered context before its plus
  (attending to that context and to itself, never to sibling spans). Its first block's parent
  hash is the hash of the last block before the plus (the *anchor*);
* :data:`ISOLATED` — a commutative span computed alone from position 0: its first block's
  parent is a fixed root (salted with the request's ``cache_salt``);
* :data:`ORDERED` — an ordered run after spans: its first block's parent digests every block
  before it, in order.

Every other block chains from the block before it, as in stock vLLM. A request whose layout is
missing, malformed or carries the wrong key hashes exactly as stock vLLM: only the planner,
which knows the key, can ask for span semantics (the key reaches the engine processes through
:data:`KEY_ENV`, which the launchers set; it is never sent to clients).

**Block alignment of a nested output** (a draft that a later prompt reads whole): a request
with ``SamplingParams.extra_args[ALIGN_KEY]`` =
``{"pad": P, "stop": S, "ends": [E, ...], "budget": M, "bias": {...} | absent}`` is driven by
the plugin's logits processor (:data:`ALIGN_PROCESSOR`, registered where the engine is built).
Its *text* is its tokens up to and including the first of ``ends`` (the model's end-of-turn
tokens), or its first ``M`` tokens when none comes; token ``S`` is never sampled there. After
the text the processor forces ``P`` until the request's length (prompt + output) is a whole
number of KV blocks, then ``S`` — so every token of the text *and* every pad has its KV
computed (the last sampled token never has) and the last block is full, hashed and cached like
the others. The request must run with ``ignore_eos=True`` and ``stop_token_ids=[S]`` (it ends on
``S``, not at the text's end) and room for ``block_size`` more tokens than ``M``; the reader drops
every token after the text. ``bias`` (:data:`BIAS_DEFAULTS`'s keys) also nudges where the text
ends: at a position where ending would fill the block exactly, the end tokens' logits gain
``boost`` when their probability is at least ``min_prob`` (the model is close to ending anyway);
in the first ``window`` positions of a block, where ending would cost almost a whole block of
pads, they lose ``boost``.

The rest of the contract: the environment of a span-mode engine process (:func:`enable`), the
engine-core utility calls the plugin adds (:data:`PROBE_CALL`, :data:`STATS_CALL`) and the
counters it keeps (:data:`STAT_HELP`). The planner side (``span_workflows``) imports this
module and nothing else of the plugin's internals.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

#: ``SPAN_VLLM=1`` turns the plugin on in a process.
ENABLE_ENV = "SPAN_VLLM"
#: The layout key (a random secret shared by the planner and the engine processes).
KEY_ENV = "SPAN_VLLM_LAYOUT_KEY"
#: When set, a file every engine core appends one line to (``pid<TAB>model``) as it starts,
#: in whatever process it runs: how a test suite or a deployment counts vLLM start-ups.
START_LOG_ENV = "SPAN_VLLM_START_LOG"
#: MiB of LoRA weights merged for one-adapter steps that a CPU engine process may hold
#: (default 1024; ``0``: never merge, every step takes the grouped LoRA products).
LORA_MERGE_ENV = "SPAN_VLLM_LORA_MERGE_MIB"
#: ``mp`` keeps vLLM's CPU executor for a one-worker engine core (a worker process of its
#: own); unset or ``uni``, the worker runs in the engine-core process (one process fewer).
CPU_EXECUTOR_ENV = "SPAN_VLLM_CPU_EXECUTOR"
#: ``0`` keeps glibc's adaptive malloc thresholds in CPU engine processes (by default the
#: plugin fixes them, so prefill activations reuse the heap: :mod:`span_vllm.cpu_memory`).
CPU_MALLOC_ENV = "SPAN_VLLM_CPU_MALLOC"
#: ``SamplingParams.extra_args`` key of a request's span layout.
LAYOUT_KEY = "span_layout"

ANCHORED = "anchored"
ISOLATED = "isolated"
ORDERED = "ordered"
SEGMENT_KINDS = (ANCHORED, ISOLATED, ORDERED)

#: ``((offset, kind), ...)``, a span's tuple optionally ``(offset, kind, links)``
Segment = tuple[int, str] | tuple[int, str, int]
Segments = tuple[Segment, ...]

#: Engine-core utility calls the plugin adds.
PROBE_CALL = "span_probe"
STATS_CALL = "span_stats"
STEPS_CALL = "span_steps"
#: ``SamplingParams.extra_args`` key of a request's *step tag*: the engine core counts the
#: scheduler steps such a request waits for (:data:`STEPS_CALL` reads them by tag).
TAG_KEY = "span_tag"

#: ``SamplingParams.extra_args`` key of a nested output's block alignment (see the module
#: docstring).
ALIGN_KEY = "span_align"
#: The plugin's logits processor (vLLM's ``logits_processors`` / ``--logits-processors``).
ALIGN_PROCESSOR = "span_vllm.align:BlockAlignLogitsProcessor"
#: Every logits processor a span-mode engine is built with.
LOGITS_PROCESSORS = (ALIGN_PROCESSOR,)
#: The boundary bias of ``align="bias"``: logit change in nats, the end probability from which
#: an ending at a block's end is raised, and how many first positions of a block are lowered.
BIAS_DEFAULTS: dict[str, float] = {"boost": 4.0, "min_prob": 0.05, "window": 4}

#: Counters the plugin keeps, with their help text (``/metrics`` exports ``span_<name>_total``).
STAT_HELP: dict[str, str] = {
    "hit_blocks": "KV blocks of plus spans served from the span cache",
    "miss_blocks": "KV blocks of plus spans computed (not found in the span cache)",
    "repositioned_tokens": "tokens whose cached keys were re-rotated to a new position",
    "duplicated_blocks": "cached blocks copied because another request read them elsewhere",
    "unregistered_blocks": "blocks computed over spans in context and kept out of the cache",
    "deferred_hits": "requests put off a step: a hit's KV not computed yet, or no room for "
                     "the copies its hits need",
    "same_step_copies": "blocks read elsewhere in the step that computes them, copied inside "
                        "the forward pass instead of waiting a step",
    "refused_hits": "cache hits given up (computed instead) for lack of a free block to copy to",
    "store_hit_blocks": "KV blocks loaded from the span store instead of computed",
    "store_bad_blocks": "span store blocks found missing, unreadable, truncated, corrupt "
                        "or foreign when loaded (never used: computed anew)",
    "store_written_blocks": "KV blocks written to the span store",
    "store_write_errors": "span store writes that failed (disk full or read-only)",
    "store_dropped_blocks": "KV blocks not written to the span store because the writer's "
                            "queue was full (the disk is slower than the engine)",
}

#: The span store's KV connector, as vLLM's ``kv_transfer_config`` names it.
STORE_CONNECTOR = "SpanStoreConnector"
STORE_CONNECTOR_MODULE = "span_vllm.store_connector"


def store_transfer_config(path: str | Path, *, max_gib: float | None = None,
                          write: bool = True) -> dict[str, object]:
    """vLLM's ``kv_transfer_config`` (as a dict; ``--kv-transfer-config`` takes its JSON) for
    an engine whose span blocks are kept in, and loaded from, the store at ``path``
    (:mod:`span_vllm.store`); ``max_gib`` caps its size (least recently used blocks go first),
    ``write=False`` only reads it. A block the store cannot supply after promising it (its file
    turned out unsound) fails its request (vLLM's ``kv_load_failure_policy="fail"``): vLLM
    evicts the block and what follows it, so nothing computed in the wrong context is cached,
    and the planner prepares the spans and runs the request again (vLLM's ``"recompute"``
    would recompute the block inside the request, in the wrong context for a span)."""
    extra: dict[str, object] = {"path": str(Path(path).expanduser()), "write": bool(write)}
    if max_gib is not None:
        extra["max_gib"] = float(max_gib)
    return {"kv_connector": STORE_CONNECTOR, "kv_connector_module_path": STORE_CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra}

#: Environment a span-mode engine process runs with (defaults only; an explicit setting wins).
VLLM_ENV_DEFAULTS: dict[str, str] = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    # The V1 model runner is the path proven end to end; Model Runner V2 is supported too
    # (VLLM_USE_V2_MODEL_RUNNER=1 in the environment wins).
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
#: vLLM's KV cache size on CPU, in GiB, and the size used when nobody says.
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KV_CACHE_GIB = 2


def layout_key(*, create: bool = True) -> str:
    """This process's layout key, from :data:`KEY_ENV`. Where it is unset, a launcher
    (``create=True``) makes a new random one and sets it in the environment, so engine
    processes started from here inherit it; inside an engine (``create=False``) span mode
    without a key is a mistake of whoever started it, and a :class:`RuntimeError` names it."""
    key = os.environ.get(KEY_ENV, "")
    if not key and not create:
        raise RuntimeError(
            f"span mode is on ({ENABLE_ENV}=1) but {KEY_ENV} is not set; start engines through "
            "span_workflows.Engine or `span-workflows serve`")
    key = key or secrets.token_hex(16)
    os.environ[KEY_ENV] = key
    return key


def enabled() -> bool:
    """Whether span mode was asked for in this process's environment."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def enable(env: MutableMapping[str, str] | None = None, *,
           kv_cache_gib: int | None = None) -> str:
    """Turn span mode on for the engine processes started with ``env`` (default: this
    process's environment, which engines started from here inherit); returns the layout key.

    Sets :data:`VLLM_ENV_DEFAULTS` where unset, the CPU KV cache size (``kv_cache_gib``; else
    an existing setting; else :data:`DEFAULT_KV_CACHE_GIB`), ``SPAN_VLLM=1`` and the layout
    key: the one ``env`` holds, else a new random one (written to ``env``). The key is made
    once per launcher and inherited by every engine process it starts.
    """
    env = os.environ if env is None else env
    for name, value in VLLM_ENV_DEFAULTS.items():
        env.setdefault(name, value)
    if kv_cache_gib is not None:
        env[KV_CACHE_ENV] = str(int(kv_cache_gib))
    env.setdefault(KV_CACHE_ENV, str(DEFAULT_KV_CACHE_GIB))
    env[ENABLE_ENV] = "1"
    key = env.get(KEY_ENV) or secrets.token_hex(16)
    env[KEY_ENV] = key
    return key


def layout_args(segments: Segments, key: str) -> dict[str, object]:
    """The ``extra_args`` entry that gives a request its span segments."""
    return {LAYOUT_KEY: {"key": key, "segments": [[int(s[0]), str(s[1]), *map(int, s[2:])]
                                                  for s in segments]}}


def align_args(pad: int, stop: int, ends: Sequence[int], budget: int,
               bias: Mapping[str, float] | None = None) -> dict[str, object]:
    """The ``extra_args`` entry that fills a nested output's last KV block by generation
    (and, with ``bias``, nudges where it ends); see the module docstring."""
    spec: dict[str, object] = {"pad": int(pad), "stop": int(stop),
                               "ends": [int(e) for e in ends], "budget": int(budget)}
    if bias is not None:
        spec["bias"] = {k: float(bias.get(k, v)) for k, v in BIAS_DEFAULTS.items()}
    return {ALIGN_KEY: spec}


def tag_args(tag: str) -> dict[str, object]:
    """The ``extra_args`` entry that asks the engine core to count a request's steps."""
    return {TAG_KEY: tag}


__all__ = [
    "ALIGN_KEY", "ALIGN_PROCESSOR", "ANCHORED", "BIAS_DEFAULTS", "DEFAULT_KV_CACHE_GIB",
    "CPU_EXECUTOR_ENV", "CPU_MALLOC_ENV", "ENABLE_ENV", "ISOLATED", "KEY_ENV", "KV_CACHE_ENV",
    "LAYOUT_KEY",
    "LOGITS_PROCESSORS",
    "LORA_MERGE_ENV",
    "ORDERED", "PROBE_CALL", "SEGMENT_KINDS", "START_LOG_ENV", "STATS_CALL", "STAT_HELP",
    "STEPS_CALL", "Segment", "Segments", "TAG_KEY", "VLLM_ENV_DEFAULTS", "adapter_digest",
    "align_args", "enable", "enabled", "layout_args", "layout_key", "note_start", "tag_args",
]


def note_start(model: str) -> None:
    """Append ``pid<TAB>model`` to the file :data:`START_LOG_ENV` names, if it does (one
    ``write`` of one short line in append mode: lines of processes starting at once do not
    interleave)."""
    path = os.environ.get(START_LOG_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\t{model}\n")


def adapter_digest(lora_path: str | Path) -> str:
    """SHA-256 over the ``adapter_*`` files of the LoRA adapter directory ``lora_path`` (names
    and contents, in name order; the path itself if it holds none): what the plugin keys the
    KV blocks computed under that adapter by, and what the planner names its weights by."""
    digest = hashlib.sha256()
    root = Path(lora_path).expanduser()
    files = sorted(p for p in root.glob("adapter_*") if p.is_file()) if root.is_dir() else []
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    if not files:
        digest.update(str(root).encode())
    return digest.hexdigest()
