"""One engine, two weights, on the real default engine (SmolLM2-135M with the span-ready
adapter served as LoRA): span queries answered by the adapter in one engine step, everything
else by the base, the weights named in every result, no KV block shared between them, and the
adapter's LoRA forward equal to the merged checkpoint's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_MODEL_NAME, resolve_model
from span_workflows.errors import SpanQueryError
from span_workflows.query import builders as b
from span_workflows.query.sampling import ToolSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations"))
import agent_task  # noqa: E402  (the agent tests' two-tool task)

pytestmark = pytest.mark.engine

SYSTEM = "Answer from the documents in one short sentence."
PEOPLE = [("red", "Elm", "Anna", 31), ("blue", "Oak", "Bram", 44), ("green", "Pine", "Cleo", 29),
          ("yellow", "Ash", "Dirk", 52), ("white", "Birch", "Edda", 67),
          ("black", "Cedar", "Finn", 38)]
DOCS = [f"The {c} house on {s} Street belongs to {n}, who is {a} years old and keeps bees."
        for c, s, n, a in PEOPLE]


def test_the_default_engine_serves_the_span_ready_adapter_beside_the_base(engine) -> None:
    assert engine.model_name == BASE_MODEL_NAME
    assert list(engine.router.adapters) == [SPAN_MODEL_NAME]
    assert engine.router.span_adapter is engine.router.adapters[SPAN_MODEL_NAME]


def test_a_new_combination_of_cached_documents_is_one_step_on_the_adapter(engine) -> None:
    engine.reset_cache()
    first = engine.execute(b.rag(SYSTEM, DOCS[:4], "Who owns the green house?", max_tokens=16))
    assert first.metrics.weights == SPAN_MODEL_NAME
    assert first.metrics.prepare_requests == 4 and first.metrics.link_requests == 0
    assert "Cleo" in first.text
    engine.execute(b.rag(SYSTEM, DOCS[4:], "Who owns the white house?", max_tokens=4))
    mixed = engine.execute(b.rag(SYSTEM, [DOCS[5], DOCS[1], DOCS[4], DOCS[0]],
                                 "How old is Bram?", max_tokens=16))
    assert mixed.metrics.weights == SPAN_MODEL_NAME
    assert mixed.metrics.prepare_requests == 0 and mixed.metrics.link_requests == 0
    assert mixed.metrics.engine_steps == 1 and mixed.metrics.reused_tokens > 0
    engine.reset_cache()
    alone = engine.execute(b.rag(SYSTEM, [DOCS[5], DOCS[1], DOCS[4], DOCS[0]],
                                 "How old is Bram?", max_tokens=16))
    assert mixed.text == alone.text  # the hit answers as a fresh engine does


def test_stock_chats_and_tool_calls_run_on_the_base(engine) -> None:
    q = b.rag(SYSTEM, DOCS[:2], "Who owns the red house?", max_tokens=8)
    assert engine.stock(q).metrics.weights == BASE_MODEL_NAME
    assert engine.stock(q, weights=SPAN_MODEL_NAME).metrics.weights == SPAN_MODEL_NAME
    assert engine.execute(b.chat("Say hello.", max_tokens=4)).metrics.weights == BASE_MODEL_NAME
    city = '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}'
    tools = [ToolSpec("get_weather", "The current weather in a city", city),
             ToolSpec("get_population", "How many people live in a city", city)]
    with_documents = b.g(b.cross(b.system(agent_task.SYSTEM),
                                 b.plus(*[b.fragment(d) for d in DOCS[:2]]),
                                 b.user(agent_task.QUESTION)),
                         max_tokens=64, temperature=0.0, tools=tools)
    assert engine.weights_of(with_documents).name == BASE_MODEL_NAME  # tools win over spans
    agent = b.g(b.cross(b.system(agent_task.SYSTEM), b.user(agent_task.QUESTION)),
                max_tokens=64, temperature=0.0, tools=tools)
    result = engine.execute(agent)
    assert result.metrics.weights == BASE_MODEL_NAME
    assert result.tool_calls and {c.name for c in result.tool_calls} <= {
        "get_weather", "get_population"}


def test_named_weights_win_and_unknown_ones_are_refused(engine) -> None:
    q = b.rag(SYSTEM, DOCS[:2], "Who owns the blue house?", max_tokens=8)
    assert engine.execute(q, weights=BASE_MODEL_NAME).metrics.weights == BASE_MODEL_NAME
    chat = b.chat("Say hello.", max_tokens=4, model=SPAN_MODEL_NAME)
    assert engine.execute(chat).metrics.weights == SPAN_MODEL_NAME
    with pytest.raises(SpanQueryError, match="weights: unknown weights 'other'"):
        engine.execute(q, weights="other")


def test_the_same_documents_under_base_and_adapter_share_no_block(engine) -> None:
    docs = [d.replace("bees", "goats") for d in DOCS[:3]]
    q = b.rag(SYSTEM, docs, "Who owns the blue house?", max_tokens=12)
    engine.reset_cache()
    runs = {}
    for weights in (BASE_MODEL_NAME, SPAN_MODEL_NAME, BASE_MODEL_NAME, SPAN_MODEL_NAME):
        runs.setdefault(weights, []).append(engine.execute(q, weights=weights))
    for weights, (first, again) in runs.items():
        assert first.metrics.weights == again.metrics.weights == weights
        assert first.metrics.prepare_requests == 3 and first.metrics.reused_tokens == 0
        assert again.metrics.prepare_requests == 0 and again.metrics.reused_tokens > 0
        assert again.text == first.text  # each weights' own cache, read back unchanged
    engine.reset_cache()
    for weights, (first, _) in runs.items():
        assert engine.execute(q, weights=weights).text == first.text


def test_the_adapter_as_lora_computes_what_the_merged_checkpoint_does(engine) -> None:
    """Teacher-forced log-probabilities of a whole answer: the engine on the LoRA adapter
    (stock form, full attention) against the merged checkpoint in transformers."""
    from transformers import AutoModelForCausalLM

    q = b.rag(SYSTEM, DOCS[:3], "Who owns the green house?", max_tokens=12)
    [answer] = engine.execute_many([q], span_mode=False, weights=SPAN_MODEL_NAME, logprobs=1)
    assert answer.metrics.weights == SPAN_MODEL_NAME
    prompt = engine.compile(q, span_mode=False).token_ids
    merged = AutoModelForCausalLM.from_pretrained(str(resolve_model(SPAN_MODEL_NAME)),
                                                  dtype=torch.float32)
    ids = torch.tensor([list(prompt) + list(answer.token_ids)])
    with torch.no_grad():
        logits = merged(ids).logits[0, len(prompt) - 1:-1]
    reference = torch.log_softmax(logits.double(), -1)
    served = [step[token] for step, token in zip(answer.logprobs, answer.token_ids,
                                                 strict=False)]
    expected = [float(reference[i, t]) for i, t in enumerate(answer.token_ids)]
    assert len(served) == len(expected) >= 4
    assert max(abs(s - e) for s, e in zip(served, expected, strict=True)) < 1e-3


def test_the_adapter_is_warmed_at_start_so_a_first_query_builds_no_merged_weights(engine) -> None:
    from span_vllm import lora_cpu

    built = lora_cpu.merges_built()
    assert built > 0, "the adapter's merged weights were not built when the engine started"
    result = engine.execute(b.rag(SYSTEM, [f"{d} (warm-up check)" for d in DOCS[:2]],
                                  "Who owns the red house?", max_tokens=4))
    assert result.metrics.weights == SPAN_MODEL_NAME
    assert lora_cpu.merges_built() == built


def _adapter_copy(source: Path, target: Path, scale: float) -> Path:
    """The span-ready adapter at ``target`` with its ``lora_B`` weights times ``scale``."""
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    (target / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(source / "adapter_model.safetensors")
    save_file({k: v * scale if "lora_B" in k else v for k, v in tensors.items()},
              target / "adapter_model.safetensors")
    return target


def test_an_adapter_reloaded_after_an_eviction_reads_the_weights_its_blocks_are_keyed_by(
        engine, tmp_path, monkeypatch) -> None:
    """The default engine holds one LoRA (``max_loras = max_cpu_loras = 1``): two adapters
    alternating evict each other, and vLLM reloads an evicted one from its path on its next
    request. Its files rewritten in between (a run saving in place), the reload still reads
    the weights its cached blocks were computed with; blocks are never shared between the
    two; an explicit reload (``load_inplace``) is new weights, under a new key."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from span_vllm import contract
    from span_vllm.adapter_pins import ADAPTER_DIR_ENV

    monkeypatch.setenv(ADAPTER_DIR_ENV, str(tmp_path / "pins"))
    shipped = engine.router.span_adapter.path
    a_dir = _adapter_copy(shipped, tmp_path / "a", 1.0)
    b_dir = _adapter_copy(shipped, tmp_path / "b", -1.0)
    a = LoRARequest("evict-a", 901, str(a_dir))
    other = LoRARequest("evict-b", 902, str(b_dir))
    vllm_config = engine._engine.vllm_config.lora_config
    assert (vllm_config.max_loras, vllm_config.max_cpu_loras) == (1, 1)
    text = " ".join(DOCS) + " Who keeps bees on Oak Street?"
    ids = engine.tokenizer(text)["input_ids"]
    assert len(ids) > 2 * engine.block_size
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def ask(lora: LoRARequest, prompt: list[int] = ids) -> tuple[int, dict[int, float]]:
        [out] = engine._llm.generate([{"prompt_token_ids": prompt}], params,
                                     lora_request=lora, use_tqdm=False)
        top = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
        return out.num_cached_tokens or 0, top

    try:
        engine.reset_cache()
        cached, first = ask(a)
        assert cached == 0
        other_cached, on_b = ask(other)  # evicts a; the same tokens under b share nothing
        assert other_cached == 0 and on_b != first
        _adapter_copy(shipped, a_dir, 8.0)  # a's files rewritten while a is evicted
        cached, again = ask(a)  # a reloaded from its path
        assert cached >= 2 * engine.block_size  # its own blocks, from the cache
        assert again.keys() == first.keys()
        assert max(abs(again[t] - first[t]) for t in first) < 1e-4
        # the explicit reload: the rewritten weights, whose key no cached block has
        engine._engine.add_lora(LoRARequest("evict-a", 901, str(a_dir), load_inplace=True))
        cached, reloaded = ask(a)
        assert cached == 0 and reloaded != first
        engine._engine.remove_lora(901)
        engine._engine.remove_lora(902)
        assert contract.adapter_digest(a_dir) != contract.adapter_digest(b_dir)
    finally:
        engine.reset_cache()
    # the span-ready adapter (evicted by these) answers as before
    again = engine.execute(b.rag(SYSTEM, DOCS[:4], "Who owns the green house?", max_tokens=16))
    assert again.metrics.weights == SPAN_MODEL_NAME and "Cleo" in again.text
