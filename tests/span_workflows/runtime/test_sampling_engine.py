"""Sampling options, stop sequences and constrained output (JSON schema, tools) on the real
SmolLM2-135M engine: each option must change what vLLM generates, not just be carried."""

from __future__ import annotations

import json

import pytest

from span_workflows.query.builders import g
from span_workflows.query.sampling import ToolSpec

pytestmark = pytest.mark.engine

PROMPT = "Write a short story about a cat who lives in a lighthouse."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
POPULATION = {"type": "function", "function": {
    "name": "get_population", "description": "How many people live in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_stop_sequences_end_generation_in_the_sampler(engine) -> None:
    free = engine.execute(g(PROMPT, max_tokens=48, temperature=0.0))
    words = free.text.split()
    assert len(words) > 8 and free.finish_reason == "length"
    stop = " " + words[5]
    stopped = engine.execute(g(PROMPT, max_tokens=48, temperature=0.0, stop=[stop]))
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.finish_reason == "stop"
    # Generation ended at the stop sequence: far fewer tokens than max_tokens were generated.
    assert stopped.metrics.generated_tokens < free.metrics.generated_tokens // 2


def test_top_k_one_is_greedy_and_a_seed_repeats_a_sample(engine) -> None:
    greedy = engine.execute(g(PROMPT, max_tokens=24, temperature=0.0))
    top1 = engine.execute(g(PROMPT, max_tokens=24, temperature=1.5, top_k=1))
    assert top1.text == greedy.text
    seeded = [engine.execute(g(PROMPT, max_tokens=24, temperature=1.5, seed=s)).text
              for s in (7, 7, 8, 9)]
    assert seeded[0] == seeded[1]
    assert len(set(seeded)) >= 2  # other seeds sample other stories


def test_penalties_and_logprobs_reach_the_sampler(engine) -> None:
    prompt = "Repeat the word 'cat' twenty times."
    plain = engine.execute(g(prompt, max_tokens=32, temperature=0.0, logprobs=2))
    assert len(plain.logprobs) == plain.metrics.generated_tokens
    assert all(1 <= len(step) <= 3 for step in plain.logprobs)
    penalized = engine.execute(g(prompt, max_tokens=32, temperature=0.0, frequency_penalty=2.0))
    assert penalized.text != plain.text


def test_json_schema_constrains_the_answer(engine) -> None:
    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}
    result = engine.execute(g("Which is the largest city of France, and how many people "
                              "live there? Answer in JSON.", max_tokens=64, temperature=0.0,
                              json_schema=schema))
    value = json.loads(result.text)
    assert set(value) == {"city", "population"}
    assert isinstance(value["city"], str) and isinstance(value["population"], int)
    assert result.finish_reason == "stop"


def test_required_tool_call_is_valid_and_names_a_given_tool(engine) -> None:
    result = engine.execute(g("What is the weather in Paris?", max_tokens=64, temperature=0.0,
                              tools=[WEATHER, POPULATION], tool_choice="required"))
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert result.tool_calls
    for call in result.tool_calls:
        assert call.name in {"get_weather", "get_population"}
        assert isinstance(call.arguments["city"], str)
    # The tools were described to the model in a system message.
    assert "get_population" in engine.tokenizer.decode(result.query.token_ids)


def test_named_tool_choice_calls_that_tool_only(engine) -> None:
    result = engine.execute(g("What is the weather in Paris?", max_tokens=64, temperature=0.0,
                              tools=[WEATHER, POPULATION], tool_choice="get_population"))
    assert [c.name for c in result.tool_calls][:1] == ["get_population"]
    assert {c.name for c in result.tool_calls} == {"get_population"}


def test_unknown_options_and_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported sampling option.*top_q"):
        g("hi", top_q=0.5)
    with pytest.raises(ValueError, match="top_p must be a number in"):
        g("hi", top_p=0.0)
    with pytest.raises(ValueError, match="tool_choice must be one of"):
        g("hi", tools=[WEATHER], tool_choice="get_time")
    with pytest.raises(ValueError, match="a tool needs a non-empty 'name'"):
        ToolSpec.from_dict({"description": "nameless"})
