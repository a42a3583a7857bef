"""A plan request on its way into vLLM and its outputs on the way back (stub outputs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from span_vllm import contract
from span_workflows.query.sampling import Sampling
from span_workflows.runtime.plan import Fill, Request
from span_workflows.runtime.streaming import ChoiceStream, PartStream
from span_workflows.runtime.vllm_io import RequestRun, sampling_params, tokens_prompt

SEGMENTS = ((32, contract.ANCHORED), (64, contract.ORDERED))


def _out(text: str, tokens: list[int], cached: int, finished: bool = False) -> SimpleNamespace:
    sample = SimpleNamespace(index=0, text=text, token_ids=tokens, logprobs=None,
                             finish_reason="length" if finished else None)
    return SimpleNamespace(outputs=[sample], prompt_token_ids=None, num_cached_tokens=cached,
                           finished=finished)


def test_segments_and_salt_travel_next_to_the_tokens() -> None:
    req = Request([1, 2, 3], max_tokens=0, temperature=0.7, n=2, segments=SEGMENTS,
                  cache_salt="tenant")
    assert tokens_prompt(req) == {"prompt_token_ids": [1, 2, 3], "cache_salt": "tenant"}
    params = sampling_params(req, "key")
    assert params.max_tokens == 1 and params.n == 2  # at least one token is generated
    assert params.extra_args == {**contract.layout_args(SEGMENTS, "key"),
                                 **contract.tag_args(req.tag)}
    plain_req = Request([1], 4, 0.0)
    plain = sampling_params(plain_req, "key")
    # a request without segments carries only its step tag (no layout: stock hashing)
    assert plain.extra_args == contract.tag_args(plain_req.tag) != contract.tag_args(req.tag)
    assert "cache_salt" not in tokens_prompt(plain_req)
    assert plain.structured_outputs is None and not plain.stop
    assert contract.ALIGN_KEY not in plain.extra_args and not plain.ignore_eos


def test_a_filled_request_runs_past_its_end_token_and_stops_on_the_fill_stop() -> None:
    fill = Fill(pad=198, stop=16, ends=(2,), budget=40, bias={"boost": 1.0})
    params = sampling_params(Request([1, 2, 3], 72, 0.0, fill=fill), "key")
    assert params.ignore_eos and params.stop_token_ids == [16] and params.max_tokens == 72
    spec = params.extra_args[contract.ALIGN_KEY]
    assert spec == {"pad": 198, "stop": 16, "ends": [2], "budget": 40,
                    "bias": {**contract.BIAS_DEFAULTS, "boost": 1.0}}
    # the plugin's processor accepts exactly this, and refuses a request that would not stop
    from span_vllm.align import BlockAlignLogitsProcessor

    BlockAlignLogitsProcessor.validate_params(params)
    params.ignore_eos = False
    with pytest.raises(ValueError, match="ignore_eos"):
        BlockAlignLogitsProcessor.validate_params(params)


def test_sampling_options_and_the_output_constraint_reach_vllm() -> None:
    sampling = Sampling.from_options({
        "top_p": 0.5, "top_k": 3, "seed": 11, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "stop": ["\n\n"], "tool_choice": "required",
        "tools": [{"name": "f", "parameters": {"type": "object"}}]})
    params = sampling_params(Request([1], 4, 1.0, sampling=sampling), "key")
    assert (params.top_p, params.top_k, params.seed) == (0.5, 3, 11)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.stop == ["\n\n"]
    schema = params.structured_outputs.json
    assert schema["required"] == ["tool_calls"]  # "required": calls only, no content answer


def test_a_run_streams_its_part_and_reports_its_output() -> None:
    deltas: list[str] = []
    run = RequestRun(Request([1, 2, 3], 4, 0.0, part=0, min_cached=2), 10.0,
                     PartStream(deltas.append))
    assert run.see(_out("", [], 3), 10.5) is False          # no token yet
    assert run.see(_out("Hel", [7], 3), 11.0) is False
    assert run.see(_out("Hello", [7, 8], 3, finished=True), 11.5) is False
    out = run.output(12.0)
    assert deltas == ["Hel", "lo"]
    assert (out.texts, out.token_ids, out.prompt_tokens, out.cached_tokens) == (
        ["Hello"], [[7, 8]], 3, 3)
    assert (out.submitted, out.first_token, out.finished, out.short) == (10.0, 11.0, 12.0, False)
    assert out.finish_reasons == ["length"]


def test_a_run_whose_hits_fell_short_is_aborted_before_it_streams() -> None:
    deltas: list[str] = []
    run = RequestRun(Request([1, 2, 3], 4, 0.0, part=0, min_cached=3), 0.0,
                     PartStream(deltas.append))
    assert run.see(_out("Hel", [7], 2), 1.0) is True
    out = run.output(1.0)
    assert out.short and deltas == []


def test_samples_of_n_are_kept_apart_and_streamed_per_choice() -> None:
    def sample(index: int, text: str, reason: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(index=index, text=text, token_ids=[1] * len(text),
                               logprobs=None, finish_reason=reason)

    def out(*samples: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(outputs=list(samples), prompt_token_ids=None,
                               num_cached_tokens=0, finished=False)

    pieces: list[tuple[int, str]] = []
    choices = ChoiceStream(lambda i, d: pieces.append((i, d)))
    run = RequestRun(Request([1, 2], 4, 1.0, n=2, part=0), 0.0, choices)
    # vLLM's streamed outputs for n > 1 carry only the samples that advanced
    run.see(out(sample(1, "B")), 1.0)
    run.see(out(sample(0, "Aa")), 1.1)
    run.see(out(sample(1, "Bb", "length")), 1.2)
    run.see(out(sample(0, "Aa!", "stop")), 1.3)
    result = run.output(2.0)
    assert result.texts == ["Aa!", "Bb"]
    assert pieces == [(1, "B"), (0, "Aa"), (1, "b"), (0, "!")]
    assert choices.finish_reasons == {0: "stop", 1: "length"}


def test_sampling_extras_reach_only_the_answer() -> None:
    extra = {"top_p": 0.5, "seed": 3, "stop": ["x"]}
    answer = sampling_params(Request([1], 4, 0.7, part=0), "key", extra)
    assert (answer.top_p, answer.seed, answer.stop) == (0.5, 3, ["x"])
    prepare = sampling_params(Request([1], 1, 0.0), "key", extra)
    assert (prepare.top_p, prepare.seed, prepare.stop) == (1.0, None, [])
