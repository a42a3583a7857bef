"""The dev score: greedy answers of a Hugging Face causal LM to the dev set
(:mod:`span_workflows.tune.dev_set`), in span form or in stock form, and how many are right.

How a dev question becomes a query (:func:`dev_query`): the ``rag`` layout is the builder
query ``rag(system, documents, question)``; every other layout is its chat messages lifted as
the framework integrations lift them (:func:`span_workflows.query.lift.lift_messages`, the
documents being the fragments). Both are optimized, as the engine runs a span query.

The forms (:data:`FORMS`), each a prompt for the model and greedy decoding after it:

* ``"span"`` — the query compiled in span mode (with :data:`span_workflows.tune.
  TRAINED_OPTIONS` unless told otherwise), its prompt computed exactly as
  :func:`~span_workflows.tune.forward.span_forward` computes it
  (:func:`~span_workflows.tune.forward.span_prompt_cache`), then decoded on that cache;
* ``"stock"`` — what the engine's stock mode sends for the same query
  (``Engine.execute_many(..., span_mode=False)``): the query in the order given
  (:func:`~span_workflows.compiler.optimize.ordered_for_stock`) compiled with ``span_mode=False``.
  For ``rag`` that is the system prompt, each document as a user message, the question — which is
  also ``apply_chat_template`` of :meth:`DevQuestion.messages`. For a lifted layout it is *not*
  the user's own chat: the lifted pieces are rendered as messages of their own (``system``:
  the instruction, each document as a user message, the question; ``user``: ``"Context:"``,
  the documents and ``"Question: ..."`` as separate user messages; ``numbered`` and
  ``sources``: the ``[k]`` / ``Source: ...`` lines and the documents as alternating user
  messages). It is the baseline the engine compares span mode with, and what the training's
  teacher reads for a lifted prompt, so ``"stock"`` is that;
* ``"chat"`` — the user's own messages through ``tokenizer.apply_chat_template(messages,
  add_generation_prompt=True)``: what plain Hugging Face or vLLM chat serving sends.

A peft model works in every form: with its adapter enabled it is the student; inside
``with model.disable_adapter():`` it is the base.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from span_workflows.query.ir import Generate
from span_workflows.query.span_options import SpanOptions
from span_workflows.tune.dev_set import LAYOUTS, DevQuestion, is_correct

#: The prompt forms :func:`dev_score` decodes after (see the module docstring).
FORMS: tuple[str, ...] = ("span", "stock", "chat")
#: Greedy decoding stops after this many new tokens (or at the end of the turn).
MAX_NEW_TOKENS = 24


def dev_query(question: DevQuestion, max_tokens: int = MAX_NEW_TOKENS, *,
              optimized: bool = True) -> Generate:
    """The span query of ``question``: ``rag(system, documents, question)`` for the ``rag``
    layout, else its messages lifted with its documents as the fragments; optimized (the tree
    the engine runs in span mode), or with ``optimized=False`` as built (the engine's stock
    mode runs it in this order)."""
    from span_workflows.compiler.optimize import optimize
    from span_workflows.query.builders import rag
    from span_workflows.query.lift import lift_messages

    if question.layout == "rag":
        query = rag(question.system, question.documents, question.question,
                    max_tokens=max_tokens)
    else:
        pairs = [(m["role"], m["content"]) for m in question.messages()]
        query = lift_messages(pairs, max_tokens=max_tokens, fragments=question.documents)
    return optimize(query) if optimized else query


def stock_prompt_ids(question: DevQuestion, compiler: Any) -> list[int]:
    """The prompt the engine's stock mode sends for :func:`dev_query` (the query in the order
    given, compiled with ``span_mode=False``)."""
    from span_workflows.compiler.optimize import ordered_for_stock

    query = ordered_for_stock(dev_query(question, optimized=False))
    return list(compiler.compile_generate(query, span_mode=False).token_ids)


def chat_prompt_ids(question: DevQuestion, tokenizer: Any) -> list[int]:
    """The user's own messages through the tokenizer's chat template, generation prompt
    added."""
    ids = tokenizer.apply_chat_template(question.messages(), add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def end_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens that end an answer: ``<|im_end|>`` (where the tokenizer has it) and EOS."""
    ends = set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ends.add(im_end)
    if tokenizer.eos_token_id is not None:
        ends.add(int(tokenizer.eos_token_id))
    return frozenset(ends)


def _decode(model: Any, out: Any, position: int, ends: frozenset[int],
            max_new_tokens: int) -> list[int]:
    """Greedy tokens after a forward ``out`` whose last logits row predicts the first one;
    the next token sits at ``position``. Stops at an end token (not returned)."""
    import torch

    device = next(model.parameters()).device
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        token = int(out.logits[0, -1].argmax())
        if token in ends:
            break
        generated.append(token)
        if len(generated) == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[position]], device=device),
                    past_key_values=out.past_key_values, use_cache=True)
        position += 1
    return generated


def greedy_span(model: Any, tq: Any, ends: frozenset[int],
                max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """Greedy answer ids after the span-mode prompt ``tq`` (a compiled
    :class:`~span_workflows.compiler.compile.TokenizedQuery`), its prompt computed as
    :func:`~span_workflows.tune.forward.span_forward` computes it."""
    import torch

    from span_workflows.tune.forward import span_prompt_cache

    device = next(model.parameters()).device
    prompt = span_prompt_cache(model, tq)
    out = model(input_ids=torch.tensor([prompt.tail_ids], device=device),
                position_ids=prompt.tail_positions, past_key_values=prompt.cache,
                use_cache=True, logits_to_keep=1)
    return _decode(model, out, int(prompt.tail_positions[0, -1]) + 1, ends, max_new_tokens)


def greedy_stock(model: Any, prompt_ids: Sequence[int], ends: frozenset[int],
                 max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """Greedy answer ids after a plain prompt (ordinary causal attention)."""
    import torch

    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), use_cache=True,
                logits_to_keep=1)
    return _decode(model, out, len(prompt_ids), ends, max_new_tokens)


@dataclass
class DevScore:
    """How many dev questions a model answered right in one form: ``answers[i]`` is its
    answer to question ``i``; ``by_layout`` maps a layout to ``(correct, total)``;
    ``seconds`` is the wall time of the whole run."""

    form: str
    correct: int = 0
    total: int = 0
    answers: list[str] = field(default_factory=list)
    by_layout: dict[str, tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        """``correct / total`` (``nan`` with no questions)."""
        return self.correct / self.total if self.total else float("nan")

    @property
    def seconds_per_question(self) -> float:
        return self.seconds / self.total if self.total else float("nan")

    def layout_accuracy(self, layout: str) -> float:
        """Accuracy over the questions of one layout (``nan`` if it had none)."""
        correct, total = self.by_layout.get(layout, (0, 0))
        return correct / total if total else float("nan")


def dev_score(model: Any, tokenizer: Any, questions: Sequence[DevQuestion], *, form: str,
              block_size: int = 32, options: SpanOptions | dict[str, Any] | None = None,
              max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False) -> DevScore:
    """Greedy answers of ``model`` to ``questions`` in ``form`` (:data:`FORMS`) and how many
    are right (:func:`~span_workflows.tune.dev_set.is_correct`). ``block_size`` and
    ``options`` (default :data:`~span_workflows.tune.TRAINED_OPTIONS`) lay out the span
    form. Runs without gradients in eval mode; a model that was training is put back in
    train mode."""
    import torch
    from tqdm.auto import tqdm

    from span_workflows.compiler.compile import Compiler

    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, not {form!r}")
    if options is None:
        from span_workflows.tune import TRAINED_OPTIONS

        options = dict(TRAINED_OPTIONS)
    span_options = SpanOptions.coerce(options)
    compiler = Compiler.for_tokenizer(tokenizer, block_size, options=span_options)
    ends = end_ids(tokenizer)
    score = DevScore(form, by_layout={layout: (0, 0) for layout in LAYOUTS
                                      if any(q.layout == layout for q in questions)})
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for q in tqdm(questions, desc=f"dev {form}", unit="q", disable=not progress):
                if form == "span":
                    tq = compiler.compile_generate(dev_query(q, max_new_tokens),
                                                   options=span_options)
                    ids = greedy_span(model, tq, ends, max_new_tokens)
                else:
                    prompt = (stock_prompt_ids(q, compiler) if form == "stock"
                              else chat_prompt_ids(q, tokenizer))
                    ids = greedy_stock(model, prompt, ends, max_new_tokens)
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                right = is_correct(q.answer, text)
                score.answers.append(text)
                score.correct += right
                score.total += 1
                correct, total = score.by_layout.get(q.layout, (0, 0))
                score.by_layout[q.layout] = (correct + right, total + 1)
    finally:
        score.seconds = time.perf_counter() - started
        if was_training:
            model.train()
    return score


__all__ = ["DevScore", "FORMS", "MAX_NEW_TOKENS", "chat_prompt_ids", "dev_query", "dev_score",
           "end_ids", "greedy_span", "greedy_stock", "stock_prompt_ids"]
