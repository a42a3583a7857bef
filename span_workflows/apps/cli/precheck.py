"""Checks of a command's queries that need only the model's tokenizer, run before the engine
starts, so that a query that cannot run fails in a second with one line instead of after the
engine's minute of loading."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Cross, Generate, Node, Plus


def model_context(model_dir: Path) -> int | None:
    """The context length vLLM will use for the model in ``model_dir`` by default (its
    config's ``max_position_embeddings``), or ``None`` if the config does not say."""
    from transformers import AutoConfig

    value = getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_queries(queries: Sequence[Node], model: str | None, block_size: int, *,
                  span_mode: bool = True, labels: Sequence[str] = ()) -> None:
    """Compile each query's top generations with the model's tokenizer, their nested outputs
    counted as empty, and raise :class:`SpanQueryError` (naming ``labels[i]``, e.g. the file)
    for one that cannot fit the model's context even so."""
    from transformers import AutoTokenizer

    from span_workflows.compiler.compile import Compiler, NestedOutput, nested_generations
    from span_workflows.compiler.model import resolve_model
    from span_workflows.runtime.plan import Planner

    model_dir = resolve_model(model, progress=True)
    max_len = model_context(model_dir)
    if max_len is None:
        return
    compiler = Compiler.for_tokenizer(AutoTokenizer.from_pretrained(str(model_dir)),
                                      block_size)
    planner = Planner(compiler, max_len)
    for i, query in enumerate(queries):
        node = planner.normalize(query, True, span_mode)
        tops = node.children if isinstance(node, (Plus, Cross)) else (node,)
        try:
            for g in tops:
                if isinstance(g, Generate):
                    nested = {path: NestedOutput(compiler.inner_prompt(inner).token_ids, (), "")
                              for path, inner in nested_generations(g)}
                    compiler.compile_generate(g, nested, span_mode=span_mode,
                                              max_model_len=max_len)
        except SpanQueryError as exc:
            label = labels[i] if i < len(labels) else ""
            if label:
                raise SpanQueryError(f"{label}: {exc.path}" if exc.path else label,
                                     exc.message) from None
            raise


__all__ = ["check_queries", "model_context"]
