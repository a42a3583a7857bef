"""The static checks of ``span-workflows lint``: does each plus of a query look commutative?

A plus (and its sugar: a retrieve, a repeat, a map) tells the optimizer that the order of its
children carries no meaning. Nothing checks that: a plus over numbered steps, the parts of a
story or the turns of a conversation is cached and reordered all the same, and the answer
quietly changes. These checks read the tree and the children's text, without a model, and
report *evidence*, each :class:`Finding` naming the node it was seen in (the IR's paths,
:mod:`span_workflows.query.ir`) and quoting what was seen.

Severities:

* ``error`` — strong evidence that the children are ordered: the plus is *flagged*.
* ``warning`` — weak evidence (a word that often, but not always, points at another span):
  the dynamic order check (:mod:`span_workflows.commutativity.lint`) confirms or clears it; without
  one the plus is reported, not flagged.
* ``note`` — the plus is harmless for the answer but does nothing useful (one child,
  duplicates, greedy copies).

The rules (``Finding.rule``), and what they look for among the children of one plus:

=====================  ========  ============================================================
rule                   severity  evidence
=====================  ========  ============================================================
``sibling-numbering``  error     line-start labels of one scheme (``Step 3``, ``Part 2 of 4``,
                                 ``2.``) spread over several children, their numbers disjoint
                                 (child 1 says ``Step 1``, child 2 ``Step 2``) — lists that
                                 each start at 1 are independent and pass
                       warning   one child numbered from above 1 (``Chapter 12``, ``3.``)
``sibling-reference``  error     a child mentions ``step 3`` and a sibling is labelled so
``sequence-opener``    error     two or more children open with a sequence word (``First,``,
                                 ``Then``, ``Finally``, ``The next morning``)
                       warning   one child does
``connective-opener``  warning   a child opens with a connective (``Actually,``, ``But``,
                                 ``So``, ``Also``, ``However``): it answers or continues
                                 something before it
``instructions``       warning   two or more children (half of them at least) open with an
                                 instruction verb (``Pour …``, ``Heat …``, ``Stir …``): the
                                 steps of a procedure are usually ordered
``continuation``       error     continuation markers: ``(continued)``, ``cont'd``,
                                 ``continued from the previous …``, ``to be continued``
``back-reference``     warning   ``as above``, ``the previous message``, ``the next step``,
                                 ``as I said``, ``the table below`` … (a retrieved document
                                 may say ``the previous record``: only nouns that name a part
                                 of a text or a conversation count)
``sentence-cut``       error     a child ends mid-sentence and a sibling starts as its
                                 continuation (lowercase, or after a comma)
                       warning   a child starts as a continuation, or ends on a comma, a dash
                                 or an ellipsis
``split-table``        error     a child starts with table rows without a header and a sibling
                                 holds a table with that header (same columns)
                       warning   headerless table rows with no sibling to match
``split-list``         error     a child ends with a colon and a sibling starts with a list
                                 item or a table row
                       warning   a child ends with a colon
``speaker-turns``      error     children open with speaker labels (``Alice:``, ``Customer:``,
                                 ``Q:``) of two or more speakers: turns of one conversation
                       warning   two children with two labels that need not be speakers
``dangling-pronoun``   warning   a child opens with a pronoun (``She``, ``It``, ``They``)
                                 whose antecedent is not in it
``dialogue-turns``     error     user and assistant messages side by side in one plus
``tool-turns``         error     tool results of different turns in one plus: a result of a
                                 call made by an earlier assistant turn than the last one
``single-child``       note      a plus of one child (nothing commutes)
``duplicate-children`` note      identical children (a greedy one says the same twice)
``greedy-nested-g``    note      a G under a plus at temperature 0 with n = 1: it is computed
                                 once and only its own output is reused (with identical
                                 siblings: the copies are the same text)
=====================  ========  ============================================================

Words inside a child's own text (``the first bridge built in 1820``, a list that starts at 1)
are no evidence: only what ties one child to another is.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from span_workflows.query.ir import (
    Assistant,
    Cross,
    Fragment,
    Generate,
    Map,
    Node,
    Plus,
    Repeat,
    Retrieve,
    Seq,
    System,
    User,
    child_path,
    children_of,
    content_hash,
)
from span_workflows.query.sampling import parse_answer

#: The severities, strongest first.
SEVERITIES = ("error", "warning", "note")


@dataclass(frozen=True, slots=True)
class Finding:
    """One piece of evidence: ``rule`` (see the module docstring) at ``severity``, seen in the
    node at ``path`` (a child of the plus, or the plus itself), with the ``evidence`` quoted."""

    rule: str
    severity: str
    path: str
    evidence: str

    def to_dict(self) -> dict[str, str]:
        """The finding as JSON-ready fields."""
        return {"rule": self.rule, "severity": self.severity, "path": self.path,
                "evidence": self.evidence}


@dataclass(frozen=True, slots=True)
class PlusSite:
    """A commutative join of a query: a plus, retrieve, repeat or map node.

    ``path`` is its path in the query, ``index`` the child indices from the root to it (what
    :func:`replace_at` follows), ``child_paths`` and ``texts`` its children's paths and texts
    (the text of a message; of any other node, the texts of the messages under it). ``parent``,
    ``parent_path`` and ``position`` are the node it sits in (``None`` at the root), that
    node's path and the site's index among its children.
    """

    path: str
    index: tuple[int, ...]
    node: Node
    child_paths: tuple[str, ...]
    texts: tuple[str, ...]
    parent: Node | None = None
    position: int = 0
    parent_path: str = ""

    @property
    def kind(self) -> str:
        """``plus``, ``retrieve``, ``repeat`` or ``map``."""
        return type(self.node).__name__.lower()

    @property
    def children(self) -> tuple[Node, ...]:
        """The children the site joins (a map's are its generations, one per input)."""
        if isinstance(self.node, Map):
            m = self.node
            return tuple(Generate(User(t), m.max_tokens, m.temperature, model=m.model)
                         for t in m.inputs)
        if isinstance(self.node, Repeat):
            return (self.node.g,) * self.node.n
        return children_of(self.node)


JOINS = (Plus, Retrieve, Repeat, Map)


def plus_sites(query: Node) -> list[PlusSite]:
    """Every commutative join of ``query``, depth first, left to right (a shared subtree once
    per use, as :func:`~span_workflows.query.ir.walk` yields it)."""
    sites: list[PlusSite] = []
    stack: list[tuple[str, tuple[int, ...], Node, Node | None, int, str]] = [
        ("", (), query, None, 0, "")]
    while stack:
        path, index, node, parent, position, parent_path = stack.pop()
        if isinstance(node, JOINS):
            sites.append(_site(path, index, node, parent, position, parent_path))
        kids = children_of(node)
        for i in range(len(kids) - 1, -1, -1):
            stack.append((child_path(path, node, i), (*index, i), kids[i], node, i, path))
    return sites


def _site(path: str, index: tuple[int, ...], node: Node, parent: Node | None,
          position: int, parent_path: str) -> PlusSite:
    if isinstance(node, Map):
        paths = tuple(f"{path}.map.inputs[{i}]" if path else f"map.inputs[{i}]"
                      for i in range(len(node.inputs)))
        texts = tuple(node.inputs)
    elif isinstance(node, Repeat):
        paths = (child_path(path, node, 0),) * node.n
        texts = (text_of(node.g),) * node.n
    else:
        kids = children_of(node)
        paths = tuple(child_path(path, node, i) for i in range(len(kids)))
        texts = tuple(text_of(k) for k in kids)
    return PlusSite(path, index, node, paths, texts, parent, position, parent_path)


def text_of(node: Node) -> str:
    """The text a node shows the model: a message's text; the texts of the messages under any
    other node, one paragraph each."""
    if isinstance(node, (System, User, Assistant, Fragment)):
        return node.text
    if isinstance(node, Map):
        return "\n\n".join(node.inputs)
    parts: list[str] = []
    stack: list[Node] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, (System, User, Assistant, Fragment)):
            parts.append(current.text)
        elif isinstance(current, Map):
            parts.extend(current.inputs)
        else:
            stack.extend(reversed(children_of(current)))
    return "\n\n".join(parts)


def replace_at(root: Node, index: Sequence[int], new: Node) -> Node:
    """``root`` with the node reached by the child indices ``index`` replaced by ``new``
    (only the nodes on the way are rebuilt)."""
    from span_workflows.query.ir import with_children

    if not index:
        return new
    kids = list(children_of(root))
    kids[index[0]] = replace_at(kids[index[0]], index[1:], new)
    return with_children(root, tuple(kids))


def with_children_of_site(site: PlusSite, kids: Sequence[Node]) -> Node:
    """The site's node with ``kids`` as its children (a map's: generations whose inputs are the
    new inputs; a repeat's copies are its only child)."""
    node = site.node
    if isinstance(node, Map):
        inputs = tuple(text_of(k) for k in kids)
        return Map(inputs, node.max_tokens, node.temperature, node.model)
    if isinstance(node, Repeat):
        return node
    if isinstance(node, Retrieve):
        return Retrieve(node.query, tuple(kids))  # type: ignore[arg-type]
    return Plus(tuple(kids))


# --------------------------------------------------------------------------------------------
# the checks


def check_site(site: PlusSite) -> list[Finding]:
    """Every finding of one site (see the module docstring), strongest first."""
    found: list[Finding] = []
    found += _structure(site)
    if len(site.texts) >= 2 and not isinstance(site.node, Repeat):
        texts = site.texts
        # a generation's prompt is read alone: no sentence, table or list runs on from it
        # into a sibling (only what it says, "Write step 2", ties it to one)
        shown = tuple("" if prompt else t for t, prompt in zip(
            texts, _prompts(site), strict=True))
        found += _numbering(site, texts)
        found += _openers(site, texts)
        found += _connectives(site, texts)
        found += _instructions(site, texts)
        found += _continuations(site, texts)
        found += _back_references(site, texts)
        found += _sentence_cuts(site, shown)
        found += _tables(site, shown)
        found += _lists(site, shown)
        found += _speakers(site, texts)
        found += _pronouns(site, texts)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(found, key=lambda f: order[f.severity])


def _prompts(site: PlusSite) -> list[bool]:
    """Which children are generations (their text is a prompt, read alone)."""
    if isinstance(site.node, Map):
        return [True] * len(site.texts)
    return [isinstance(k, Generate) for k in site.children]


def static_findings(query: Node) -> list[tuple[PlusSite, list[Finding]]]:
    """Each commutative join of ``query`` with its findings."""
    return [(site, check_site(site)) for site in plus_sites(query)]


# -- structure --------------------------------------------------------------------------------


def _structure(site: PlusSite) -> list[Finding]:
    node, found = site.node, []
    kids = site.children
    if len(kids) == 1:
        found.append(Finding("single-child", "note", site.path,
                             f"a {site.kind} of one child: nothing commutes"))
    if isinstance(node, Repeat):
        g = node.g
        if g.temperature == 0 and g.n == 1 and node.n > 1:
            found.append(Finding(
                "greedy-nested-g", "note", site.child_paths[0],
                f"repeat({node.n}) of a G at temperature 0 with n = 1: the {node.n} drafts are "
                "the same text; nothing to reuse across them"))
        return found
    hashes = [content_hash(k) for k in kids]
    counts = Counter(hashes)
    shown: set[str] = set()
    for i, (kid, digest) in enumerate(zip(kids, hashes, strict=True)):
        if counts[digest] > 1 and digest not in shown:
            sampled = isinstance(kid, Generate) and kid.temperature > 0
            if not sampled:  # copies of a sampled G are independent samples
                shown.add(digest)
                same = [site.child_paths[j] for j, h in enumerate(hashes) if h == digest]
                found.append(Finding("duplicate-children", "note", site.child_paths[i],
                                     f"identical children: {', '.join(same)}"))
    for i, kid in enumerate(kids):
        if isinstance(kid, Generate) and kid.temperature == 0 and kid.n == 1:
            twin = counts[hashes[i]] > 1
            found.append(Finding(
                "greedy-nested-g", "note", site.child_paths[i],
                "a G at temperature 0 with n = 1 under a plus: computed once, only its own "
                "output is reused" + ("; its identical siblings give the same text" if twin
                                      else "")))
    roles = {type(k) for k in kids}
    if Assistant in roles and roles & {User, Fragment}:
        turns = [f"{site.child_paths[i]} ({_role(k)}: {_quote(text_of(k))})"
                 for i, k in enumerate(kids) if isinstance(k, (User, Assistant, Fragment))]
        found.append(Finding("dialogue-turns", "error", site.path,
                             "user and assistant messages in one plus: " + "; ".join(turns[:4])))
    found += _tool_turns(site, kids)
    return found


def _role(node: Node) -> str:
    return "assistant" if isinstance(node, Assistant) else "user"


TOOL_RESULT = re.compile(r"^Tool (?P<name>\S+) returned(?: an error)?: ", re.S)


def _tool_turns(site: PlusSite, kids: Sequence[Node]) -> list[Finding]:
    """Tool results answering calls of different assistant turns (the enclosing join's)."""
    results = [(i, m.group("name")) for i, k in enumerate(kids)
               if isinstance(k, (User, Fragment)) and (m := TOOL_RESULT.match(k.text))]
    if len(results) < 2 or not isinstance(site.parent, (Cross, Seq)):
        return []
    turns: list[tuple[int, Counter[str]]] = []  # (position, calls by name) of assistant turns
    for j, earlier in enumerate(site.parent.children[:site.position]):
        if isinstance(earlier, Assistant):
            parsed = parse_answer(earlier.text)
            if parsed is not None and parsed[1]:
                turns.append((j, Counter(c.name for c in parsed[1])))
    if not turns:
        return []
    last_position, last_calls = turns[-1]
    left = Counter(last_calls)
    stale: list[str] = []
    for i, name in results:
        if left[name] > 0:
            left[name] -= 1
            continue
        earlier = [j for j, calls in turns[:-1] if calls[name]]
        if earlier:
            where = child_path(site.parent_path, site.parent, earlier[-1])
            stale.append(f"{site.child_paths[i]} answers {name}, called at {where}")
    if not stale:
        return []
    last = child_path(site.parent_path, site.parent, last_position)
    return [Finding("tool-turns", "error", site.path,
                    f"tool results of different turns (the last turn, {last}, called "
                    f"{_calls(last_calls)}): " + "; ".join(stale))]


def _calls(calls: Counter[str]) -> str:
    return ", ".join(f"{name} ×{n}" if n > 1 else name for name, n in calls.items())


# -- numbering --------------------------------------------------------------------------------

_NUMBER_WORDS = {w: i for i, w in enumerate(
    "one two three four five six seven eight nine ten eleven twelve".split(), start=1)}
_ROMAN = {"i": 1, "ii": 2, "iii": 3, "iv": 4, "v": 5, "vi": 6, "vii": 7, "viii": 8, "ix": 9,
          "x": 10, "xi": 11, "xii": 12}
_KEYWORDS = ("step|part|chapter|section|stage|phase|scene|act|page|chunk|slide|turn|round|"
             "lesson|episode|paragraph|question|message|verse|stanza|round")
_NUM = r"\d{1,3}|[ivx]{1,4}|" + "|".join(_NUMBER_WORDS)
LABEL = re.compile(
    rf"^[ \t]*(?:#{{1,6}}[ \t]*|\*\*|\[)?(?P<kw>{_KEYWORDS})[ \t]+(?P<num>{_NUM})\b"
    rf"(?:[ \t]*(?:/|of)[ \t]*(?P<total>\d{{1,3}}|{'|'.join(_NUMBER_WORDS)}))?", re.I | re.M)
ITEM = re.compile(r"^[ \t]*(?:(?P<num>\d{1,3})[.)]|\((?P<paren>\d{1,3})\))[ \t]+(?=\S)", re.M)
PART_OF = re.compile(r"\bpart[ \t]+(?P<num>\d{1,3})[ \t]*(?:/|of)[ \t]*(?P<total>\d{1,3})\b",
                     re.I)
MENTION = re.compile(
    r"\b(?P<kw>step|part|chapter|section|question|item)[ \t]+(?P<num>\d{1,3})\b", re.I)


def _number(text: str) -> int:
    text = text.lower()
    if text.isdigit():
        return int(text)
    return _NUMBER_WORDS.get(text) or _ROMAN.get(text, 0)


def _labels(text: str) -> dict[str, list[int]]:
    """The numbers of each numbering scheme the text's line-start labels use."""
    found: dict[str, list[int]] = {}
    for m in LABEL.finditer(text):
        number = _number(m.group("num"))
        if number:
            found.setdefault(m.group("kw").lower(), []).append(number)
    for m in ITEM.finditer(text):
        found.setdefault("item", []).append(int(m.group("num") or m.group("paren")))
    for m in PART_OF.finditer(text):
        numbers = found.setdefault("part", [])
        if int(m.group("num")) not in numbers:
            numbers.append(int(m.group("num")))
    return found


def _numbers(scheme: str, numbers: Sequence[int]) -> str:
    """``step 2``, ``steps 1–3``; ``3.``, ``1.–3.`` for plain numbered items."""
    if scheme == "item":
        return f"{numbers[0]}." if len(numbers) == 1 else f"{numbers[0]}.–{numbers[-1]}."
    if len(numbers) == 1:
        return f"{scheme} {numbers[0]}"
    return f"{scheme}s {numbers[0]}–{numbers[-1]}"


def _numbering(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    labels = [_labels(t) for t in texts]
    found: list[Finding] = []
    for scheme in sorted({s for lab in labels for s in lab}):
        holders = [(i, sorted(set(lab[scheme]))) for i, lab in enumerate(labels) if scheme in lab]
        shown = ", ".join(f"{_numbers(scheme, nums)} ({site.child_paths[i]})"
                          for i, nums in holders[:5])
        if len(holders) >= 2:
            if all(nums[0] == 1 for _, nums in holders):
                continue  # lists of their own, each from 1
            sets = [set(nums) for _, nums in holders]
            disjoint = sum(len(s) for s in sets) == len(set().union(*sets))
            if disjoint:
                found.append(Finding("sibling-numbering", "error", site.path,
                                     f"numbering across siblings: {shown}"))
            else:
                found.append(Finding("sibling-numbering", "warning", site.path,
                                     f"numbered labels in several children: {shown}"))
        elif holders[0][1][0] > 1:
            i, nums = holders[0]
            found.append(Finding(
                "sibling-numbering", "warning", site.child_paths[i],
                f"numbered from {_numbers(scheme, nums[:1])}: what comes before it is "
                "not in this span"))
    # a child that mentions "step 3" when a sibling is labelled "Step 3"
    for i, text in enumerate(texts):
        for m in MENTION.finditer(text):
            scheme, number = m.group("kw").lower(), int(m.group("num"))
            line_start = text.rfind("\n", 0, m.start()) + 1
            if text[line_start:m.start()].strip(" \t#*[") == "":
                continue  # a label of its own, not a mention
            owners = [j for j, lab in enumerate(labels)
                      if j != i and number in lab.get(scheme, [])]
            if owners:
                found.append(Finding(
                    "sibling-reference", "error", site.child_paths[i],
                    f"mentions «{m.group(0)}», which is {site.child_paths[owners[0]]}"))
                break
    return found


# -- sequence openers -------------------------------------------------------------------------

_TIME = r"(?:morning|day|week|month|year|night|evening|afternoon|step|time)"
OPENER = re.compile(
    r"^\s*(?:(?P<strong>firstly|secondly|thirdly|then|finally|lastly|afterwards|after that|"
    r"after this|meanwhile|in the end|at last|subsequently|"
    rf"(?:the )?(?:next|following) {_TIME})\b"
    r"|(?P<weak>first|second|third|fourth|fifth|next|last|later|eventually|soon after)\s*,)",
    re.I)


def _openers(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    openers = [(i, m.group(0).strip(" ,")) for i, t in enumerate(texts)
               if (m := OPENER.match(t))]
    if not openers:
        return []
    shown = ", ".join(f"«{word}» ({site.child_paths[i]})" for i, word in openers[:5])
    if len(openers) >= 2:
        return [Finding("sequence-opener", "error", site.path,
                        f"children open with sequence words: {shown}")]
    i, word = openers[0]
    return [Finding("sequence-opener", "warning", site.child_paths[i],
                    f"opens with «{word}»: it follows something")]


CONNECTIVE = re.compile(
    r"^\s*(?P<word>actually|anyway|also|besides|but|and|so|however|therefore|instead|"
    r"otherwise|in that case|by the way)\b(?!-)", re.I)
#: Verbs that open an instruction (the imperative of a step of a procedure).
INSTRUCTION_VERBS = frozenset(
    "add adjust apply attach bake beat blend boil bring brush check chop clean click close "
    "combine connect cook cool cover cut dig drain drop dry enter fill fold fry grate heat "
    "hold insert install knead lay leave let lift mix move open peel place plug pour preheat "
    "press pull push put remove repeat replace restart rinse roll run save scroll season "
    "select serve set shake simmer slice soak spread sprinkle start stir switch take tap "
    "tighten tie turn type unplug unscrew update upload wait warm wash water whisk wipe "
    "wrap".split())


def _connectives(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    return [Finding("connective-opener", "warning", site.child_paths[i],
                    f"opens with «{m.group('word')}»: it answers or continues what comes "
                    "before it")
            for i, t in enumerate(texts)
            if (m := CONNECTIVE.match(t)) and m.group("word")[0].isupper()]


def _instructions(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    steps = [(i, words[0]) for i, t in enumerate(texts)
             if (words := t.split()) and words[0].lower() in INSTRUCTION_VERBS
             and words[0][0].isupper()]
    if len(steps) < 2 or 2 * len(steps) < len(texts):
        return []
    shown = ", ".join(f"«{word} …» ({site.child_paths[i]})" for i, word in steps[:4])
    return [Finding("instructions", "warning", site.path,
                    f"children are instructions: {shown}; the steps of a procedure are "
                    "usually ordered")]


# -- continuations and references -------------------------------------------------------------

CONTINUED = re.compile(
    r"\((?:continued|cont(?:'d|\.|inued)?)\)|\bcont'd\b|\bto be continued\b"
    r"|\bcontinued (?:from|on|in) (?:the )?(?:previous|last|next|prior|page|part|chapter|"
    r"section|above|below|chunk|message|slide)\b|\bcontinues (?:in|on) (?:the )?next\b"
    r"|^\s*continued\s*(?:[:.…-]|from\b)|[-–—]\s*continued\b|\bcontinued\s*(?:\.\.\.|…|:)\s*\Z",
    re.I | re.M)
_PARTS = (r"(?:step|message|section|part|chapter|turn|answer|paragraph|page|item|point|"
          r"question|example|table|list|reply|response|comment|chunk|passage|entry|row|line|"
          r"scene|slide|instruction|one)s?")
REFERENCE = re.compile(
    r"\b(?:as (?:shown |said |mentioned |described |noted |stated |listed |explained )?"
    r"(?:above|before|earlier|previously)"
    r"|see above|the above|(?:mentioned|described|listed|shown|given|noted) (?:above|earlier)"
    rf"|(?:the|my|your|this|that) (?:previous|preceding|prior|last|earlier|next|following) {_PARTS}"
    r"|as i (?:said|mentioned|wrote)|like i said"
    r"|(?:the )?(?:table|list|steps?|text) below|(?:shown|listed|given) below|as follows)\b",
    re.I)


def _continuations(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    return [Finding("continuation", "error", site.child_paths[i],
                    f"continuation marker «{m.group(0).strip()}»")
            for i, t in enumerate(texts) if (m := CONTINUED.search(t))]


def _back_references(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    return [Finding("back-reference", "warning", site.child_paths[i],
                    f"refers to another part: «{_around(t, m)}»")
            for i, t in enumerate(texts) if (m := REFERENCE.search(t))]


def _around(text: str, m: re.Match[str], width: int = 24) -> str:
    start, end = max(0, m.start() - width), min(len(text), m.end() + width)
    return ("…" if start else "") + " ".join(text[start:end].split()) + (
        "…" if end < len(text) else "")


# -- sentences cut at a boundary ---------------------------------------------------------------

#: What a finished sentence (or a line that needs nothing after it) ends with.
_CLOSED = tuple(".!?\"'”’)]}»:")
_OPEN_END = re.compile(r"(?:,|;|[-–—]|\.\.\.|…)\s*\Z")
_CONTINUATION_START = re.compile(r"^\s*(?:[a-z](?![A-Z])|[,;)]|\.\.\.|…)")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _ends_open(text: str) -> bool:
    """Whether ``text`` stops mid-sentence (not after a full stop, a table row, a list item or
    a heading)."""
    line = _last_line(text).strip()
    if not line or line.startswith("#") or _is_row(line) or ITEM.match(line) or BULLET.match(line):
        return False
    return not line.endswith(_CLOSED) or bool(_OPEN_END.search(line))


def _sentence_cuts(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    open_end = [i for i, t in enumerate(texts) if _ends_open(t)]
    starts = [i for i, t in enumerate(texts)
              if _CONTINUATION_START.match(t) and not _starts_list(t)]
    for j in starts:
        for i in open_end:
            if i != j:
                return [Finding(
                    "sentence-cut", "error", site.path,
                    f"a sentence cut at a span boundary: {site.child_paths[i]} ends "
                    f"«…{_tail(texts[i])}» and {site.child_paths[j]} starts "
                    f"«{_head(texts[j])}…»")]
    found = [Finding("sentence-cut", "warning", site.child_paths[j],
                     f"starts mid-sentence: «{_head(texts[j])}…»") for j in starts]
    found += [Finding("sentence-cut", "warning", site.child_paths[i],
                      f"ends mid-sentence: «…{_tail(texts[i])}»")
              for i, t in enumerate(texts) if _OPEN_END.search(t.strip())]
    return found


def _head(text: str, words: int = 6) -> str:
    return " ".join(text.split()[:words])


def _tail(text: str, words: int = 6) -> str:
    return " ".join(text.split()[-words:])


# -- tables and lists -------------------------------------------------------------------------

_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{2,}:?\s*(?:\|\s*:?-{2,}:?\s*)*\|?\s*$")
BULLET = re.compile(r"^\s*[-*•]\s+\S")
_NUMERIC = re.compile(r"^[\s$€£]*[-+]?\d[\d.,:%/\s]*(?:[a-zA-Z°%]{0,4})\s*$")


@dataclass(frozen=True, slots=True)
class _Table:
    kind: str  # "pipe", "csv", "tsv"
    columns: int
    header: bool
    starts_with_row: bool
    first: str  # the first row


def _cells(line: str) -> tuple[str, list[str]] | None:
    """``(kind, cells)`` when ``line`` is a table row."""
    stripped = line.strip()
    if stripped.count("|") >= 2 or (stripped.count("|") == 1 and not stripped.startswith("|")
                                    and len(stripped.split("|")[0].split()) <= 4):
        return "pipe", [c.strip() for c in stripped.strip("|").split("|")]
    if "\t" in stripped:
        return "tsv", [c.strip() for c in stripped.split("\t")]
    cells = [c.strip() for c in stripped.split(",")]
    if (len(cells) >= 3 and all(cells) and all(len(c.split()) <= 4 for c in cells)
            and not stripped.endswith(".")):
        return "csv", cells
    return None


def _is_row(line: str) -> bool:
    return _cells(line) is not None


def _table(text: str) -> _Table | None:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    rows = [(i, _cells(line)) for i, line in enumerate(lines)]
    rows = [(i, c) for i, c in rows if c is not None]
    if not rows:
        return None
    kind = rows[0][1][0]
    same = [(i, c[1]) for i, c in rows if c[0] == kind]
    if kind == "csv" and len(same) < 2 and len(lines) > 1:
        return None  # one comma-separated line among prose is a sentence
    columns = Counter(len(cells) for _, cells in same).most_common(1)[0][0]
    if kind == "pipe":
        header = any(_SEPARATOR.match(lines[i]) for i, _ in same)
    else:
        first_cells = same[0][1]
        header = not any(_NUMERIC.match(c) for c in first_cells)
    return _Table(kind, columns, header, rows[0][0] == 0, lines[same[0][0]].strip())


def _tables(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    tables = [_table(t) for t in texts]
    found: list[Finding] = []
    for j, tab in enumerate(tables):
        if tab is None or tab.header or not tab.starts_with_row:
            continue
        heads = [i for i, other in enumerate(tables) if i != j and other is not None
                 and other.kind == tab.kind and other.columns == tab.columns and other.header]
        if heads:
            found.append(Finding(
                "split-table", "error", site.child_paths[j],
                f"table rows without a header («{_short(tab.first)}»); the header is in "
                f"{site.child_paths[heads[0]]} ({tab.columns} columns)"))
        else:
            found.append(Finding("split-table", "warning", site.child_paths[j],
                                 f"table rows without a header: «{_short(tab.first)}»"))
    return found


def _lists(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    found: list[Finding] = []
    for i, text in enumerate(texts):
        if not text.strip().endswith(":"):
            continue
        heirs = [j for j, t in enumerate(texts) if j != i and _starts_list(t)]
        if heirs:
            found.append(Finding(
                "split-list", "error", site.child_paths[i],
                f"ends «…{_tail(text)}» and {site.child_paths[heirs[0]]} starts with the "
                f"items: «{_head(texts[heirs[0]])}…»"))
        else:
            found.append(Finding("split-list", "warning", site.child_paths[i],
                                 f"ends with a colon: «…{_tail(text)}»"))
    return found


def _starts_list(text: str) -> bool:
    first = _first_line(text)
    return bool(BULLET.match(first) or ITEM.match(first) or _is_row(first))


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line
    return ""


def _short(text: str, width: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


# -- speakers and pronouns --------------------------------------------------------------------

SPEAKER = re.compile(r"^\s*(?P<who>[A-Z][A-Za-z0-9.'-]*(?: [A-Z0-9][A-Za-z0-9.'-]*){0,2})\s*:\s+\S")
#: Labels that name a speaker whatever the name.
SPEAKER_ROLES = frozenset(
    "user assistant human ai bot q a customer agent client interviewer interviewee doctor "
    "patient teacher student host guest caller operator support me you narrator moderator "
    "buyer seller".split())
#: Labels that documents open with (not speakers).
DOCUMENT_LABELS = frozenset(
    "note summary title source abstract warning tip example definition date update fact "
    "review result status location tags keywords description overview conclusion "
    "introduction draft important caution answer question topic subject name category "
    "file url id price address".split())


def _speaker(text: str) -> str | None:
    if TOOL_RESULT.match(text):
        return None
    m = SPEAKER.match(text)
    if not m:
        return None
    who = m.group("who")
    if LABEL.match(text) or who.split()[0].lower() in DOCUMENT_LABELS:
        return None  # a numbered label ("Step 2:") or a document's ("Summary:")
    return who


def _speakers(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    labels = [(i, who) for i, t in enumerate(texts) if (who := _speaker(t))]
    names = Counter(who for _, who in labels)
    if len(names) < 2:
        return []
    shown = ", ".join(f"«{who}:» ({site.child_paths[i]})" for i, who in labels[:5])
    roles = any(who.lower() in SPEAKER_ROLES or who.lower().startswith("speaker")
                for who in names)
    repeated = len(labels) >= 3 and max(names.values()) >= 2
    if roles or repeated:
        return [Finding("speaker-turns", "error", site.path,
                        f"turns of a conversation across siblings: {shown}")]
    return [Finding("speaker-turns", "warning", site.path, f"labelled children: {shown}")]


PRONOUN = re.compile(r"^\s*(?P<word>he|she|they|it|his|her|their|its|him|them)\b(?!-)", re.I)


def _pronouns(site: PlusSite, texts: Sequence[str]) -> list[Finding]:
    return [Finding("dangling-pronoun", "warning", site.child_paths[i],
                    f"opens with «{m.group('word')}»: who or what is in another span")
            for i, t in enumerate(texts) if (m := PRONOUN.match(t))]


def _quote(text: str, width: int = 32) -> str:
    return "«" + _short(text, width) + "»"


__all__ = [
    "Finding", "JOINS", "PlusSite", "SEVERITIES", "check_site", "plus_sites", "replace_at",
    "static_findings", "text_of", "with_children_of_site",
]
