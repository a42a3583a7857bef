"""``span-workflows tune``: LoRA fine-tuning that makes a model span-ready.

The recipe (Block-Attention's, with this engine's exact span semantics): most examples are
RAG queries in *span form* — the loss is taken on the answer after :func:`span_forward`, which
computes the prompt as the engine does in span mode — the rest in *stock form* (the plain chat
prompt), agent turns with tools (:mod:`span_workflows.tune.tool_data`, compiled as the engine
compiles an agent's prompt) and a few plain-text passages with an ordinary language-modelling
loss, so what the model does outside span mode is kept. ``init_adapter`` continues from an
existing adapter instead of a fresh one.

The loss of an example is ``ce_weight`` × the cross-entropy of its reference answer plus
``kl_weight`` × KL(teacher ‖ student) on the answer tokens (self-distillation, as Block
Distillation does): the teacher is the frozen base (the adapter disabled) reading the *stock
form* of the same prompt, the student the adapter reading the example's own form. A span-form
example so learns to answer as the base answers with full attention; a stock-form example,
tool turns included, learns to stay what the base is (its KL starts at 0). :data:`RECIPES`
names whole configurations; ``default`` is the one that trains the bundled adapter. Only LoRA
adapters (``peft``) on the attention and MLP projections are trained; the base weights stay as
they are.

Training is resumable: every ``checkpoint_every`` optimizer steps the adapter, the optimizer,
the learning-rate schedule and the position in the (deterministic) example stream are saved
under ``OUT/checkpoint``; a run started again with the same settings continues from there.
``OUT/training_log.json`` is rewritten with every checkpoint (:func:`training_log`: the config,
the data's checksum, package versions, the commit, the loss curve, seconds per 1k examples)
and copied into the adapter when the run ends. The finished adapter is ``OUT/adapter``;
:func:`span_workflows.compiler.model.merge_adapter` folds it into the base weights as a plain
checkpoint that vLLM serves.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from span_workflows.compiler.model import BASE_MODEL_NAME, SPAN_DEFAULTS_FILE
from span_workflows.errors import SpanQueryError
from span_workflows.tune import TRAINED_OPTIONS

#: The modules LoRA adapts (Llama-family names): attention and MLP projections.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TuneConfig:
    """What one tuning run trains; two runs with equal configs train the same adapter (up to
    float nondeterminism), so a checkpoint resumes only a run with the same config."""

    examples: int = 1000
    seed: int = 0
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    learning_rate: float = 3e-4
    warmup_steps: int = 8
    accumulate: int = 8
    #: shares of the example stream: span form (link blocks drawn below), plain text, agent
    #: turns with tools (:mod:`span_workflows.tune.tool_data`); the rest is stock form
    span_share: float = 0.7
    text_share: float = 0.05
    tool_share: float = 0.1
    #: of the span-form examples, the share with one link block (the rest have none)
    link_share: float = 0.2
    block_sizes: tuple[int, ...] = (32, 32, 32, 16)
    doc_tokens: tuple[int, int] = (64, 512)
    docs_per_prompt: tuple[int, int] = (2, 10)
    checkpoint_every: int = 10
    #: an adapter directory to start from (further tuning of a span-ready model) instead of
    #: LoRA's initialization; its rank must be ``rank``
    init_adapter: str | None = None
    #: weight of the reference answer's cross-entropy in an example's loss
    ce_weight: float = 1.0
    #: weight of KL(teacher ‖ student) on the answer tokens: the teacher is the frozen base on
    #: the stock form of the prompt (0: no teacher forward at all)
    kl_weight: float = 0.0
    #: dev-set questions scored at the end of every segment (0: no learning curve); see
    #: :func:`dev_point`
    dev_questions: int = 0

    def __post_init__(self) -> None:
        checks = [
            ("examples", self.examples >= 1, "must be at least 1"),
            ("rank", self.rank >= 1, "must be at least 1"),
            ("accumulate", self.accumulate >= 1, "must be at least 1"),
            ("learning_rate", self.learning_rate > 0, "must be positive"),
            ("span_share", 0 <= self.span_share <= 1, "must be between 0 and 1"),
            ("text_share", 0 <= self.text_share <= 1 - self.span_share,
             "must be between 0 and 1 - span_share"),
            ("tool_share", 0 <= self.tool_share <= 1 - self.span_share - self.text_share,
             "must be between 0 and 1 - span_share - text_share"),
            ("link_share", 0 <= self.link_share <= 1, "must be between 0 and 1"),
            ("ce_weight", self.ce_weight >= 0, "must not be negative"),
            ("kl_weight", self.kl_weight >= 0, "must not be negative"),
            ("kl_weight", self.ce_weight + self.kl_weight > 0,
             "and --ce-weight cannot both be 0 (nothing would be trained)"),
            ("dev_questions", self.dev_questions >= 0, "must not be negative"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise SpanQueryError(f"--{name.replace('_', '-')}", what)

    @property
    def optimizer_steps(self) -> int:
        return math.ceil(self.examples / self.accumulate)

    def as_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


#: Named configurations. ``default`` trains the bundled span-ready adapter (``make adapter``):
#: self-distillation from the base in stock form plus half-weighted cross-entropy, 2–12
#: documents per prompt (about a quarter with 8 or more) of 48–384 tokens, in the layouts
#: framework prompts use (:mod:`span_workflows.tune.layouts`), no link blocks (the options the
#: adapter is served with), agent turns with tools in 15 % of the stream, stock form in 10 %,
#: no LoRA dropout (one pass over fresh examples; dropout cost 15 % of an example's time);
#: a 48-question dev score at the end of every segment.
RECIPES: dict[str, TuneConfig] = {
    "default": TuneConfig(examples=1600, docs_per_prompt=(2, 12), doc_tokens=(48, 384),
                          span_share=0.7, text_share=0.05, tool_share=0.15, link_share=0.0,
                          ce_weight=0.5, kl_weight=1.0, dropout=0.0, dev_questions=48),
}


@dataclass
class TuneReport:
    """What a run did: its losses (one per optimizer step, the mean over its examples), how
    long it took, and where the adapter is."""

    adapter: Path
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    examples: int = 0
    resumed_from: int = 0

    @property
    def seconds_per_1k(self) -> float:
        """Seconds per 1000 examples, over the examples this process trained."""
        trained = self.examples - self.resumed_from
        return 1000 * self.seconds / trained if trained else float("nan")


@dataclass(frozen=True, slots=True)
class _Item:
    """One example of the stream, ready for its forward: ``form`` is ``span``, ``stock`` or
    ``text`` (an agent turn is a ``span`` item: it is computed as the engine computes it)."""

    form: str
    answer_ids: tuple[int, ...]
    query: Any = None  # a TokenizedQuery (span form)
    prompt_ids: tuple[int, ...] = ()
    #: the stock form of the same prompt, what the teacher reads
    teacher_ids: tuple[int, ...] = ()
    #: where a RAG example's prompt puts its documents (:mod:`span_workflows.tune.layouts`)
    layout: str = ""


class ExampleStream:
    """The deterministic stream of training items for a config and tokenizer: item ``i`` is
    the same whatever was trained before it (so a resumed run sees what it would have)."""

    def __init__(self, config: TuneConfig, tokenizer: Any) -> None:
        from span_workflows.compiler.compile import Compiler
        from span_workflows.tune.data import make_examples, plain_passages
        from span_workflows.tune.tool_data import make_tool_examples

        self.config = config
        self.tokenizer = tokenizer

        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        self._count = count
        self._examples = make_examples(config.examples, config.seed,
                                       doc_tokens=config.doc_tokens,
                                       docs_per_prompt=config.docs_per_prompt,
                                       count_tokens=count)
        self._texts = plain_passages(200, config.seed) or ["The quick brown fox."]
        self._tool_turns = make_tool_examples(config.examples, config.seed)
        self._compilers = {b: Compiler.for_tokenizer(tokenizer, b)
                           for b in set(config.block_sizes)}
        self._end = _end_of_turn(tokenizer)

    def __len__(self) -> int:
        return self.config.examples

    def item(self, index: int) -> _Item:
        from span_workflows.compiler.optimize import optimize
        from span_workflows.query.builders import rag
        from span_workflows.query.ir import ROLE_MESSAGES
        from span_workflows.query.lift import lift_messages
        from span_workflows.query.span_options import SpanOptions
        from span_workflows.tune.layouts import draw_layout, layout_messages

        cfg = self.config
        rng = random.Random(cfg.seed * 1_000_003 + index)
        roll = rng.random()
        if roll < cfg.text_share:
            ids = self.tokenizer.encode(self._texts[index % len(self._texts)],
                                        add_special_tokens=False)
            return _Item("text", tuple(ids[1:]), prompt_ids=tuple(ids[:1]),
                         teacher_ids=tuple(ids[:1]))
        if roll < cfg.text_share + cfg.tool_share:
            return self._tool_item(index, rng)
        example = self._examples[index]
        answer = self._answer_ids(example.answer)
        compiler = self._compilers[rng.choice(cfg.block_sizes)]
        layout = draw_layout(rng)
        if layout == "rag":
            query = optimize(rag(example.system, example.documents, example.question,
                                 max_tokens=len(answer)))
            stock = tuple(compiler.compile_generate(query, span_mode=False).token_ids)
        else:  # the documents inside a message, lifted as the integrations lift them
            messages = layout_messages(layout, example.system, example.documents,
                                       example.question, example.titles, rng)
            query = optimize(lift_messages(messages, max_tokens=len(answer),
                                           fragments=example.documents))
            stock = tuple(compiler.renderer.conversation(
                [ROLE_MESSAGES[role](text) for role, text in messages],
                generation_prompt=True))
        if roll < cfg.text_share + cfg.tool_share + cfg.span_share:
            links = 1 if rng.random() < cfg.link_share else 0
            tq = compiler.compile_generate(query, options=SpanOptions(link_blocks=links))
            return _Item("span", answer, query=tq, teacher_ids=stock, layout=layout)
        return _Item("stock", answer, prompt_ids=stock, teacher_ids=stock, layout=layout)

    def _answer_ids(self, text: str) -> tuple[int, ...]:
        """The target tokens of an answer: its text, then the end of the assistant turn."""
        return (*self.tokenizer.encode(text, add_special_tokens=False), self._end)

    def _tool_item(self, index: int, rng: random.Random) -> _Item:
        """Agent turn ``index`` as the engine runs it: its messages lifted (tool results of
        one turn commuting), the tool instructions in its system text, optimized, compiled in
        span mode with the trained options."""
        from span_workflows.compiler.optimize import optimize
        from span_workflows.query.lift import lift_messages
        from span_workflows.query.sampling import Sampling
        from span_workflows.query.span_options import SpanOptions
        from span_workflows.query.tool_prompt import with_tool_prompts

        turn = self._tool_turns[index]
        answer = self._answer_ids(turn.answer)
        sampling = Sampling(tools=turn.tools, used_tools=turn.used)
        query = lift_messages(turn.messages, max_tokens=len(answer), sampling=sampling,
                              fragments=())
        query = optimize(with_tool_prompts(query))
        compiler = self._compilers[rng.choice(self.config.block_sizes)]
        tq = compiler.compile_generate(query, options=SpanOptions(**TRAINED_OPTIONS))
        stock = compiler.compile_generate(query, span_mode=False)
        return _Item("span", answer, query=tq, teacher_ids=tuple(stock.token_ids))

    def __iter__(self) -> Iterator[_Item]:
        return (self.item(i) for i in range(len(self)))

    def checksum(self) -> str:
        """SHA-256 of the data the stream draws on (the generated RAG examples, the plain
        passages, the agent turns): two runs with equal checksums train on the same text."""
        import hashlib

        digest = hashlib.sha256()
        for part in (self._examples, self._texts, self._tool_turns):
            digest.update(repr(part).encode())
        return digest.hexdigest()


def _end_of_turn(tokenizer: Any) -> int:
    """The token that ends an assistant turn: ``<|im_end|>`` (ChatML) or EOS."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        return im_end
    return int(tokenizer.eos_token_id)


def _student_logits(model: Any, item: _Item) -> Any:
    """The float32 logits predicting ``item``'s answer tokens under its form's forward."""
    from span_workflows.tune.forward import span_forward, stock_forward

    if item.form == "span":
        return span_forward(model, item.query, item.answer_ids).float()
    return stock_forward(model, item.prompt_ids, item.answer_ids).float()


def item_loss(model: Any, item: _Item) -> Any:
    """Mean cross-entropy of ``item``'s answer tokens under its form's forward."""
    import torch

    logits = _student_logits(model, item)
    target = torch.tensor(item.answer_ids, device=logits.device)
    return torch.nn.functional.cross_entropy(logits, target)


def training_loss(model: Any, item: _Item, config: TuneConfig) -> tuple[Any, float, float]:
    """``item``'s loss under ``config``'s objective, and its two terms: ``(loss, ce, kl)``.

    ``kl`` is KL(teacher ‖ student) averaged over the answer tokens, the teacher being
    ``model`` with its adapter disabled on the item's stock form (no gradient); it is only
    computed when ``kl_weight`` is positive (else reported as 0)."""
    import torch
    import torch.nn.functional as F

    from span_workflows.tune.forward import stock_forward

    logits = _student_logits(model, item)
    target = torch.tensor(item.answer_ids, device=logits.device)
    ce = F.cross_entropy(logits, target)
    loss = config.ce_weight * ce
    kl_value = 0.0
    if config.kl_weight > 0:
        with torch.no_grad(), model.disable_adapter():
            teacher = stock_forward(model, item.teacher_ids, item.answer_ids).float()
        kl = F.kl_div(F.log_softmax(logits, dim=-1), F.log_softmax(teacher, dim=-1),
                      log_target=True, reduction="batchmean")
        loss = loss + config.kl_weight * kl
        kl_value = float(kl.detach())
    return loss, float(ce.detach()), kl_value


def load_base(model: str | None, device: str) -> tuple[Any, Any, Path]:
    """The base model (float32, on ``device``; ``None``: the bundled base SmolLM2-135M, whatever
    the default model is), its tokenizer and its directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from span_workflows.compiler.model import resolve_model

    if device not in ("cpu", "cuda"):
        raise SpanQueryError("--device", f"must be cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpanQueryError("--device", "cuda was asked for but torch sees no CUDA device")
    path = resolve_model(BASE_MODEL_NAME if model is None else model, progress=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    return base, tokenizer, path


def tune(out: Path, config: TuneConfig, *, model: str | None = None, device: str = "cpu",
         progress: bool = True, stop_after: int | None = None, recipe: str | None = None,
         max_seconds: float | None = None,
         on_step: Callable[[int, float], None] | None = None) -> TuneReport:
    """Train (or resume training) the LoRA adapter of ``config`` for ``model`` into ``out``.

    A process that trains is one *segment* of the run; while it trains it holds the machine's
    training lock (:mod:`span_workflows.tune.lock`: benchmarks wait). It ends when the stream
    is finished; after ``stop_after`` examples in total; at the first optimizer step after
    ``max_seconds`` of training; or at the first optimizer step after SIGTERM or SIGINT.
    Whichever ends it, a checkpoint is written and, when ``config.dev_questions`` is set, the
    dev-set score of the adapter so far is added to the learning curve (its time is not
    counted as training): the next call resumes. ``recipe`` is the
    name of the :data:`RECIPES` entry ``config`` came from, for the log. Returns what was done;
    the adapter is written to ``out/adapter`` when the stream is finished, with its
    ``training_log.json`` (the one in ``out`` is rewritten at every checkpoint).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

    from span_workflows.tune import checkpoint as ckpt
    from span_workflows.tune.lock import holding

    torch.manual_seed(config.seed)
    base, tokenizer, base_path = load_base(model, device)
    lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                      target_modules=list(TARGET_MODULES), task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, lora)
    if config.init_adapter is not None:
        _load_init_adapter(peft_model, Path(config.init_adapter), config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    checkpoint = out / "checkpoint"
    state = ckpt.load_state(checkpoint, config.as_json(), model)
    if state is not None:
        ckpt.restore(checkpoint, peft_model, optimizer, schedule)
    else:
        state = ckpt.RunState()
    report = TuneReport(out / "adapter", losses=state.losses, examples=state.examples,
                        resumed_from=state.examples)
    stream = ExampleStream(config, tokenizer)
    run = _RunInfo(config, model or BASE_MODEL_NAME, base_path.name, device, recipe,
                   stream.checksum())
    if state.examples:
        _check_same_data(out / "training_log.json", run.data_sha256)
    segment = _segment(state.examples)
    earlier_segments, earlier_seconds = list(state.segments), state.seconds
    end = len(stream) if stop_after is None else min(len(stream), stop_after)
    bar = tqdm(total=len(stream), initial=report.examples, desc="tune", unit="ex",
               disable=not progress)
    peft_model.train()
    started = time.perf_counter()
    window: list[tuple[float, float, float]] = []
    index = report.examples

    trained_until: float | None = None  # when the segment's last step ended

    def write_checkpoint() -> None:
        report.seconds = (trained_until or time.perf_counter()) - started
        segment["examples"][1] = report.examples
        segment["seconds"] = round(report.seconds, 1)
        state.examples, state.seconds = report.examples, earlier_seconds + report.seconds
        state.segments = [*earlier_segments, segment]
        ckpt.save(checkpoint, peft_model, optimizer, schedule, config.as_json(), model, state)
        _write_json(out / "training_log.json", training_log(run, state))

    with holding(out), _StopRequest() as stop:
        while index < end:
            batch_end = min(index + config.accumulate, len(stream))
            for i in range(index, batch_end):
                loss, ce, kl = training_loss(peft_model, stream.item(i), config)
                (loss / (batch_end - index)).backward()
                window.append((loss.item(), ce, kl))
                bar.update(1)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            report.losses.append(sum(w[0] for w in window) / len(window))
            state.curves["ce"].append(sum(w[1] for w in window) / len(window))
            state.curves["kl"].append(sum(w[2] for w in window) / len(window))
            window = []
            index = batch_end
            report.examples = index
            bar.set_postfix(loss=f"{report.losses[-1]:.3f}",
                            lr=f"{schedule.get_last_lr()[0]:.1e}")
            if on_step is not None:
                on_step(len(report.losses), report.losses[-1])
            out_of_time = (max_seconds is not None
                           and time.perf_counter() - started >= max_seconds)
            if out_of_time or stop.requested:
                end = index
            if len(report.losses) % config.checkpoint_every == 0 or index >= end:
                write_checkpoint()
        bar.close()
        trained_until = time.perf_counter()  # the dev score below is not training time
        if config.dev_questions and report.examples > report.resumed_from:
            state.dev.append({"examples": report.examples, "commit": segment["commit"],
                              **dev_point(peft_model, tokenizer, config, out)})
            write_checkpoint()
    if report.examples >= len(stream):
        report.adapter.mkdir(parents=True, exist_ok=True)
        peft_model.save_pretrained(str(report.adapter))
        portable_adapter(report.adapter, run.base_model)
        log = training_log(run, state)
        started_from = _training_log(config.init_adapter)
        if started_from is not None:  # the runs this one continued, oldest first
            log["continued"] = [*started_from.pop("continued", []), started_from]
        _write_json(report.adapter / "training_log.json", log)
        _write_json(out / "training_log.json", log)
        # what the model was trained for: engines on the merged model default to it
        (report.adapter / SPAN_DEFAULTS_FILE).write_text(json.dumps(
            {"span_ready": True, "span_options": TRAINED_OPTIONS}, indent=1) + "\n")
    return report


class _StopRequest:
    """While entered (in the main thread), SIGTERM and SIGINT ask the run to stop at its next
    optimizer step instead of killing it: the step finishes and a checkpoint is written. A
    second signal stops it at once, as without this."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        import signal

        if self.requested:  # asked twice: give up at once
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping after this optimizer step "
              f"(a checkpoint is written); send it again to stop at once", flush=True)

    def __exit__(self, *exc: object) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _segment(first_example: int) -> dict[str, Any]:
    """The log entry of the segment this process trains: the commit of the code (what the
    run itself writes excluded), the machine, when it started, examples ``[from, to)`` and
    seconds (filled in as it goes)."""
    import datetime
    import platform

    from span_workflows import build_info

    return {"commit": build_info.commit(("span_workflows/adapters", "training")),
            "machine": build_info.machine(), "host": platform.node(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "examples": [first_example, first_example], "seconds": 0.0}


def dev_point(model: Any, tokenizer: Any, config: TuneConfig, out: Path) -> dict[str, Any]:
    """One point of the learning curve: the dev set's accuracy in span form on the adapter as
    it is now, beside the base's accuracy in stock form (the target) and in span form (where
    training started), both computed once per run and kept in ``out/dev_base.json``."""
    import hashlib

    from span_workflows.tune.dev_eval import dev_score
    from span_workflows.tune.dev_set import make_dev_set

    questions = make_dev_set(config.dev_questions, seed=DEV_SEED)
    cache = out / "dev_base.json"
    key = hashlib.sha256(repr(questions).encode()).hexdigest()[:16]
    base = json.loads(cache.read_text()) if cache.is_file() else {}
    if base.get("key") != key:
        with model.disable_adapter():
            stock = dev_score(model, tokenizer, questions, form="stock")
            span = dev_score(model, tokenizer, questions, form="span")
        base = {"key": key, "stock": stock.accuracy, "span": span.accuracy,
                "stock_by_layout": stock.by_layout, "span_by_layout": span.by_layout}
        _write_json(cache, base)
    tuned = dev_score(model, tokenizer, questions, form="span")
    return {"questions": config.dev_questions, "span": tuned.accuracy,
            "span_by_layout": tuned.by_layout, "base_stock": base["stock"],
            "base_span": base["span"]}


#: The seed of the dev set the learning curve is scored on.
DEV_SEED = 11


@dataclass(frozen=True)
class _RunInfo:
    """What a run's log says about it besides its progress."""

    config: TuneConfig
    base_model: str
    base_dir: str
    device: str
    recipe: str | None
    data_sha256: str


def portable_adapter(adapter: Path, base_model: str) -> None:
    """Make the adapter ``peft`` saved in ``adapter`` the same on every machine: its config
    names the base as the run was given it (a bundled name, not this machine's cache path),
    and the model card ``peft`` writes (which repeats that path) is removed."""
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (adapter / "README.md").unlink(missing_ok=True)


def training_log(run: _RunInfo, state: Any) -> dict[str, Any]:
    """The log of a run so far (``state``: its :class:`~span_workflows.tune.checkpoint.RunState`):
    its config and recipe, the base model, the data's checksum, the commit, machine and package
    versions, the loss curve (the loss and its two terms, one point per optimizer step),
    examples done and seconds spent (all segments together), every segment (commit, machine,
    examples, seconds) and the dev-set learning curve."""
    from span_workflows import build_info

    examples, seconds = state.examples, state.seconds
    return {
        "config": run.config.as_json(), "recipe": run.recipe,
        "base_model": run.base_model, "base_dir": run.base_dir,
        "data_sha256": run.data_sha256,
        "commit": build_info.commit(("span_workflows/adapters", "training")),
        "machine": build_info.machine(), "device": run.device,
        "packages": build_info.package_versions(
            ("torch", "transformers", "peft", "safetensors", "vllm")),
        "examples": examples, "of": run.config.examples,
        "seconds": round(seconds, 1),
        "seconds_per_1k": round(1000 * seconds / examples, 1) if examples else None,
        "segments": state.segments, "dev": state.dev,
        "losses": state.losses, "ce": state.curves["ce"], "kl": state.curves["kl"],
    }


def _check_same_data(log: Path, checksum: str) -> None:
    """Refuse to resume a run whose examples would differ from those it was trained on so far
    (the generators changed since): its log records the data's checksum."""
    if not log.is_file():
        return
    before = json.loads(log.read_text()).get("data_sha256")
    if before is not None and before != checksum:
        raise SpanQueryError("--out", f"{log.parent} was trained on other examples (data "
                                      f"checksum {before[:12]}, now {checksum[:12]}): the "
                                      f"example generators changed since; use another --out")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _load_init_adapter(model: Any, path: Path, config: TuneConfig) -> None:
    """Load the LoRA weights of the adapter in ``path`` into ``model`` (a fresh peft model of
    ``config``); refused, naming ``--init-adapter``, when it is missing or of another rank."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights, settings = path / "adapter_model.safetensors", path / "adapter_config.json"
    if not weights.is_file() or not settings.is_file():
        raise SpanQueryError("--init-adapter", f"{path} holds no LoRA adapter "
                                               f"(adapter_model.safetensors, adapter_config.json)")
    rank = json.loads(settings.read_text()).get("r")
    if rank != config.rank:
        raise SpanQueryError("--init-adapter", f"{path} has rank {rank}; this run's --rank is "
                                               f"{config.rank}")
    result = set_peft_model_state_dict(model, load_file(str(weights)))
    if getattr(result, "unexpected_keys", None):
        raise SpanQueryError("--init-adapter", f"{path} adapts other modules than "
                                               f"{', '.join(TARGET_MODULES)}")


def _training_log(adapter: str | None) -> dict[str, Any] | None:
    """The training log recorded with an adapter directory (``None``: none given or none
    recorded)."""
    if adapter is None:
        return None
    path = Path(adapter) / "training_log.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _lr_lambda(config: TuneConfig) -> Callable[[int], float]:
    """Linear warm-up (``warmup_steps``, at most a tenth of the run), then cosine decay to
    10 % over the run's optimizer steps."""
    total = max(config.optimizer_steps, 1)
    warmup = max(1, min(config.warmup_steps, total // 10))

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return scale


__all__ = ["ExampleStream", "RECIPES", "TARGET_MODULES", "TuneConfig", "TuneReport",
           "item_loss", "load_base", "portable_adapter", "training_log", "training_loss",
           "tune"]
