"""Which weights answer a query: the base model or one of the LoRA adapters served beside it.

One engine holds the base model and its adapters (vLLM's LoRA: one copy of the base in
memory, the adapter chosen per request). :class:`WeightsRouter` picks the weights per query,
once, for every request of its plan (prepares, links, nested G's, the answer), so that the
KV its spans are read from was computed under the same weights. In this order:

1. weights asked for by name win: ``weights=`` of ``execute`` (the base's name means the
   base, an adapter's name that adapter), or an adapter's name as a G's ``model`` or the
   OpenAI ``model`` field (there the base's name is the default model's, and is routed);
2. with routing off, or no span-ready adapter, the base;
3. stock mode (no spans) runs on the base, as does a query with tools or a JSON schema (agent
   steps: the span-ready adapter was not trained to call tools);
4. a query whose prompt holds a plus (a RAG context, drafts a judge reads) runs on the
   span-ready adapter, with the span options it records for itself unless the query sets
   its own — a plus of one span too: a retriever that returns one document this time and
   several the next must find that document's KV under the same weights. In span form the
   adapter loses no more against the base's stock answers than the base does in span form,
   mostly far less (8 short documents: 39.6 % against the base's 32.3 %, stock 54.2 %;
   docs/guides/weights.md), though it is not always above stock;
5. everything else on the base.

The plan runs unchanged; :func:`on_weights` stamps its requests and probes with the chosen
adapter and its result's ``metrics.weights`` with the name of the weights that answered.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from span_vllm.contract import adapter_digest
from span_workflows.compiler.model import span_ready_options
from span_workflows.errors import SpanQueryError
from span_workflows.query.ir import Generate, Node, Plus, iter_nodes
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.plan import Plan, Probe, Request
from span_workflows.runtime.result import Result


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter served beside the base: its ``name`` (what requests ask for), its
    directory, the SHA-256 of its ``adapter_*`` files (``digest``), vLLM's integer id (taken
    from the digest, so retrained weights are loaded anew), its LoRA rank, and the span
    options it records (``None``: not span-ready)."""

    name: str
    path: Path
    digest: str
    rank: int
    span_options: Mapping[str, Any] | None = None

    @property
    def lora_int_id(self) -> int:
        """vLLM's ``lora_int_id`` (>= 1), from the content digest."""
        return int(self.digest[:7], 16) + 1

    @property
    def span_ready(self) -> bool:
        return self.span_options is not None

    def lora_request(self) -> Any:
        """vLLM's ``LoRARequest`` of this adapter."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_int_id, str(self.path))

    @classmethod
    def load(cls, name: str, path: str | Path) -> Adapter:
        """The adapter in directory ``path`` (a PEFT LoRA: ``adapter_config.json`` and its
        weights); raises :class:`SpanQueryError` naming what is missing."""
        if not isinstance(name, str) or not name or "=" in name:
            raise SpanQueryError("adapters", f"adapter name must be a non-empty string "
                                             f"without '=', not {name!r}")
        root = Path(path).expanduser().resolve()
        config_file = root / "adapter_config.json"
        if not config_file.is_file():
            raise SpanQueryError(f"adapters.{name}",
                                 f"{root} is not a LoRA adapter (no adapter_config.json)")
        try:
            config = json.loads(config_file.read_text())
            rank = int(config.get("r", 0))
        except (OSError, ValueError, TypeError) as exc:
            raise SpanQueryError(f"adapters.{name}", f"unreadable {config_file}: {exc}") from None
        return cls(name, root, adapter_digest(root), rank, span_ready_options(root))


@dataclass(frozen=True, slots=True)
class Route:
    """The weights a query runs on: ``adapter`` (``None``: the base) and their ``name``."""

    name: str
    adapter: Adapter | None = None

    @property
    def lora(self) -> str | None:
        """What the plan's requests carry as ``weights``: the adapter's name, or ``None``."""
        return None if self.adapter is None else self.adapter.name


@dataclass
class WeightsRouter:
    """Chooses a query's weights (see the module docstring). ``base`` is the base model's
    name, ``adapters`` the adapters by name; ``enabled=False`` keeps every query on the base
    unless it names an adapter; ``aliases``: other names of the base (a server's
    ``--served-model-name`` list)."""

    base: str
    adapters: dict[str, Adapter] = field(default_factory=dict)
    enabled: bool = True
    aliases: tuple[str, ...] = ()

    @property
    def span_adapter(self) -> Adapter | None:
        """The adapter span queries go to: the first span-ready one."""
        return next((a for a in self.adapters.values() if a.span_ready), None)

    def names(self) -> list[str]:
        """The base's name, then each adapter's."""
        return [self.base, *self.adapters]

    def named(self, name: str, where: str = "weights") -> Route:
        """The weights called ``name``; raises :class:`SpanQueryError` at ``where``."""
        if name.lower() in {n.lower() for n in (self.base, *self.aliases)}:
            return Route(self.base)
        adapter = self.adapters.get(name)
        if adapter is None:
            raise SpanQueryError(where, f"unknown weights {name!r} (this engine serves: "
                                        f"{', '.join(self.names())})")
        return Route(adapter.name, adapter)

    def choose(self, node: Node, span_mode: bool = True, asked: str | None = None) -> Route:
        """The weights of the normalized query ``node``."""
        if asked is not None:
            return self.named(asked)
        for g in _generations(node):
            if g.model is not None and g.model in self.adapters:
                return self.named(g.model, "model")
        span = self.span_adapter
        if not self.enabled or span is None or not span_mode:
            return Route(self.base)
        if any(g.sampling.tools or g.sampling.json_schema for g in _generations(node)):
            return Route(self.base)
        if has_spans(node):
            return Route(span.name, span)
        return Route(self.base)

    def options(self, route: Route, default: SpanOptions) -> SpanOptions:
        """The span options a query on ``route`` gets when it sets none: what its adapter
        records for itself, over ``default``'s alignment."""
        if route.adapter is None or not route.adapter.span_options:
            return default
        return replace(SpanOptions.coerce(dict(route.adapter.span_options)),
                       align=default.align)


#: The LoRA ranks vLLM accepts as ``max_lora_rank``.
_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def lora_options(adapters: Iterable[Adapter]) -> dict[str, Any]:
    """vLLM's engine options that serve ``adapters`` as LoRA beside the base (none: LoRA
    off, and no LoRA layers slow the base down)."""
    adapters = list(adapters)
    if not adapters:
        return {}
    rank = max(a.rank for a in adapters)
    return {"enable_lora": True, "max_loras": len(adapters), "max_cpu_loras": len(adapters),
            "max_lora_rank": next((r for r in _RANKS if r >= rank), rank)}


def lora_server_args(adapters: Iterable[Adapter]) -> list[str]:
    """:func:`lora_options` as ``vllm serve`` flags, with ``--lora-modules name=path``."""
    adapters = list(adapters)
    options = lora_options(adapters)
    if not options:
        return []
    return ["--enable-lora", "--max-loras", str(options["max_loras"]),
            "--max-cpu-loras", str(options["max_cpu_loras"]),
            "--max-lora-rank", str(options["max_lora_rank"]),
            "--lora-modules", *(f"{a.name}={a.path}" for a in adapters)]


def _generations(node: Node) -> Iterable[Generate]:
    return (n for n in iter_nodes(node) if isinstance(n, Generate))


def has_spans(node: Node) -> bool:
    """Whether a G's prompt in ``node`` holds a plus (of one child or more)."""
    return any(isinstance(n, Plus) and n.children
               for g in _generations(node) for n in iter_nodes(g.input))


def on_weights(plan: Plan, route: Route) -> Plan:
    """``plan`` with every request and probe it yields on ``route``'s weights, and its
    result (and the results nested in it) marked with their name."""
    adapter = route.lora
    answer: Any = None
    while True:
        try:
            step = plan.send(answer)
        except StopIteration as stop:
            result: Result = stop.value
            _mark(result, route.name)
            return result
        if isinstance(step, list):
            for request in step:
                if isinstance(request, Request):
                    request.weights = adapter
        elif isinstance(step, Probe):
            step.weights = [adapter] * len(step.sequences)
        answer = yield step


def _mark(result: Result, name: str) -> None:
    result.metrics = replace(result.metrics, weights=name)
    for part in result.parts:
        _mark(part, name)
    for nested in result.nested.values():
        _mark(nested, name)


__all__ = ["Adapter", "Route", "WeightsRouter", "has_spans", "lora_options", "lora_server_args",
           "on_weights"]
