"""Which weights answer a query (span_workflows.runtime.routing): the rules, named weights, the
adapter's own span options, and every request and probe of a plan stamped with the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from span_workflows.compiler.model import ADAPTERS_DIR, SPAN_MODEL_NAME
from span_workflows.compiler.optimize import optimize
from span_workflows.errors import SpanQueryError
from span_workflows.query import builders as b
from span_workflows.query.ir import Generate
from span_workflows.query.sampling import Sampling, ToolSpec
from span_workflows.query.span_options import SpanOptions
from span_workflows.runtime.plan import Probe, Request
from span_workflows.runtime.result import Metrics, Result
from span_workflows.runtime.routing import (
    Adapter,
    Route,
    WeightsRouter,
    has_spans,
    lora_options,
    lora_server_args,
    on_weights,
)

BASE = "base-model"
DOCS = ("The red house belongs to Anna.", "The blue house belongs to Bram.")


def _adapter(tmp_path: Path, name: str, *, span_ready: bool = True, rank: int = 16,
             weights: bytes = b"w") -> Path:
    root = tmp_path / name
    root.mkdir()
    (root / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    (root / "adapter_model.safetensors").write_bytes(weights)
    if span_ready:
        (root / "span_workflows.json").write_text(json.dumps(
            {"span_ready": True, "span_options": {"attend": "prefix", "link_blocks": 0}}))
    return root


@pytest.fixture
def router(tmp_path: Path) -> WeightsRouter:
    span = Adapter.load("span", _adapter(tmp_path, "span"))
    style = Adapter.load("style", _adapter(tmp_path, "style", span_ready=False))
    return WeightsRouter(BASE, {"style": style, "span": span})


def _rag(**kwargs: object) -> Generate:
    return optimize(b.rag("Answer.", DOCS, "Who owns the red house?", **kwargs))


def test_a_prompt_with_spans_runs_on_the_span_ready_adapter(router) -> None:
    route = router.choose(_rag())
    assert route == Route("span", router.adapters["span"])
    assert router.span_adapter is router.adapters["span"]  # the first span-ready one


def test_chats_stock_mode_tools_and_schemas_run_on_the_base(router) -> None:
    assert router.choose(optimize(b.chat("hi"))).adapter is None
    assert router.choose(_rag(), span_mode=False).adapter is None
    tool = ToolSpec("get_weather", "Weather of a town", '{"type":"object"}')
    with_tools = _rag()
    with_tools = Generate(with_tools.input, 32, 0.0, sampling=Sampling(tools=(tool,)))
    assert router.choose(with_tools).name == BASE
    schema = Generate(_rag().input, 32, 0.0, sampling=Sampling(json_schema='{"type":"object"}'))
    assert router.choose(schema).name == BASE
    assert not has_spans(optimize(b.chat("hi", "there")))


def test_a_single_span_runs_on_the_adapter_too(router) -> None:
    """A document retrieved alone now and with others later is read under one set of
    weights."""
    one_doc = optimize(b.rag("Answer.", DOCS[:1], "Who?"))
    assert has_spans(one_doc) and router.choose(one_doc).name == "span"


def test_named_weights_win_over_the_rules(router) -> None:
    assert router.choose(_rag(), asked=BASE).adapter is None
    assert router.choose(_rag(), asked=BASE.upper()).adapter is None
    assert router.choose(optimize(b.chat("hi")), asked="style").name == "style"
    assert router.choose(optimize(b.chat("hi", model="span"))).name == "span"
    # an unknown G model (spnl's names) is no request for weights: the rules apply
    assert router.choose(_rag(model="ollama/granite")).name == "span"
    with pytest.raises(SpanQueryError, match=r"weights: unknown weights 'nope' .*base-model, "
                                             r"style, span"):
        router.choose(_rag(), asked="nope")


def test_routing_off_keeps_everything_on_the_base_unless_named(router) -> None:
    router.enabled = False
    assert router.choose(_rag()).name == BASE
    assert router.choose(_rag(), asked="span").name == "span"
    assert WeightsRouter(BASE).choose(_rag()).name == BASE  # no adapters at all


def test_a_span_ready_adapter_brings_its_own_span_options(router) -> None:
    default = SpanOptions(link_blocks=1, align="crop")
    own = router.options(router.choose(_rag()), default)
    assert (own.link_blocks, own.attend, own.align) == (0, "prefix", "crop")
    assert router.options(Route(BASE), default) is default
    assert router.options(Route("style", router.adapters["style"]), default) is default


def test_an_adapter_is_named_by_its_content(tmp_path: Path) -> None:
    one = Adapter.load("a", _adapter(tmp_path, "one", weights=b"first"))
    same = Adapter.load("b", _adapter(tmp_path, "same", weights=b"first"))
    other = Adapter.load("a", _adapter(tmp_path, "other", weights=b"second"))
    assert one.digest == same.digest != other.digest
    assert one.lora_int_id == same.lora_int_id != other.lora_int_id
    assert one.lora_int_id >= 1


def test_bad_adapters_are_refused_naming_the_adapter(tmp_path: Path) -> None:
    with pytest.raises(SpanQueryError, match=r"adapters.x: .* is not a LoRA adapter"):
        Adapter.load("x", tmp_path)
    with pytest.raises(SpanQueryError, match="adapter name must be"):
        Adapter.load("a=b", _adapter(tmp_path, "fine"))


def test_vllm_options_serve_every_adapter_at_a_supported_rank(tmp_path: Path) -> None:
    adapters = [Adapter.load("a", _adapter(tmp_path, "a", rank=12)),
                Adapter.load("b", _adapter(tmp_path, "b", rank=4))]
    assert lora_options([]) == {} and lora_server_args([]) == []
    assert lora_options(adapters) == {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 2,
                                      "max_lora_rank": 16}
    args = lora_server_args(adapters)
    assert args[:2] == ["--enable-lora", "--max-loras"]
    assert args[-3:] == ["--lora-modules", f"a={adapters[0].path}", f"b={adapters[1].path}"]


def test_the_bundled_adapter_is_span_ready() -> None:
    adapter = Adapter.load(SPAN_MODEL_NAME, ADAPTERS_DIR / SPAN_MODEL_NAME)
    assert adapter.span_ready and adapter.rank == 16
    assert adapter.span_options == {"attend": "prefix", "link_blocks": 0}


def test_every_request_and_probe_of_a_plan_runs_on_the_chosen_weights(router) -> None:
    def plan():
        hits = yield Probe([object(), object()])  # type: ignore[list-item]
        assert hits == [True, False]
        outs = yield [Request([1, 2], 1, 0.0), Request([3], 4, 0.0)]
        assert outs == ["a", "b"]
        inner = Result("inner", Metrics(0.0, 0, 0, 0))
        return Result("done", Metrics(0.1, 2, 0, 1), parts=[inner], nested={"x": inner})

    stamped = on_weights(plan(), router.choose(_rag()))
    probe = next(stamped)
    assert probe.weights == ["span", "span"]
    requests = stamped.send([True, False])
    assert [r.weights for r in requests] == ["span", "span"]
    with pytest.raises(StopIteration) as stop:
        stamped.send(["a", "b"])
    result = stop.value.value
    assert result.metrics.weights == "span"
    assert result.parts[0].metrics.weights == result.nested["x"].metrics.weights == "span"
    base_plan = on_weights(plan(), Route(BASE))
    assert next(base_plan).weights == [None, None]


def test_weights_travel_in_the_metrics_dict() -> None:
    metrics = Metrics(0.1, 3, 2, 1, weights="span")
    assert Metrics.from_dict(metrics.to_dict()) == metrics
    assert Metrics.from_dict({"ttft_s": 0.5}).weights == ""
