"""What crosses from a plan into vLLM and back, for the embedded engine and the HTTP app alike.

A plan :class:`~span_workflows.runtime.plan.Request` becomes a tokens prompt (with vLLM's
``cache_salt``) and :class:`vllm.SamplingParams`: the request's sampling options, stop
sequences and output constraint (vLLM's structured outputs), and in ``extra_args`` the
request's span segments under this process's layout key
(:func:`span_vllm.contract.layout_args`), its step tag (:func:`span_vllm.contract.tag_args`,
under which the engine core counts the steps it waits for) and, for a nested G whose last block
is filled by generation (``Request.fill``), the fill (:func:`span_vllm.contract.align_args`,
with ``ignore_eos`` and the fill's stop token: the request ends after its pads, not at its
text's end); nothing else reaches the engine processes. While the
request runs, a :class:`RequestRun` reads vLLM's cumulative ``RequestOutput`` s: it notes the
first token, streams part texts, and says when the request must be aborted because its cache
hits fell short (a prepared span was evicted before it was used; the plan then prepares again
and retries). At the end it builds the plan's :class:`~span_workflows.runtime.plan.Output`, with
each sample's finish reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from span_vllm import contract
from span_workflows.query.sampling import answer_schema
from span_workflows.runtime.plan import Output, Request
from span_workflows.runtime.streaming import PartStream


def tokens_prompt(req: Request) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` of ``req`` (a dict): its token ids and ``cache_salt``."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt)}
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    return prompt


def sampling_params(req: Request, layout_key: str,
                    extra: Mapping[str, Any] | None = None) -> Any:
    """vLLM's ``SamplingParams`` of ``req``; its segments travel in ``extra_args`` (a request
    without segments hashes exactly as stock vLLM does). The G's own ``req.sampling`` sets
    the sampling options; ``extra``: more ``SamplingParams`` fields (``min_p``, ``seed``,
    ``stop``, ...) over those, applied to the answer's own generations (``req.part`` set)
    only: prepare and nested requests keep their fixed settings."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    s = req.sampling
    schema = answer_schema(s)
    options: dict[str, Any] = {
        "logprobs": req.logprobs, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "stop": list(s.stop) or None,
    }
    if req.part is not None:
        options.update(extra or {})
    extra_args = {**contract.tag_args(req.tag),
                  **(contract.layout_args(req.segments, layout_key) if req.segments else {})}
    fill = req.fill
    if fill is not None:
        extra_args.update(contract.align_args(fill.pad, fill.stop, fill.ends, fill.budget,
                                              fill.bias))
        options.update(ignore_eos=True, stop_token_ids=[fill.stop])
    return SamplingParams(
        max_tokens=max(1, req.max_tokens), temperature=req.temperature, n=req.n,
        structured_outputs=(None if schema is None else
                            StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
        extra_args=extra_args,
        **options,
    )


def warm_up(token_id: int) -> tuple[dict[str, Any], Any]:
    """A one-token request (prompt ``[token_id]``, greedy, one token out) to run once on each
    adapter when an engine or server starts: the work a LoRA's first step does once (on CPU
    the plugin merges it into the base's weights, about 5 s for SmolLM2-135M) then happens at
    start, not in a user's first time-to-first-token. Its single token fills no block, so it
    leaves nothing in the prefix cache."""
    from vllm import SamplingParams

    return {"prompt_token_ids": [int(token_id)]}, SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class RequestRun:
    """One request in flight: feed it every ``RequestOutput`` (:meth:`see`), then ask for its
    :meth:`output`. Timestamps are ``time.perf_counter`` seconds. With ``stream`` set, the text
    of a final generation (``request.part`` set) is streamed as it grows."""

    request: Request
    submitted: float
    stream: PartStream | None = None
    first: float | None = None
    final: Any = None
    short: bool = False
    #: the latest output of each sample, by index (with ``n > 1`` vLLM's streaming outputs
    #: may carry only the samples that advanced)
    samples: dict[int, Any] = field(default_factory=dict)

    def see(self, out: Any, now: float) -> bool:
        """Take the request's latest (cumulative) output. Returns ``True`` when the request
        must be aborted: its first token came with fewer prompt tokens from the cache than
        ``request.min_cached``, so a span it relies on was computed in context. A request vLLM
        failed before its first token (finish reason ``"error"``: a block the span store
        promised could not be loaded) is short as well; it is over already."""
        self.final = out
        for o in out.outputs:
            self.samples[int(o.index)] = o
        if self.first is None and any(o.finish_reason == "error" for o in out.outputs):
            # vLLM failed it before its first token: a KV block promised by the span store
            # could not be loaded (vLLM evicted it): as short as an evicted span
            self.short = True
            return False
        if self.first is None and any(o.token_ids for o in out.outputs):
            self.first = now
            if int(out.num_cached_tokens or 0) < self.request.min_cached:
                self.short = True
                return True
        if self.stream is not None and self.request.part is not None:
            for o in out.outputs:
                self.stream.update_output(self.request.part, o)
        return False

    def output(self, finished: float) -> Output:
        """The plan's :class:`Output` of the request, which ended at ``finished``."""
        final = self.final
        if final is None:
            raise RuntimeError("the engine returned no output")
        if self.stream is not None and self.request.part is not None and not self.short:
            self.stream.finish(self.request.part)
        outputs = [self.samples[i] for i in sorted(self.samples)] or list(final.outputs)
        logprobs = getattr(outputs[0], "logprobs", None)
        return Output(
            finish_reasons=[o.finish_reason or "stop" for o in outputs],
            logprobs=[{tok: lp.logprob for tok, lp in step.items()} for step in logprobs or []],
            texts=[o.text for o in outputs],
            token_ids=[list(o.token_ids) for o in outputs],
            prompt_tokens=len(final.prompt_token_ids or self.request.prompt),
            cached_tokens=int(final.num_cached_tokens or 0),
            submitted=self.submitted,
            first_token=self.first if self.first is not None else finished,
            finished=finished,
            first_logprobs=({tok: lp.logprob for tok, lp in logprobs[0].items()}
                            if logprobs else {}),
            short=self.short,
        )


__all__ = ["RequestRun", "sampling_params", "tokens_prompt"]
