"""Self-speculative decoding: draft with sublayers skipped, verify all drafts in one full forward.

Invariant of the loop: the KV cache holds the full model's keys and values for every
committed token but the last one, which is fed at the start of the next round.
Each round, the draft controller (controller.py) says how many tokens to draft, 0 meaning plain steps; the round
drafts them with the draft path (`draft_round`), sets the static cache's write position back to the committed length
(stale slots past it stay, hidden by the causal mask), verifies `[last, d1..dk]` in one forward of the full model,
keeps the longest accepted prefix plus one token of the full model (`verify_greedy`, `verify_sampling`) and sets the
position to the new committed length, passed explicitly as gpt-fast passes `input_pos`; then the controller observes
the round. Greedy verification gives exactly the tokens of plain greedy decoding; sampling uses speculative rejection
sampling, which keeps the full model's distribution.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..io.errors import NonFiniteLogits
from .checks import check_generate_args, check_prompt, forward_bounds
from .choice import prefill_choosing, round_costs
from .controller import DraftController, DraftMemory
from .cost_profile import CostProfile
from .engine import CompileSettings, engine_for
from .policy import DraftPolicy, drafting_sets
from .rounds import DecodeHooks, Draft, draft_round, pad_to, verify_greedy, verify_sampling
from .sampling import Sampling
from .skipset import SkipSet
from .stats import DecodeStats, GenerationOutput
from .steps import Step, Steps, synchronize


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


def _through_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first EOS among them."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def host_reads_stall(device: torch.device) -> bool:
    """Whether reading a value back stalls the device. On CUDA it does (the queue drains and the GPU idles until the
    host launches again), so a round reads back once: its length is planned before it (controller.py) and it is not
    cut inside; plain decoding reads once per `PLAIN_STEPS_PER_READ` steps, whose steps past an EOS are dropped. On a
    CPU a read waits for nothing: a round may stop at an unsure draft (`DraftController.cut`), plain decoding at an
    EOS."""
    return device.type == "cuda"


def cuts_rounds(adaptive: bool, device: torch.device | str) -> bool:
    """Whether a timed call's adaptive rounds on `device` read each draft's confidence and may stop at an unsure one
    (the cut, `DraftController.cut`), which a cost profile prices as `adaptive_token_s`: not where reads stall."""
    return adaptive and not host_reads_stall(torch.device(device))


PLAIN_STEPS_PER_READ = 8
ROUND_CLOCK = time.perf_counter  # what the controller times rounds with (tests inject theirs)


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    *,
    skip: SkipSet | Sequence[SkipSet] | None = None,
    max_new_tokens: int = 128,
    policy: DraftPolicy = DraftPolicy(),
    sampling: Sampling = Sampling(),
    eos_token_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    time_drafts: bool = False,
    compile: bool = False,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    hooks: DecodeHooks | None = None,
    cost_profile: CostProfile | None = None,
    memory: DraftMemory | None = None,
    timed: bool = True,
) -> GenerationOutput:
    """Decode `max_new_tokens` (or up to EOS) for one prompt with self-speculative decoding.

    `skip=None`, an empty skip set or `policy.max_draft_tokens == 0` decodes plainly through the same loop
    (`drafting_skip`); several sets: the prefill chooses one or plain decoding (choice.py). `cost_profile` prices
    rounds (and pads verifications to the cheapest width) until the rounds' own times take over (controller.py).
    `memory`: what the controller learned in earlier calls (plain speed, back-offs), updated in place; None: nothing.
    `timed=False`: no clock read, the same rounds on any machine (`_Run.timed`). `generator` seeds sampling, on the
    model's device (the same tokens each call untimed, with no `memory`). `compile`: compiled draft and verify steps
    (`compile_backend`, `compile_mode`: engine.py's modes; CUDA graphs on CUDA, where regional compiles the prefill
    too), kept on the model, one call at a time. `hooks`: logits processing, stopping, streaming, the caller's."""
    prompt = check_prompt(model, input_ids)  # before any work: each a TypeError or ValueError saying what is wrong
    check_generate_args(model, prompt.shape[1], skip, max_new_tokens, policy, sampling, cost_profile)
    candidates = drafting_sets(skip, policy)
    settings = CompileSettings(compile_backend, compile_mode) if compile else None
    with engine_for(model).exclusive() if compile else contextlib.nullcontext():
        steps = _prepare(model, prompt.shape[1] + max_new_tokens, candidates, policy, settings)
        run = _Run(model, sampling, _eos_set(eos_token_id), generator, hooks, time_drafts,
                   host_reads_stall(model.device), settings is not None, policy.max_draft_tokens, cost_profile,
                   steps if len(candidates) > 1 else None, forward_bounds(model), timed)
        controller = _controller(run, candidates, policy, memory, settings, prompt.shape[1])
        return _decode_with_setup(run, steps, controller, prompt, max_new_tokens)


def _decode_with_setup(run: _Run, steps: dict[SkipSet | None, Steps], controller: DraftController,
                       prompt: torch.Tensor, max_new_tokens: int) -> GenerationOutput:
    """`_decode` with the first of `steps`, its stats' `compile_time_s` the setup (compiling, capturing) of the steps
    this call was the first to run."""
    new_steps = _not_set_up(steps)
    output = _decode(run, next(iter(steps.values())), controller, prompt, max_new_tokens)
    output.stats.compile_time_s = sum(step.setup_time_s or 0.0 for step in new_steps)
    return output


def _controller(run: _Run, candidates: tuple[SkipSet, ...], policy: DraftPolicy, memory: DraftMemory | None,
                settings: CompileSettings | None, context: int) -> DraftController:
    """The call's controller, its memory keyed by how the steps run; drafting with the one set given (with several,
    the prefill's choice says which)."""
    key = "eager" if settings is None else f"{settings.backend}/{settings.mode or 'default'}"
    controller = DraftController(policy, memory, key)
    if len(candidates) == 1:
        controller.use(candidates[0], round_costs(run.model, candidates[0], policy.max_draft_tokens, run.profile,
                                                  context))
    return controller


def _prepare(model: torch.nn.Module, tokens: int, candidates: tuple[SkipSet, ...], policy: DraftPolicy,
             settings: CompileSettings | None) -> dict[SkipSet | None, Steps]:
    """The steps (and the cache for `tokens`, prompt and new) of what the call may decode with: its one drafting
    set, or plain decoding (keyed None); with several sets, each of them and plain decoding."""
    engine = engine_for(model)
    # Writes reach at most one verify width (or a batch of plain steps) past the last committed token.
    widest = policy.max_draft_tokens + 1 if candidates else 1
    cache = engine.cache_for(tokens + max(widest, PLAIN_STEPS_PER_READ), settings)
    options = (*candidates, None) if len(candidates) > 1 else candidates or (None,)
    return {skip: engine.steps_for(cache, skip, settings, policy.max_draft_tokens + 1 if skip is not None else 1)
            for skip in options}


def _not_set_up(steps: dict[SkipSet | None, Steps]) -> list[Step]:
    """The steps whose first call (compiling) is still to come, each once: one verify step serves every set."""
    return list({id(step): step for option in steps.values() for step in option.not_set_up()}.values())


@dataclass(frozen=True)
class _Run:
    """What one call decodes with, fixed for the call (the controller and the statistics are what moves)."""

    model: torch.nn.Module  # the model itself: its config, the choosing prefill among several sets, the checks
    sampling: Sampling
    eos: frozenset[int]
    generator: torch.Generator | None
    hooks: DecodeHooks | None
    time_drafts: bool
    read_once: bool  # host reads stall the device: one read per round, no cut inside it (`host_reads_stall`)
    compiled: bool  # compiled verify steps take one width: every verification is padded to the widest round's
    max_draft_tokens: int
    profile: CostProfile | None  # prices rounds at first (None: the share of the weights a draft reads)
    choosing: dict[SkipSet | None, Steps] | None  # several skip sets: the prefill chooses among these steps
    bounds: tuple[int, ...]  # forward lengths no verification crosses (`checks.forward_bounds`)
    # The controller learns from the rounds' wall times and cuts rounds by them. Untimed, it reads no clock: rounds are
    # planned from the profile's prices (else the weights' shares) and the acceptance seen, with no cut and no guard
    # verdict, so greedy decoding takes the same rounds on any machine, busy or quiet (modeled studies, projections).
    timed: bool


@dataclass(frozen=True)
class _Round:
    """What a round (or a batch of plain steps) committed, and what the controller observes of it."""

    tokens: list[int]
    last: torch.Tensor  # the last committed token, on the device: the next round starts from it
    history: torch.Tensor | None  # with hooks: every committed id, on the device
    stopped: bool  # a stopping hook fired
    drafted: int = 0
    accepted: int = 0
    confidences: list[float] | None = None  # each draft's confidence, where it was read (the cut)
    draft_seconds: float | None = None  # the drafts' wall time, where it was read (the cut)
    dropped: bool = False  # plain steps ran past an EOS: their time is not that of the tokens kept


def _decode(run: _Run, steps: Steps, controller: DraftController, prompt: torch.Tensor, max_new_tokens: int
            ) -> GenerationOutput:
    """Prefill, then rounds (or batches of plain steps) until `max_new_tokens`, an EOS or a stopping hook. The cache
    holds every committed token but `last`: its length, `position`, is where `last` goes, passed to each round."""
    stats = DecodeStats()
    synchronize(prompt.device)
    start_time = time.perf_counter()
    steps, done = _prefill(run, steps, controller, stats, prompt)
    since = ROUND_CLOCK()
    stats.prefill_time_s = time.perf_counter() - start_time
    tokens = list(done.tokens)
    while len(tokens) < max_new_tokens and tokens[-1] not in run.eos and not done.stopped:
        position, room = prompt.shape[1] + len(tokens) - 1, max_new_tokens - len(tokens)
        drafts = _within_bounds(run, position, controller.plan(room))
        cold = _cold(steps, drafts)
        if drafts or run.hooks is not None:
            done = _round(run, steps, controller, stats, done, position, room, drafts)
        else:
            done = _plain_steps(run, steps, stats, done.last, position, room)
        tokens.extend(done.tokens)
        since = _observe(controller, done, since, cold or not run.timed)
    synchronize(prompt.device)
    stats.wall_time_s = time.perf_counter() - start_time
    stats.new_tokens, stats.guard = len(tokens), controller.stats
    return GenerationOutput(tokens, stats)


def _widest(run: _Run, position: int) -> int | None:
    """The widest forward at `position` (the cache's length) that crosses none of `run.bounds`; None: no bound
    ahead. A one-token step reaches `position + 1` and never crosses one: plain decoding's steps, which rounds
    match."""
    return min((bound - position for bound in run.bounds if bound > position), default=None)


def _within_bounds(run: _Run, position: int, drafts: int) -> int:
    """`drafts`, or fewer, so that the round's verification at the width it runs crosses no bound (`_widest`):
    compiled verification runs at the widest round's width, so there the round drafts all or nothing."""
    widest = _widest(run, position)
    if widest is None or not drafts:
        return drafts
    if run.compiled:
        return drafts if run.max_draft_tokens + 1 <= widest else 0
    return min(drafts, widest - 1)


def _cold(steps: Steps, drafts: int) -> bool:
    """Whether the iteration runs a compiled step's first call (compiling): its time says nothing of decoding."""
    return any(step.setup_time_s is None for step in ((steps.draft, steps.verify) if drafts else (steps.plain,)))


def _observe(controller: DraftController, done: _Round, since: float, untimed: bool) -> float:
    """The iteration's wall time, from the previous iteration's end (its host read) to now, to the controller (none
    where `untimed`: a compiled step's first call, an untimed call; nor for plain steps past an EOS); returns now. The
    clock is a host read of the host's: no device sync."""
    now = ROUND_CLOCK()
    controller.observe(done.drafted, done.accepted, len(done.tokens), None if untimed or done.dropped else now - since,
                       done.confidences, done.draft_seconds)
    return now


def _prefill(run: _Run, steps: Steps, controller: DraftController, stats: DecodeStats, prompt: torch.Tensor
             ) -> tuple[Steps, _Round]:
    """The prompt's forward and the first new token; with hooks, the committed ids too (on the device). With
    several skip sets, the prefill also chooses the one to draft with, and so the steps (`_prefill_choosing`)."""
    steps.cache.seek(0)
    if run.choosing is None:
        logits = steps.prefill(prompt)
    else:
        logits, steps = _prefill_choosing(run, controller, stats, prompt)
    # Whether the model's own logits are finite (before the processors, whose -inf is meant), read back with the
    # first token below: the check costs no host read of its own, which on CUDA would drain the queue.
    finite = torch.isfinite(logits).all()
    if run.hooks is not None:
        logits = run.hooks.process(prompt, logits)
    if run.sampling.do_sample:  # NaN would stop the sampler before that read (on CUDA, a device-side assert)
        logits = torch.where(finite, logits, torch.zeros_like(logits))
    last = _next_token(run, logits)
    # One host read, which also makes the prefill time exact on CUDA.
    *tokens, finite_read = torch.cat([last.view(-1), finite.view(1).to(last.dtype)]).tolist()
    check_finite(run.model, bool(finite_read))
    history = torch.cat([prompt[0], last]) if run.hooks is not None else None
    stopped = history is not None and _hooks_stop(run, history, tokens)
    return steps, _Round(tokens, last, history, stopped)


def check_finite(model: torch.nn.Module, finite: bool) -> None:
    """A NonFiniteLogits naming `model` unless the prefill's logits were `finite`: NaN or inf there (damaged
    weights, or an overflow in the model's dtype) would have greedy decoding commit argmax's arbitrary pick and
    report full acceptance, and sampling end in torch's traceback. Asked once per call, at the first forward, whose
    token read carries the answer: never per decoded token, which would cost a host read each on CUDA."""
    if not finite:
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise NonFiniteLogits(f"model {name!r} gives non-finite logits (NaN or inf) at its first forward: its "
                              f"weights are damaged, or overflow in {str(model.dtype).removeprefix('torch.')}; "
                              "nothing was decoded or measured")


def _prefill_choosing(run: _Run, controller: DraftController, stats: DecodeStats, prompt: torch.Tensor
                      ) -> tuple[torch.Tensor, Steps]:
    """The prefill that chooses this prompt's skip set, or plain decoding (choice.py): the controller drafts with
    the chosen set, its acceptance seeded by the set's agreement. Returns the logits predicting the first token."""
    cache = next(iter(run.choosing.values())).cache
    candidates = tuple(skip for skip in run.choosing if skip is not None)
    logits, choice = prefill_choosing(run.model, cache, prompt, candidates, run.max_draft_tokens, run.sampling,
                                      run.profile)
    if choice.skip is not None:
        shape = round_costs(run.model, choice.skip, run.max_draft_tokens, run.profile, prompt.shape[1])
        controller.use(choice.skip, shape, choice.agreements[choice.chosen])
    stats.choices.append(choice)
    return logits, run.choosing[choice.skip]


def _next_token(run: _Run, logits: torch.Tensor) -> torch.Tensor:
    if run.sampling.do_sample:
        return torch.multinomial(run.sampling.probabilities(logits)[0], 1, generator=run.generator)
    return logits.argmax(-1)


def _plain_steps(run: _Run, steps: Steps, stats: DecodeStats, last: torch.Tensor, position: int, room: int
                 ) -> _Round:
    """Plain decoding: every token is final, so steps run back to back and are read back together.
    Tokens decoded past an EOS are dropped (and their steps counted)."""
    n = min(PLAIN_STEPS_PER_READ if run.read_once else 1, room)
    ids = [last]
    for _ in range(n):
        ids.append(_next_token(run, steps.plain(ids[-1].view(1, 1))))
    new_tokens = torch.cat(ids[1:]).tolist()
    steps.cache.seek(position + n)  # each step advanced it: said outright, as every round says it
    stats.rounds += n
    stats.verify_sizes[1] += n
    stats.verify_contexts.update((1, position + j) for j in range(n))
    kept = _through_eos(new_tokens, run.eos)
    return _Round(kept, ids[-1], None, False, dropped=len(kept) < n)


def _round(run: _Run, steps: Steps, controller: DraftController, stats: DecodeStats, before: _Round, position: int,
           room: int, drafts: int) -> _Round:
    """One speculative round at `position` (the cache's committed length): draft, verify, commit. With no drafts
    (plain decoding with hooks, a plain stretch of the controller's, no room left) it verifies `last` alone."""
    last, history = before.last, before.history
    draft = _draft(run, steps, controller, stats, last, drafts, history) if drafts else Draft(last.view(1, 1), 0)
    steps.cache.seek(position)  # verification overwrites what the drafts wrote
    logits = _verify(run, steps, controller, draft, position)
    if run.hooks is not None:
        logits = run.hooks.process(torch.cat([history, draft.ids[0, 1:]]).view(1, -1), logits[: draft.ids.shape[1]])
    if run.sampling.do_sample:
        accepted, new_tokens, last = verify_sampling(logits, draft, run.sampling, run.generator)
    else:
        accepted, new_tokens, last = verify_greedy(logits, draft)
    steps.cache.seek(position + accepted + 1)  # the committed tokens, the new `last` excluded
    _record_round(stats, accepted, draft.count, position)
    new_tokens, stopped = _through_eos(new_tokens[:room], run.eos), False
    if run.hooks is not None:
        committed = torch.cat([draft.ids[0, 1 : 1 + accepted], last.view(-1)])[: len(new_tokens)]
        history = torch.cat([history, committed])
        stopped, new_tokens = _hooks_commit(run, history, new_tokens)
    return _Round(new_tokens, last, history, stopped, draft.count, accepted, draft.confidences, draft.seconds)


def _draft(run: _Run, steps: Steps, controller: DraftController, stats: DecodeStats, last: torch.Tensor,
           drafts: int, history: torch.Tensor | None) -> Draft:
    """The round's drafts: as many as planned, cut at an unsure one where reads are free (not on CUDA) and the call is
    timed (the cut weighs a draft's chance against its measured price).
    With `time_drafts`, the drafting time is measured (two syncs: for cost accounting only)."""
    if run.time_drafts:
        synchronize(last.device)
        start = time.perf_counter()
    cut = None if run.read_once or not run.timed else controller.cut()
    draft = draft_round(steps.draft, last, drafts, cut, run.sampling, run.generator, run.hooks, history, ROUND_CLOCK)
    if run.time_drafts:
        synchronize(last.device)
        stats.draft_time_s += time.perf_counter() - start
    return draft


def _verify(run: _Run, steps: Steps, controller: DraftController, draft: Draft, position: int) -> torch.Tensor:
    """The full model's logits over the round's tokens, padded to the width verified at: compiled steps take one
    width (the widest round's); eager ones the cheapest priced width at least as wide (`DraftController.width`), but
    none that crosses a bound (`_widest`)."""
    if not draft.count:
        return steps.plain(draft.ids)
    if run.compiled:
        return steps.verify(pad_to(draft.ids, run.max_draft_tokens + 1))
    return steps.verify(pad_to(draft.ids, controller.width(draft.ids.shape[1], _widest(run, position))))


def _record_round(stats: DecodeStats, accepted: int, count: int, position: int) -> None:
    """Statistics of a round, from the values its one host read brought."""
    stats.rounds += 1
    stats.verify_sizes[count + 1] += 1
    stats.verify_contexts[count + 1, position] += 1
    stats.drafted += count
    stats.accepted += accepted


def _hooks_stop(run: _Run, history: torch.Tensor, tokens: list[int]) -> bool:
    """After the prefill: whether a stopping criterion fired on the first token; the streamer gets it."""
    stopped = run.hooks.stop(history.view(1, -1), 1) is not None
    if run.hooks.commit is not None:
        run.hooks.commit(tokens)
    return stopped


def _hooks_commit(run: _Run, history: torch.Tensor, new_tokens: list[int]) -> tuple[bool, list[int]]:
    """A round's tokens through the stopping criteria (cut after the one that fired) and to the streamer."""
    keep = run.hooks.stop(history.view(1, -1), len(new_tokens))
    stopped = keep is not None
    if stopped:
        new_tokens = new_tokens[:keep]
    if run.hooks.commit is not None:
        run.hooks.commit(new_tokens)
    return stopped, new_tokens


