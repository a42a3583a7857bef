"""``span-workflows bench lora``: what serving the span-ready adapter as LoRA costs.

Six configurations, each in an engine of its own (one process each, one after the other in
one run), the same prompts in stock form (full attention, no spans, prefix cache reset before
every prompt):

* ``base`` — the base model alone, LoRA off (what ``Engine(adapters={})`` runs);
* ``base in LoRA engine`` — the base's requests in the default engine, which also serves the
  adapter (LoRA layers present, no adapter applied);
* ``adapter as LoRA`` — the adapter's requests in the default engine (the plugin's LoRA
  ops, :mod:`span_vllm.lora_cpu`: a step of one adapter on merged weights);
* ``adapter as LoRA, grouped ops`` — the same with merging off (``SPAN_VLLM_LORA_MERGE_MIB=0``:
  every step computes the LoRA products, grouped by adapter, as a step mixing weights does);
* ``adapter as LoRA, vLLM's ops`` — the same with vLLM's own CPU LoRA ops;
* ``merged`` — the merged span-ready checkpoint alone (``Engine("smollm2-135m-instruct-span")``).

Per configuration: the median TTFT of a prompt of ``--doc-tokens`` x 4 tokens (prefill) and
the decode throughput of 8 answers of up to 64 tokens generated together; each is also given
relative to its reference (``base`` for the base rows, ``merged`` for the adapter rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

#: configuration -> (engine model, engine adapters default?, weights asked, LoRA ops: the
#: plugin's, the plugin's with merging off, or vLLM's)
CONFIGS: dict[str, tuple[str | None, bool, str | None, str]] = {
    "base": (None, False, None, "plugin"),
    "base in LoRA engine": (None, True, "base", "plugin"),
    "adapter as LoRA": (None, True, "adapter", "plugin"),
    "adapter as LoRA, grouped ops": (None, True, "adapter", "grouped"),
    "adapter as LoRA, vLLM's ops": (None, True, "adapter", "vllm"),
    "merged": ("smollm2-135m-instruct-span", False, None, "plugin"),
}
#: which configuration each one is compared with
REFERENCE = {"base": "base", "base in LoRA engine": "base", "adapter as LoRA": "merged",
             "adapter as LoRA, grouped ops": "merged", "adapter as LoRA, vLLM's ops": "merged",
             "merged": "merged"}
DECODE_TOKENS = 64
DECODE_BATCH = 8


def measure(config: str, prompt_tokens: int, reps: int) -> dict[str, Any]:
    """Run configuration ``config`` in this process: its prefill TTFT and decode rate."""
    import os
    import random

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from span_vllm.contract import LORA_MERGE_ENV
    from span_workflows.apps.bench.provenance import provenance
    from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME
    from span_workflows.query.builders import g, user
    from span_workflows.runtime.engine import Engine

    model, with_adapters, weights, ops = CONFIGS[config]
    if ops == "grouped":
        os.environ[LORA_MERGE_ENV] = "0"
    engine = Engine(model, adapters=None if with_adapters else {}, load_progress=False)
    if ops == "vllm":
        from span_vllm import restore_vllm_lora_ops

        restore_vllm_lora_ops()
    name = {"base": BASE_MODEL_NAME, "adapter": SPAN_MODEL_NAME, None: None}[weights]
    rng = random.Random(0)
    words = engine.tokenizer.convert_ids_to_tokens(list(range(1000, 9000)))

    def text(tokens: int) -> str:
        return engine.tokenizer.convert_tokens_to_string(rng.choices(words, k=tokens))

    def run(queries: list[Any]) -> list[Any]:
        return engine.execute_many(queries, span_mode=False, weights=name)

    try:
        run([g(user("Hello"), max_tokens=2, temperature=0.0)])  # warm-up
        ttfts = []
        for _ in range(reps):
            engine.reset_cache()
            [result] = run([g(user(text(prompt_tokens)), max_tokens=1, temperature=0.0)])
            ttfts.append(result.metrics.ttft_s)
        rates = []
        for _ in range(reps):
            engine.reset_cache()
            queries = [g(user(f"Count from {i} to {i + 200}, one number per line."),
                         max_tokens=DECODE_TOKENS, temperature=0.0)
                       for i in range(DECODE_BATCH)]
            results = run(queries)
            span = max(r.metrics.latency_s for r in results) - min(
                r.metrics.ttft_s for r in results)
            rates.append(sum(r.metrics.generated_tokens - 1 for r in results) / span)
        return {"config": config, "weights": results[0].metrics.weights,
                "prompt_tokens": prompt_tokens, "ttft_s": statistics.median(ttfts),
                "decode_tokens_per_s": statistics.median(rates),
                **provenance(engine, reps=reps)}
    finally:
        engine.close()


def bench_lora(prompt_tokens: int, reps: int, progress: bool = True) -> list[dict[str, Any]]:
    """Every configuration in a process of its own; rows with the ratios to the reference."""
    from tqdm.auto import tqdm

    rows: dict[str, dict[str, Any]] = {}
    for config in tqdm(CONFIGS, desc="lora", disable=not progress):
        done = subprocess.run(
            [sys.executable, "-m", "span_workflows.apps.bench.lora", "--worker", config,
             "--tokens", str(prompt_tokens), "--reps", str(reps)],
            capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"bench lora: {config!r} failed:\n{done.stderr[-2000:]}")
        rows[config] = json.loads(lines[-1])
    for row in rows.values():
        ref = rows[REFERENCE[row["config"]]]
        row["ttft_vs_reference"] = row["ttft_s"] / ref["ttft_s"]
        row["decode_vs_reference"] = row["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        row["reference"] = ref["config"]
    return list(rows.values())


def plot_lora(rows: list[dict[str, Any]], path: Any) -> None:
    """Bars of prefill TTFT and decode throughput relative to each row's reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from span_workflows.apps.bench.report import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["config"] for r in rows]
    for ax, key, title in ((axes[0], "ttft_vs_reference", "prefill TTFT (x reference)"),
                           (axes[1], "decode_vs_reference", "decode tokens/s (x reference)")):
        ax.barh(names, [r[key] for r in rows], color="#4c72b0")
        ax.axvline(1.0, color="grey", lw=1)
        ax.set_title(title)
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.suptitle("span-workflows bench lora: the span-ready adapter as LoRA vs merged")
    save_figure(fig, path)


def run_lora(args: argparse.Namespace) -> int:
    """``bench lora``: the table, and ``--json`` / ``--plot`` when asked."""
    from span_workflows.apps.bench.report import print_table

    rows = bench_lora(4 * args.doc_tokens, args.reps)
    print_table(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot_lora(rows, args.plot)
    return 0


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=list(CONFIGS), required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.worker, args.tokens, args.reps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))
