"""The demo's built-in retrieval corpus: the Python standard library's documentation.

The corpus needs no download: it is the docstrings of a fixed list of well-known Python
standard-library modules and of their public functions, classes and class methods, chunked into
passages of roughly 60–120 words (:func:`stdlib_passages`), or, for the demo, cut to an engine's
KV blocks (:func:`block_documents`); :func:`stdlib_index` searches them with a
:class:`~span_workflows.runtime.retrieval.VectorIndex`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from span_workflows.runtime.chunking import BlockChunker
from span_workflows.runtime.retrieval import Passage, VectorIndex

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
    return Passage(" ".join(text for _, text in items), _label([s for s, _ in items], group))


def _label(sources: list[str], group: str) -> str:
    """One source as it is; several as ``"group: a, b"`` (names without the group prefix)."""
    if len(sources) == 1:
        return sources[0]
    prefix = group + "."
    names = [s[len(prefix):] if group and s.startswith(prefix) else s for s in sources]
    return f"{group}: {', '.join(names)}" if group else ", ".join(names)


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


def block_documents(
    docs: Iterable[tuple[str, str]], chunker: BlockChunker, *, group: str = ""
) -> list[Passage]:
    """Chunk ``(source, text)`` documents of one group into passages sized to KV blocks.

    The documents' words are read as one stream, in order, and cut into the longest runs
    that fit ``chunker``'s blocks (:meth:`~span_workflows.runtime.chunking.BlockChunker.windows`),
    so every passage but the group's last ends within a word of a block boundary. A passage's
    source is its document's, or ``"group: a, b"`` when it holds words of several.
    """
    words: list[str] = []
    sources: list[str] = []
    for source, text in docs:
        doc_words = text.split()
        words.extend(doc_words)
        sources.extend([source] * len(doc_words))
    passages, at = [], 0
    for window in chunker.windows(words):
        covered = list(dict.fromkeys(sources[at:at + len(window)]))
        passages.append(Passage(" ".join(window), _label(covered, group)))
        at += len(window)
    return passages


def stdlib_passages(modules: Sequence[str] = STDLIB_MODULES,
                    chunker: BlockChunker | None = None) -> list[Passage]:
    """The built-in corpus: the modules' docstrings chunked into passages, in a fixed order:
    by words (:func:`chunk_documents`), or to ``chunker``'s blocks (:func:`block_documents`)."""
    passages: list[Passage] = []
    for name in modules:
        docs = module_documents(name)
        passages.extend(chunk_documents(docs, group=name) if chunker is None
                        else block_documents(docs, chunker, group=name))
    return passages


# -- the index -----------------------------------------------------------------------------------
def stdlib_index(*, progress: bool = True, chunker: BlockChunker | None = None) -> VectorIndex:
    """The vector index over the built-in corpus (:func:`stdlib_passages`, chunked by
    ``chunker`` when given), built once and cached on disk."""
    return VectorIndex(stdlib_passages(chunker=chunker), progress=progress,
                       desc="embedding stdlib docs")


#: Modules whose documentation makes the benchmarks' filler documents.
_TOKEN_DOC_MODULES = (
    "json", "pathlib", "itertools", "functools", "collections", "datetime", "re", "asyncio",
    "heapq", "bisect", "statistics", "textwrap", "shutil", "tempfile", "csv", "sqlite3",
    "zipfile", "argparse", "logging", "random", "decimal", "fractions", "uuid", "hashlib",
    "difflib", "enum", "dataclasses", "typing", "contextlib", "copy", "pickle", "threading",
    "queue", "subprocess", "socket", "calendar", "tarfile", "glob", "weakref", "operator",
)


def documents(tokenizer: Any, count: int, doc_tokens: int) -> list[str]:
    """``count`` distinct documents of about ``doc_tokens`` tokens of real English text (the
    standard library's documentation), deterministic: the benchmarks' filler documents."""
    text = []
    for name in _TOKEN_DOC_MODULES:
        module = importlib.import_module(name)
        text.append(module.__doc__ or "")
        for attr in sorted(dir(module))[:40]:
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and not attr.startswith("_"):
                text.append(doc)
    ids = tokenizer.encode("\n".join(text), add_special_tokens=False)
    need = count * doc_tokens
    while len(ids) < need:
        ids = ids + ids
    return [tokenizer.decode(ids[i * doc_tokens:(i + 1) * doc_tokens]) for i in range(count)]


__all__ = [
    "MAX_WORDS", "MIN_WORDS", "STDLIB_MODULES", "block_documents", "chunk_documents",
    "chunk_words", "documents", "module_documents", "stdlib_index", "stdlib_passages", "word_count",
]
