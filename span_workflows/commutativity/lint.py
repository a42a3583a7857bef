"""Is this plus really commutative? :func:`lint` checks every plus of a span query.

A plus promises that the order of its children carries no meaning; the optimizer then sorts
them, caches each alone and reuses it anywhere. A wrong promise gives no error, only other
answers. :func:`lint` looks for the evidence two ways:

* **static checks** (no model, :mod:`span_workflows.commutativity.rules`): numbering and sequence
  words across siblings, references to another part, sentences, tables and lists cut at a span
  boundary, the turns of a conversation, tool results of different turns; and pluses that do
  nothing (one child, duplicates, greedy copies).
* **the order check** (with a ``backend``, e.g. :class:`~span_workflows.runtime.engine.Engine`):
  each plus's query runs in *stock* mode (a plain chat prompt that keeps the order given),
  greedily (every G at temperature 0 and at most ``answer_tokens`` tokens, the answer
  stopping after its first sentence), under ``trials`` orders of the plus's children — the
  given order, reversed, then random ones — and, as a *control* the user cannot get wrong,
  under ``trials`` versions with the children's order fixed and only their whitespace varied
  (a doubled space, a trailing newline). All of one plus's runs go to the engine in one
  ``execute_many`` call. Two figures each, for the orders and for the control:

  - the **answer agreement**: the share of pairs of runs whose answers agree. Greedy answers
    of a small model rephrase, so two answers agree when the words of their first sentences
    (lowercase, no punctuation) overlap by at least half (Jaccard ≥ 0.5,
    :func:`answers_agree`);
  - the **first-token KL**: the mean KL divergence of the first answer token's distribution
    under each other run from the given query's (top-20 log-probabilities,
    :func:`~span_workflows.logprobs.kl_top`; a top-k estimate, negative values read as 0).

  The control measures how much the model moves for nothing. A plus is **order-sensitive**
  when its answers agree clearly less often than the control's — by at least ``margin``
  (default 0.5 of the pairs) — while its first-token KL is at least the control's; or when
  some orders do give other answers and the first-token KL moves clearly more than the
  control's: at least :data:`KL_FACTOR` times it and at least :data:`KL_MIN` nat (when every
  order gives the same answer, the first token's distribution alone is no evidence). So model
  noise is not called order dependence; the report says by how much each figure moved.

Verdict of a plus (:attr:`PlusReport.verdict`):

* ``flagged`` — an ``error`` finding of the static checks; or a static ``warning`` that the
  order check *confirms* (the finding ``order-sensitive``, an error, says by how much);
* ``warning`` — static warnings and no order check ran; or no static evidence at all but the
  order check found the plus order-sensitive (the finding ``order-sensitive`` is then a
  warning: on a small model, reordering documents that do commute moves the answers too — its
  position bias, which no whitespace control can show; measured on SmolLM2-135M, 6 of the 24
  commuting pluses of the labelled set, ``span-workflows bench lint`` — so the model's
  sensitivity alone is reported, not flagged);
* ``clean`` — nothing but notes, or static warnings the order check *cleared*.

The thresholds (``margin``, :data:`KL_FACTOR`, :data:`KL_MIN`) were set on a pilot run of 14
cases of that labelled set; its held-out group measures how they carry over.

A plus the order check cannot reorder is not run: a repeat (copies of one G), a plus of one
child, and a plus at the top of the query (independent generations, none reads another).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from span_workflows.commutativity.rules import (
    Finding,
    PlusSite,
    check_site,
    plus_sites,
    replace_at,
    with_children_of_site,
)
from span_workflows.errors import SpanQueryError
from span_workflows.logprobs import kl_top
from span_workflows.query.ir import (
    Assistant,
    Chat,
    Cross,
    Fragment,
    Generate,
    Map,
    Node,
    Plus,
    Repeat,
    System,
    User,
    rewrite_bottom_up,
)
from span_workflows.query.validate import validate

#: The rule name of the order check's finding.
ORDER_RULE = "order-sensitive"
#: Top log-probabilities read for the first answer token.
TOP_LOGPROBS = 20
#: How far below the control's the answer agreement across orders must fall (a share of pairs).
DEFAULT_MARGIN = 0.5
#: The first-token KL across orders flags a plus alone at this many times the control's ...
KL_FACTOR = 3.0
#: ... and at least this many nats.
KL_MIN = 0.04
#: Two answers agree when the word sets of their first sentences overlap this much (Jaccard).
AGREEMENT_JACCARD = 0.5
#: Orders (and control versions) per plus unless ``trials`` says otherwise.
DEFAULT_TRIALS = 3
#: The most tokens each G of the order check generates.
DEFAULT_ANSWER_TOKENS = 24


class CommutativityWarning(UserWarning):
    """``@commutative(check=True)`` found evidence that a collection's order matters."""


class OrderRunner(Protocol):
    """What the order check needs of a backend: the stock baseline with first-token
    log-probabilities (:meth:`Engine.execute_many
    <span_workflows.runtime.engine.Engine.execute_many>` with ``span_mode=False, logprobs=k``)."""

    def execute_many(self, queries: Sequence[Node], *, span_mode: bool = True,
                     logprobs: int | None = None) -> list[Any]:
        """Run ``queries`` together; results with ``text`` and ``first_logprobs``."""
        ...


@dataclass(frozen=True, slots=True)
class OrderCheck:
    """The order check of one plus (see the module docstring): ``orders`` distinct orders and
    ``controls`` whitespace versions were run (the given query counts in both)."""

    orders: int
    controls: int
    agreement: float
    control_agreement: float
    kl: float
    control_kl: float
    margin: float
    answers: tuple[str, ...]
    control_answers: tuple[str, ...]
    seconds: float

    @property
    def drop(self) -> float:
        """How far the answer agreement across orders falls below the control's."""
        return self.control_agreement - self.agreement

    @property
    def answers_moved(self) -> bool:
        """Answers agree less across orders than under whitespace, by at least ``margin``,
        and the first-token KL is not below the control's."""
        return self.drop >= self.margin - 1e-9 and _zero(self.kl) >= _zero(self.control_kl)

    @property
    def first_token_moved(self) -> bool:
        """Some orders give other answers, and the first-token KL across orders is at least
        :data:`KL_FACTOR` times the control's and at least :data:`KL_MIN`."""
        kl = _zero(self.kl)
        return (self.agreement < 1.0 - 1e-9 and kl >= KL_MIN
                and kl >= KL_FACTOR * _zero(self.control_kl))

    @property
    def order_sensitive(self) -> bool:
        """Whether the answers or the first token moved clearly more under reordering than
        under whitespace (see the module docstring)."""
        return self.answers_moved or self.first_token_moved

    def summary(self) -> str:
        """One line: both agreements and their difference, both KLs and their ratio."""
        ratio = _zero(self.kl) / _zero(self.control_kl) if _zero(self.control_kl) else math.inf
        times = "" if math.isinf(ratio) or math.isnan(ratio) else f", {ratio:.1f}×"
        points = round(-100 * self.drop)
        return (f"answers agree in {_share(self.agreement, self.orders)} pairs of orders vs "
                f"{_share(self.control_agreement, self.controls)} of whitespace controls "
                f"({points:+d} points); first-token KL {_nat(self.kl)} vs "
                f"{_nat(self.control_kl)}{times}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], margin: float | None = None) -> OrderCheck:
        """The inverse of :meth:`to_dict` (what is derived is computed again, at ``margin``
        when given)."""
        def number(key: str) -> float:
            value = data.get(key)
            return float("nan") if value is None else float(value)

        return cls(int(data["orders"]), int(data["controls"]), float(data["agreement"]),
                   float(data["control_agreement"]), number("kl"), number("control_kl"),
                   float(data["margin"] if margin is None else margin),
                   tuple(data["answers"]), tuple(data["control_answers"]),
                   float(data["seconds"]))

    def to_dict(self) -> dict[str, Any]:
        """The check as JSON-ready fields."""
        return {"orders": self.orders, "controls": self.controls,
                "agreement": self.agreement, "control_agreement": self.control_agreement,
                "drop": self.drop, "kl": _finite(self.kl), "control_kl": _finite(self.control_kl),
                "margin": self.margin, "answers_moved": self.answers_moved,
                "first_token_moved": self.first_token_moved,
                "order_sensitive": self.order_sensitive,
                "answers": list(self.answers), "control_answers": list(self.control_answers),
                "seconds": self.seconds}


@dataclass
class PlusReport:
    """What lint found for one plus (or retrieve, repeat, map) at ``path``."""

    path: str
    kind: str
    children: int
    findings: list[Finding]
    check: OrderCheck | None = None
    #: why no order check ran when one was asked for ("" otherwise)
    skipped: str = ""

    def has_static(self, severity: str) -> bool:
        """Whether a static check (not the order check) found something at ``severity``."""
        return any(f.severity == severity and f.rule != ORDER_RULE for f in self.findings)

    @property
    def evidence(self) -> bool:
        """Whether the static checks found an error or a warning."""
        return self.has_static("error") or self.has_static("warning")

    @property
    def confirmed(self) -> bool:
        """Whether the order check found the plus order-sensitive where the static checks
        found evidence (an error or a warning) too."""
        return self.check is not None and self.check.order_sensitive and self.evidence

    @property
    def cleared(self) -> bool:
        """Whether the order check cleared this plus's static warnings (no static error)."""
        return (self.check is not None and not self.check.order_sensitive
                and self.has_static("warning") and not self.has_static("error"))

    @property
    def verdict(self) -> str:
        """``flagged``, ``warning`` or ``clean`` (see the module docstring)."""
        if self.has_static("error") or self.confirmed:
            return "flagged"
        if self.check is None:
            return "warning" if self.has_static("warning") else "clean"
        return "warning" if self.check.order_sensitive else "clean"

    def attach(self, check: OrderCheck) -> None:
        """Record the order check; when it finds the plus order-sensitive, add the finding
        ``order-sensitive`` first: an error when it confirms a static warning, else a
        warning."""
        self.check = check
        self.findings = [f for f in self.findings if f.rule != ORDER_RULE]
        if check.order_sensitive:
            severity = "error" if self.evidence else "warning"
            evidence = check.summary()
            if severity == "warning":
                evidence += " — no static evidence: the model's answer moves with the order"
            self.findings.insert(0, Finding(ORDER_RULE, severity, self.path, evidence))

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready fields."""
        return {"path": self.path, "kind": self.kind, "children": self.children,
                "verdict": self.verdict, "cleared": self.cleared,
                "findings": [f.to_dict() for f in self.findings],
                "order_check": self.check.to_dict() if self.check else None,
                "skipped": self.skipped}


@dataclass
class LintReport:
    """Every plus of one query, with its findings and, when it ran, its order check."""

    pluses: list[PlusReport]
    trials: int = 0
    model: str | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged(self) -> list[PlusReport]:
        """The pluses whose verdict is ``flagged``."""
        return [p for p in self.pluses if p.verdict == "flagged"]

    @property
    def verdict(self) -> str:
        """The worst verdict of the query's pluses (``clean`` without any)."""
        verdicts = {p.verdict for p in self.pluses}
        for name in ("flagged", "warning"):
            if name in verdicts:
                return name
        return "clean"

    @property
    def exit_code(self) -> int:
        """What ``span-workflows lint`` exits with: 1 when a plus is flagged, else 0."""
        return 1 if self.flagged else 0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready fields (``span-workflows lint --json``)."""
        return {"verdict": self.verdict, "flagged": len(self.flagged),
                "pluses": [p.to_dict() for p in self.pluses], "trials": self.trials,
                "model": self.model, "seconds": self.seconds, **self.extra}


def lint(query: Node | str | bytes | Mapping[str, Any], backend: OrderRunner | None = None,
         *, trials: int = DEFAULT_TRIALS, answer_tokens: int = DEFAULT_ANSWER_TOKENS,
         margin: float = DEFAULT_MARGIN, seed: int = 0, progress: bool = False) -> LintReport:
    """Check every plus of ``query`` (a tree, or spnl JSON text or value): the static checks,
    and with a ``backend`` the order check of ``trials`` orders and ``trials`` whitespace
    controls per plus, each G greedy and cut at ``answer_tokens`` tokens (see the module
    docstring). Raises :class:`SpanQueryError` for an invalid query or option; ``TypeError``
    for a backend without the stock baseline (an HTTP :class:`SpanServer` has none)."""
    started = time.perf_counter()
    node = _parse(query)
    validate(node)
    if backend is not None:
        _check_backend(backend)
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 2:
            raise SpanQueryError("trials", f"must be an int of at least 2, got {trials!r}")
        if not isinstance(answer_tokens, int) or answer_tokens < 1:
            raise SpanQueryError("answer_tokens", f"must be a positive int, got "
                                                  f"{answer_tokens!r}")
    reports = []
    sites = plus_sites(node)
    bar = None
    if progress and backend is not None and sites:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sites), desc="order check", unit="plus", leave=False)
    for site in sites:
        report = PlusReport(site.path, site.kind, len(site.texts), check_site(site))
        if backend is not None:
            reason = _unorderable(site)
            if reason:
                report.skipped = reason
            else:
                report.attach(order_check(node, site, backend, trials=trials,
                                          answer_tokens=answer_tokens, margin=margin,
                                          seed=seed))
        if bar is not None:
            bar.update(1)
        reports.append(report)
    if bar is not None:
        bar.close()
    return LintReport(reports, trials if backend is not None else 0,
                      getattr(backend, "model_name", None) if backend is not None else None,
                      time.perf_counter() - started)


def _parse(query: Node | str | bytes | Mapping[str, Any]) -> Node:
    if isinstance(query, (str, bytes, Mapping)):
        from span_workflows.query.json_ir import from_json

        return from_json(query)
    return query


def _check_backend(backend: object) -> None:
    import inspect

    run = getattr(backend, "execute_many", None)
    if run is None:
        raise TypeError(f"{type(backend).__name__} cannot run queries (no execute_many)")
    params = inspect.signature(run).parameters
    if not {"span_mode", "logprobs"} <= set(params):
        raise TypeError(
            f"the order check runs queries in stock mode with log-probabilities: "
            f"{type(backend).__name__}.execute_many takes no span_mode and logprobs (use an "
            f"Engine)")


def _unorderable(site: PlusSite) -> str:
    """Why the order check does not run on ``site`` ("" when it does)."""
    if isinstance(site.node, Repeat):
        return "copies of one G: every order is the same"
    if len(site.texts) < 2:
        return "one child: one order"
    if site.parent is None:
        return "a top-level plus joins independent generations: none reads another"
    return ""


# --------------------------------------------------------------------------------------------
# the order check


def order_check(query: Node, site: PlusSite, backend: OrderRunner, *,
                trials: int = DEFAULT_TRIALS, answer_tokens: int = DEFAULT_ANSWER_TOKENS,
                margin: float = DEFAULT_MARGIN, seed: int = 0) -> OrderCheck:
    """Run ``query`` under ``trials`` orders of ``site``'s children and ``trials`` whitespace
    controls, greedily in stock mode, all in one ``execute_many`` call; compare (see the
    module docstring)."""
    started = time.perf_counter()
    rng = random.Random(f"{seed}:{site.path}")
    orders = child_orders(len(site.children), trials, rng)
    base = greedy(query, answer_tokens)
    base_site = _site_in(base, site)
    kids = base_site.children
    variants = [replace_at(base, site.index, with_children_of_site(
        base_site, [kids[i] for i in order])) for order in orders]
    controls = [replace_at(base, site.index, with_children_of_site(
        base_site, [respaced(k, trial, i) for i, k in enumerate(kids)]))
        for trial in range(1, trials)]
    results = backend.execute_many(variants + controls, span_mode=False,
                                   logprobs=TOP_LOGPROBS)
    answers = [_answer(r) for r in results]
    firsts = [dict(getattr(r, "first_logprobs", {}) or {}) for r in results]
    order_answers, control_answers = answers[:len(orders)], [answers[0], *answers[len(orders):]]
    order_firsts, control_firsts = firsts[:len(orders)], [firsts[0], *firsts[len(orders):]]
    return OrderCheck(
        orders=len(orders), controls=len(control_answers),
        agreement=agreement(order_answers), control_agreement=agreement(control_answers),
        kl=_mean_kl_from_first(order_firsts), control_kl=_mean_kl_from_first(control_firsts),
        margin=margin, answers=tuple(order_answers), control_answers=tuple(control_answers),
        seconds=time.perf_counter() - started)


def _site_in(query: Node, site: PlusSite) -> PlusSite:
    """The site at ``site.path`` in ``query`` (the same tree shape, other fields)."""
    for candidate in plus_sites(query):
        if candidate.index == site.index:
            return candidate
    raise AssertionError(f"no plus at {site.path}")  # greedy() keeps the shape


def child_orders(n: int, trials: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Up to ``trials`` distinct orders of ``n`` children: the given one, reversed, then
    random ones (fewer when ``n!`` is smaller)."""
    given = tuple(range(n))
    orders = [given]
    wanted = min(trials, math.factorial(n)) if n <= 8 else trials
    backwards = tuple(reversed(given))
    if len(orders) < wanted and backwards != given:
        orders.append(backwards)
    attempts = 0
    while len(orders) < wanted and attempts < 1000:
        attempts += 1
        order = list(given)
        rng.shuffle(order)
        if tuple(order) not in orders:
            orders.append(tuple(order))
    return orders


#: Where the order check's answers stop: the end of their first sentence or line (what
#: :func:`answer_words` compares).
ANSWER_STOPS = ("\n", ". ", "? ", "! ")


def greedy(query: Node, answer_tokens: int) -> Node:
    """``query`` with every generation greedy (temperature 0) and cut at ``answer_tokens``;
    the answers of the top generations (not those nested in them, whose whole output the
    outer one reads) also stop after their first sentence (:data:`ANSWER_STOPS`) unless
    their output is constrained (a JSON schema, tools)."""
    def cap(max_tokens: int) -> int:
        return answer_tokens if max_tokens == 0 else min(max_tokens, answer_tokens)

    def rule(node: Node) -> Node:
        if isinstance(node, (Generate, Chat, Map)):
            return dataclasses.replace(node, temperature=0.0, max_tokens=cap(node.max_tokens))
        return node

    def stop_early(node: Node) -> Node:
        sampling = node.sampling
        if sampling.json_schema is not None or sampling.tools:
            return node
        stops = tuple(dict.fromkeys((*sampling.stop, *ANSWER_STOPS)))
        return dataclasses.replace(node, sampling=dataclasses.replace(sampling, stop=stops))

    capped = rewrite_bottom_up(query, rule)
    if isinstance(capped, Generate):
        return stop_early(capped)
    if isinstance(capped, (Plus, Cross)):
        return dataclasses.replace(capped, children=tuple(
            stop_early(c) if isinstance(c, Generate) else c for c in capped.children))
    return capped


_MESSAGES = (System, User, Assistant, Fragment)


def respaced(node: Node, trial: int, salt: int = 0) -> Node:
    """``node`` with only the whitespace of its messages changed (version ``trial``): one
    space doubled at a place drawn from ``(trial, salt)``, and on even trials a trailing
    newline."""
    def rule(current: Node) -> Node:
        if isinstance(current, _MESSAGES):
            return dataclasses.replace(current, text=respace(current.text, trial, salt))
        if isinstance(current, Map):
            return dataclasses.replace(current, inputs=tuple(
                respace(t, trial, salt + i) for i, t in enumerate(current.inputs)))
        return current

    return rewrite_bottom_up(node, rule)


def respace(text: str, trial: int, salt: int = 0) -> str:
    """``text`` with one space doubled (drawn from ``(trial, salt)``) and, on even trials, a
    trailing newline; the words are untouched."""
    spaces = [m.start() for m in re.finditer(" ", text)]
    if spaces:
        at = random.Random(f"{trial}:{salt}").choice(spaces)
        text = text[:at] + "  " + text[at + 1:]
    if trial % 2 == 0 or not spaces:
        text += "\n"
    return text


def answer_words(text: str) -> frozenset[str]:
    """The words an answer is compared by: of its first sentence (first line), lowercase,
    punctuation dropped."""
    line = text.strip().split("\n", 1)[0]
    sentence = re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0]
    return frozenset(re.sub(r"[^\w\s]", " ", sentence.lower()).split())


def answers_agree(a: str, b: str) -> bool:
    """Whether two answers say the same: the words of their first sentences overlap by at
    least :data:`AGREEMENT_JACCARD` (Jaccard); two empty answers agree."""
    x, y = answer_words(a), answer_words(b)
    if not x and not y:
        return True
    return len(x & y) / len(x | y) >= AGREEMENT_JACCARD - 1e-9


def agreement(answers: Sequence[str]) -> float:
    """The share of pairs of ``answers`` that agree (:func:`answers_agree`); 1 with fewer than
    two."""
    pairs = list(itertools.combinations(answers, 2))
    if not pairs:
        return 1.0
    return sum(answers_agree(a, b) for a, b in pairs) / len(pairs)


def _mean_kl_from_first(firsts: Sequence[dict[int, float]]) -> float:
    """The mean KL of each later run's first token from the first run's (negative top-k
    estimates read as 0)."""
    values = [kl_top(firsts[0], other) for other in firsts[1:]]
    values = [max(0.0, v) for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def _zero(value: float) -> float:
    return 0.0 if math.isnan(value) else max(0.0, value)


def _share(value: float, runs: int) -> str:
    pairs = runs * (runs - 1) // 2
    return f"{round(value * pairs)}/{pairs}"


def _answer(result: Any) -> str:
    parts = getattr(result, "parts", None)
    if parts:
        return " || ".join(p.text for p in parts)
    return result.text


def _nat(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.3f} nat"


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


# --------------------------------------------------------------------------------------------
# @commutative(check=True)


class FirstCallCheck:
    """Lint (static checks) the first query a decorated function makes or returns, once, and
    warn with :class:`CommutativityWarning` when it found an error or a warning."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False
        self._lock = threading.Lock()

    def __call__(self, nodes: Sequence[Node], stacklevel: int = 3) -> LintReport | None:
        """Check ``nodes`` (the first call's query, or its collections) unless done."""
        with self._lock:
            if self.done:
                return None
            self.done = True
        reports = [lint(n) for n in nodes]
        findings = [f for r in reports for p in r.pluses for f in p.findings
                    if f.severity in ("error", "warning")]
        if findings:
            shown = "; ".join(f"{f.path or 'the plus'}: {f.rule} ({f.severity}): {f.evidence}"
                              for f in findings[:3])
            more = f" (and {len(findings) - 3} more)" if len(findings) > 3 else ""
            warnings.warn(CommutativityWarning(
                f"@commutative {self.name}: the order of this collection may matter — "
                f"{shown}{more}. Use a cross (an ordered join) if it does; run "
                f"`span-workflows lint` on the query for the order check."), stacklevel=stacklevel)
        return reports[0] if reports else None


def checker_for(func: Callable[..., Any]) -> FirstCallCheck:
    """The first-call check of a decorated function."""
    return FirstCallCheck(f"{getattr(func, '__qualname__', func)}()")


__all__ = [
    "AGREEMENT_JACCARD", "ANSWER_STOPS", "DEFAULT_ANSWER_TOKENS", "DEFAULT_MARGIN",
    "DEFAULT_TRIALS", "KL_FACTOR", "KL_MIN", "ORDER_RULE", "TOP_LOGPROBS", "CommutativityWarning",
    "FirstCallCheck", "LintReport", "OrderCheck", "OrderRunner", "PlusReport", "agreement",
    "answer_words", "answers_agree", "checker_for", "child_orders", "greedy", "lint",
    "order_check", "respace", "respaced",
]
