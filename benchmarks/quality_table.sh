#!/usr/bin/env bash
# Builds benchmarks/results/quality.{json,md,png}: every cell of the quality table, one
# `span-workflows bench quality` run per model, document size and question count, each
# merged into the table (--merge-json). Answers and span-hit TTFTs already in
# results/quality_answers.json are read, not computed again: with a complete answers file
# the whole table takes a few minutes (one engine start per run); from an empty one, days
# of CPU. Later runs replace the rows of the same model, size, document count and variant.
set -euo pipefail
cd "$(dirname "$0")/.."
results=benchmarks/results
bench() {
    .venv/bin/span-workflows bench quality --answers "$results/quality_answers.json" \
        --json "$results/quality.json" --merge-json "$results/quality.json" "$@"
}
links=prefix,prefix/link,prefix/link2,prefix/link4,prefix/link-all
for model in smollm2-135m-instruct-span smollm2-135m-instruct; do
    # the link frontier: span-hit TTFT at 16 x 440 tokens, timed once
    frontier=(--model "$model" --variants "$links" --reps 1 --no-ttft-own --perplexity 40)
    bench "${frontier[@]}" --docs 4,8 --sizes short --questions 96
    if [ "$model" = smollm2-135m-instruct-span ]; then
        bench "${frontier[@]}" --docs 4 --sizes long --questions 48
        bench "${frontier[@]}" --docs 8 --sizes long --questions 24
    else
        bench "${frontier[@]}" --docs 4,8 --sizes long --questions 24
    fi
done
# the default engine (span queries routed to the adapter as a LoRA) against the base's stock
# and its previous default (one link block), hits timed 3 times at each size too
routed=(--model smollm2-135m-instruct --reps 3)
bench "${routed[@]}" --variants routed --docs 4,8 --sizes short --questions 96
bench "${routed[@]}" --variants routed,prefix/link --docs 4 --sizes long --questions 48
bench "${routed[@]}" --variants routed --docs 8 --sizes long --questions 24 \
    --markdown "$results/quality.md" --plot "$results/quality.png"
# README's table of the default engine, from the rows just written
.venv/bin/python -m span_workflows.apps.bench.readme_tables
