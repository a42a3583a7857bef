"""Filling a span store ahead of time: every document's span computed once, then kept on disk.

An engine started with a span store (``Engine(span_store=DIR)``, ``span-workflows serve
--span-store DIR``) writes the span blocks it computes to the store and loads from it the spans
its KV cache lacks (the plugin's :mod:`span_vllm.store`). :func:`index_documents` computes
each document's span the way a retrieval query will ask for it — as a plus span after the same
system prompt, on the weights the router gives span queries — so that the first query after a
start (or after the cache evicted them) finds them in the store.

A span's blocks are keyed by the context they were computed in: with the default span options
(``prefix``: spans attend to the prompt before their plus) that is the system prompt, so index
with the system prompt your queries use; with ``span_options="self"`` (isolated spans) any.
Indexing again is cheap: documents already in the store are loaded, not computed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from span_workflows.errors import SpanQueryError
from span_workflows.query.builders import fragment, rag
from span_workflows.query.ir import Fragment

#: The question an indexing query ends with (its answer, one token, is thrown away).
INDEX_QUESTION = "."
#: The system prompt ``span-workflows index`` puts before each document unless told.
DEFAULT_INDEX_SYSTEM = "Answer from the documents."


@dataclass(frozen=True)
class IndexReport:
    """What :func:`index_documents` did: ``documents`` indexed, ``computed_tokens`` (prompt
    tokens neither cached nor in the store), ``seconds``."""

    documents: int
    prompt_tokens: int
    computed_tokens: int
    seconds: float


def index_documents(engine: Any, documents: Sequence[str | Fragment], system: str, *,
                    batch_size: int = 8, weights: str | None = None,
                    cache_salt: str | None = None, progress: bool = True) -> IndexReport:
    """Compute every document's span on ``engine`` (an
    :class:`~span_workflows.runtime.engine.Engine`
    with a span store), ``batch_size`` queries at a time, each document a plus span after
    ``system``. ``weights`` (default: the router's weights for span queries) and
    ``cache_salt`` (a tenant's vLLM salt; default none) must be the ones later queries run
    with: spans are keyed by both."""
    if batch_size < 1:
        raise SpanQueryError("batch_size", f"must be at least 1, got {batch_size}")
    if weights is None:
        adapter = engine.router.span_adapter
        weights = adapter.name if adapter is not None else None
    docs = [d if isinstance(d, Fragment) else fragment(d) for d in documents]
    from tqdm.auto import tqdm

    start = time.perf_counter()
    prompt = computed = 0
    with tqdm(total=len(docs), desc="indexing spans", unit="doc", disable=not progress) as bar:
        for i in range(0, len(docs), batch_size):
            batch = docs[i:i + batch_size]
            queries = [rag(system, [d], INDEX_QUESTION, max_tokens=1) for d in batch]
            for result in engine.execute_many(queries, weights=weights,
                                              cache_salt=cache_salt):
                prompt += result.metrics.prompt_tokens
                computed += result.metrics.prompt_tokens - result.metrics.cached_tokens
            bar.update(len(batch))
    return IndexReport(len(docs), prompt, computed, time.perf_counter() - start)


def read_corpus(path: str | Path) -> list[Fragment]:
    """The documents of a JSONL file: per line a JSON string, or an object with ``text`` (and
    optionally ``source``). Raises :class:`SpanQueryError` naming the line of a bad one."""
    docs: list[Fragment] = []
    source = Path(path)
    try:
        lines: Iterable[str] = source.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpanQueryError(str(path), f"cannot read the corpus: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise SpanQueryError(where, f"not JSON ({exc.msg})") from None
        if isinstance(item, dict):
            text, origin = item.get("text"), item.get("source", "")
        else:
            text, origin = item, ""
        if not isinstance(text, str) or not text.strip():
            raise SpanQueryError(where, "expected a non-empty string or {\"text\": ...}")
        if not isinstance(origin, str):
            raise SpanQueryError(where, "\"source\" must be a string")
        docs.append(fragment(text, source=origin))
    if not docs:
        raise SpanQueryError(str(path), "the corpus holds no document")
    return docs


__all__ = ["DEFAULT_INDEX_SYSTEM", "INDEX_QUESTION", "IndexReport", "index_documents",
           "read_corpus"]
