"""Perplexity of a model on held-out plain text: did fine-tuning make it forget?

The text is the Python standard library's documentation (:mod:`span_workflows.apps.demo.corpus`),
which no training data of ``span-workflows tune`` contains. Each passage is scored on its own
(a plain causal LM forward, Hugging Face transformers, float32): perplexity is
``exp(total negative log-likelihood / predicted tokens)`` over all passages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def heldout_passages(count: int = 120) -> list[str]:
    """``count`` passages of the standard library's documentation, spread over its modules
    (every ``k``-th passage of the corpus, in corpus order)."""
    from span_workflows.apps.demo.corpus import stdlib_passages

    passages = [p.text for p in stdlib_passages()]
    step = max(1, len(passages) // count)
    return passages[::step][:count]


def perplexity(model_dir: str | Path, texts: Sequence[str], *, max_tokens: int = 512) -> float:
    """Perplexity of the model in ``model_dir`` on ``texts`` (each cut to ``max_tokens``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
            if len(ids) < 2:
                continue
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
            target = torch.tensor(ids[1:])
            total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += len(ids) - 1
    return math.exp(total / count) if count else float("nan")


__all__ = ["heldout_passages", "perplexity"]
