"""Self-speculative decoding: draft with sublayers skipped, verify all drafts in one full forward.

Invariant of the loop: the KV cache holds the full model's keys and values for every
committed token but the last one, which is fed at the start of the next round.
A round drafts up to k tokens with the draft path (`draft_round`), moves the static cache's
write position back to the committed length (stale slots past it stay, hidden by the causal
mask), verifies `[last, d1..dk]` in one forward of the full model and keeps the longest
accepted prefix plus one token of the full model (`verify_greedy`, `verify_sampling`). Greedy verification gives
exactly the tokens of plain greedy decoding; sampling uses speculative rejection sampling,
which keeps the full model's distribution.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .engine import CompileSettings, Step, _forward, engine_for
from .inputs import check_generate_args, check_prompt
from .kvcache import SpeculativeCache
from .skipping import SkipSet


@dataclass(frozen=True)
class DraftPolicy:
    """How many tokens to draft per round.

    With `adaptive`, drafting stops after a token whose draft top-1 probability is below
    `confidence_threshold`, and after every round the threshold moves by `threshold_step`
    toward keeping the (smoothed) acceptance rate at `target_acceptance` (Draft & Verify).
    `max_draft_tokens=0` is plain autoregressive decoding through the same loop.
    """

    max_draft_tokens: int = 8
    adaptive: bool = True
    confidence_threshold: float = 0.6
    target_acceptance: float = 0.7
    threshold_step: float = 0.05

    def __post_init__(self) -> None:
        if isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int) or self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be an integer >= 0, got {self.max_draft_tokens!r}")
        for name in ("confidence_threshold", "target_acceptance", "threshold_step"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class Sampling:
    """Greedy by default; with `do_sample`, temperature / top-k / top-p through transformers' logits warpers."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @functools.cached_property
    def warpers(self) -> LogitsProcessorList:
        """Built once per Sampling (a cached property works on frozen dataclasses): the loop calls it per token."""
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token distributions, one per row of `logits` (rows, vocab); fp32 for sampling."""
        # The warpers read no input ids for temperature / top-k / top-p.
        return torch.softmax(self.warpers(None, logits.float()), dim=-1)


@dataclass
class DecodeStats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0  # the prompt's forward and the first token, inside wall_time_s
    # Time spent in draft forwards alone, for cost accounting; measured only when asked (it syncs).
    draft_time_s: float = 0.0
    # Verification rounds by the number of tokens they verified: the cost model needs the sizes, not the mean.
    verify_sizes: collections.Counter = field(default_factory=collections.Counter)
    # Rounds by (tokens verified, tokens cached before the round): the cost model prices each at its context.
    verify_contexts: collections.Counter = field(default_factory=collections.Counter)
    # Time of first calls of compiled steps during this call (tracing and compiling), inside wall_time_s.
    compile_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens; None when nothing was drafted (plain decoding has none)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Accepted draft tokens per verification round; None when nothing was drafted, like the acceptance rate."""
        return self.accepted / self.rounds if self.drafted else None

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding: a first compiled call's compile time is reported apart, not in here."""
        seconds = self.wall_time_s - self.compile_time_s
        return self.new_tokens / seconds if seconds > 0 else 0.0

    def add(self, other: DecodeStats) -> None:
        for name in ("new_tokens", "rounds", "drafted", "accepted", "wall_time_s", "prefill_time_s", "draft_time_s",
                     "compile_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.verify_sizes.update(other.verify_sizes)
        self.verify_contexts.update(other.verify_contexts)

    def as_dict(self) -> dict[str, float]:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "wall_time_s": self.wall_time_s,
            "prefill_time_s": self.prefill_time_s,
            "compile_time_s": self.compile_time_s,  # inside wall_time_s: a first compiled call is slow for this
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class GenerationOutput:
    tokens: list[int]  # the new tokens only, EOS included when it ended the generation
    stats: DecodeStats = field(default_factory=DecodeStats)
    final_threshold: float | None = None


@dataclass(frozen=True)
class DecodeHooks:
    """Generation controls from outside the loop (transformers' processors, criteria, streamers: `self_speculative`).

    `process(ids, logits)`: scores for the rows of `logits` (rows, vocab), where row i predicts
    the token at position `n - rows + 1 + i` of `ids` (1, n) and is processed with the ids before
    it as its prefix. When given, the scores replace the logits everywhere (prefill, drafts,
    verification) and `Sampling` should add no warpers of its own.
    `stop(ids, m)`: after the last `m` of `ids` (1, n) were committed, how many of them to keep
    because a stopping criterion fired on the last kept one, or None when none fired.
    `commit(tokens)`: called with the tokens committed by each round, after `stop` cut them.
    Without hooks the loop does no per-token Python work for them.
    """

    process: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    stop: Callable[[torch.Tensor, int], int | None]
    commit: Callable[[list[int]], None] | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(eos_token_id: int | Iterable[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(t) for t in eos_token_id)


_FIXED_LENGTH = DraftPolicy(adaptive=False)


def _through_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first EOS among them."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def plain_steps_per_sync(device: torch.device) -> int:
    """How many one-token steps plain decoding runs between host read-backs. On CUDA 8: a host sync per token is
    what bounds a fast GPU (BENCHMARKS.md, GPU), and up to 7 steps past an EOS are the price. On a CPU 1: a sync
    waits for nothing there, so batching would only add the steps past an EOS."""
    return 8 if device.type == "cuda" else 1


@dataclass
class Draft:
    """What a draft round produced: the verify input `[last, d1..dk]` and, when sampling, the draft's distributions."""

    ids: torch.Tensor  # (1, k + 1)
    count: int
    probs: torch.Tensor | None = None  # (k, vocab)


def draft_round(
    step: Step, cache: SpeculativeCache, last: torch.Tensor, start: int, budget: int, policy: DraftPolicy,
    threshold: float, sampling: Sampling, generator: torch.Generator | None,
    hooks: DecodeHooks | None = None, history: torch.Tensor | None = None,
) -> Draft:
    """Draft up to `budget` tokens after `last` (at position `start`) with the draft step.

    Fixed-length drafting stays on the device; adaptive drafting reads each draft's confidence
    (one host sync per drafted token) to stop after an unsure one. With `hooks`, each draft's
    logits are processed with `history` (the committed ids, `last` included) and the drafts so far.
    """
    tokens, probs = [last], []
    for j in range(budget):
        cache.seek(start + j)
        logits = step(tokens[-1].view(1, 1))
        if hooks is not None:
            logits = hooks.process(torch.cat([history, *tokens[1:]]).view(1, -1), logits)
        if sampling.do_sample:
            probs.append(sampling.probabilities(logits)[0])
            tokens.append(torch.multinomial(probs[-1], 1, generator=generator))
        else:
            tokens.append(logits.argmax(-1))
        # The unsure token is kept: its forward is already paid, and verifying one
        # more token costs far less than a forward on memory-bound hardware.
        if policy.adaptive:
            confidence = probs[-1].max() if probs else torch.softmax(logits.float(), -1).max()
            if float(confidence) < threshold:
                break
    return Draft(torch.cat(tokens).view(1, -1), len(tokens) - 1, torch.stack(probs) if probs else None)


def verify_greedy(logits: torch.Tensor, draft: Draft) -> tuple[int, list[int], torch.Tensor]:
    """Keep the longest prefix of the drafts that the full model's argmax agrees with, then its own next token.

    Acceptance is decided on the device; the one host transfer of the round brings the count and
    the tokens. Returns the accepted count, the committed tokens and the last of them on the device.
    """
    targets = logits[: draft.count + 1].argmax(-1)
    agree = (draft.ids[0, 1:] == targets[:-1]).int()
    accepted = agree.cumprod(0).sum().view(1)
    host = torch.cat([accepted, targets]).tolist()
    n = host[0]
    return n, host[1 : n + 2], targets.gather(0, accepted)


def verify_sampling(
    logits: torch.Tensor, draft: Draft, sampling: Sampling, generator: torch.Generator | None
) -> tuple[int, list[int], torch.Tensor]:
    """Speculative rejection sampling of the drafts against the full model's distributions."""
    accepted, tokens, last = _rejection_sample(
        draft.ids[0, 1:], draft.probs, sampling.probabilities(logits[: draft.count + 1]), generator)
    return accepted, tokens, last.clone()  # a fresh tensor, not a view into the round's samples


def _pad(ids: torch.Tensor, width: int) -> torch.Tensor:
    """`ids` padded to `width` tokens by repeating its last: padded positions land past the query, unseen."""
    missing = width - ids.shape[1]
    return torch.cat([ids, ids[:, -1:].expand(1, missing)], dim=1) if missing > 0 else ids


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    *,
    skip: SkipSet | None = None,
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
) -> GenerationOutput:
    """Decode `max_new_tokens` (or up to EOS) for one prompt with self-speculative decoding.

    `skip=None`, an empty skip set or `policy.max_draft_tokens == 0` decodes autoregressively
    through the same loop. `generator` seeds sampling; it must live on the model's device.
    `compile` runs the draft and verify forwards through `torch.compile` (`compile_backend`,
    `compile_mode`; CUDA graphs by default on CUDA); compiled steps are kept on the model and
    reused by later calls with the same skip set. The prefill always runs eagerly.
    `hooks` put logits processing, stopping and streaming in the caller's hands (`DecodeHooks`).
    """
    prompt = check_prompt(model, input_ids)  # before any work: each a TypeError or ValueError saying what is wrong
    check_generate_args(model, prompt.shape[1], skip, max_new_tokens, policy, sampling)
    # Drafting with nothing skipped is the full model twice over: an empty set means plain decoding.
    max_draft = policy.max_draft_tokens if skip is not None and skip.size else 0
    settings = CompileSettings(compile_backend, compile_mode) if compile else None
    verify_width = max_draft + 1
    # Writes reach at most one verify width past the last committed token.
    cache, drafter, verifier = engine_for(model).prepare(prompt.shape[1] + max_new_tokens + verify_width,
                                                         skip if max_draft else None, settings, verify_width)
    uncompiled = [step for step in (drafter, verifier) if step is not None and step.compile_time_s is None]
    output = _decode(model, cache, drafter, verifier, prompt, max_draft, max_new_tokens, policy, sampling,
                     _eos_set(eos_token_id), generator, time_drafts,
                     verify_width=verify_width if compile else None, hooks=hooks)
    output.stats.compile_time_s = sum(step.compile_time_s or 0.0 for step in uncompiled)
    return output


def _decode(
    model: torch.nn.Module, cache: SpeculativeCache, drafter: Step | None, verifier: Step, prompt: torch.Tensor,
    max_draft: int, max_new_tokens: int, policy: DraftPolicy, sampling: Sampling, eos: frozenset[int],
    generator: torch.Generator | None, time_drafts: bool, verify_width: int | None, hooks: DecodeHooks | None = None,
) -> GenerationOutput:
    """The loop: prefill, then rounds of draft, verify, commit. The cache holds every committed token but `last`.

    With `verify_width` (compiled steps: static shapes) every verification is padded to that
    width; otherwise it is exactly as wide as what was drafted.
    """
    device = prompt.device
    steps_per_sync = plain_steps_per_sync(device)
    threshold = policy.confidence_threshold
    smoothed_acceptance = policy.target_acceptance
    stats = DecodeStats()

    synchronize(device)
    start_time = time.perf_counter()
    cache.seek(0)
    logits = _forward(model, cache, prompt, 1)
    if hooks is not None:
        logits = hooks.process(prompt, logits)
    last = torch.multinomial(sampling.probabilities(logits)[0], 1, generator=generator) if sampling.do_sample \
        else logits.argmax(-1)
    tokens: list[int] = last.tolist()  # a host sync: the prefill time below is exact on CUDA too
    stats.prefill_time_s = time.perf_counter() - start_time
    cached = prompt.shape[1]  # positions in the cache; `last` sits at position `cached`
    stopped, history = False, None
    if hooks is not None:
        history = torch.cat([prompt[0], last.view(-1)])  # the committed ids, on the device
        stopped = hooks.stop(history.view(1, -1), 1) is not None
        if hooks.commit is not None:
            hooks.commit(tokens)

    while len(tokens) < max_new_tokens and tokens[-1] not in eos and not stopped:
        if not max_draft and hooks is None:
            # Plain decoding: every token is final, so steps can run back to back and be read back in one host
            # sync. Tokens decoded past an EOS are dropped below.
            n = min(steps_per_sync, max_new_tokens - len(tokens))
            steps = draft_round(verifier, cache, last, cached, n, _FIXED_LENGTH, threshold, sampling, generator)
            new_tokens, last = steps.ids[0, 1:].tolist(), steps.ids[0, -1:]
            stats.rounds += n
            stats.verify_sizes[1] += n
            stats.verify_contexts.update((1, cached + j) for j in range(n))
            tokens.extend(_through_eos(new_tokens, eos))
            cached += n
            continue
        budget = min(max_draft, max_new_tokens - len(tokens) - 1)
        if time_drafts and budget:
            synchronize(device)
            draft_start = time.perf_counter()
        draft = draft_round(drafter, cache, last, cached, budget, policy, threshold, sampling, generator,
                            hooks, history) if budget else Draft(last.view(1, 1), 0)
        if time_drafts and budget:
            synchronize(device)
            stats.draft_time_s += time.perf_counter() - draft_start

        cache.seek(cached)  # verify overwrites whatever the draft wrote from here on
        logits = verifier(_pad(draft.ids, verify_width) if verify_width else draft.ids)
        if hooks is not None:
            logits = hooks.process(torch.cat([history, draft.ids[0, 1:]]).view(1, -1), logits[: draft.count + 1])
        if sampling.do_sample:
            accepted, new_tokens, last = verify_sampling(logits, draft, sampling, generator)
        else:
            accepted, new_tokens, last = verify_greedy(logits, draft)

        stats.rounds += 1
        stats.verify_sizes[draft.count + 1] += 1
        stats.verify_contexts[draft.count + 1, cached] += 1
        stats.drafted += draft.count
        stats.accepted += accepted
        if policy.adaptive and draft.count:
            smoothed_acceptance = 0.5 * smoothed_acceptance + 0.5 * accepted / draft.count
            step = policy.threshold_step if smoothed_acceptance < policy.target_acceptance else -policy.threshold_step
            threshold = min(1.0, max(0.0, threshold + step))

        new_tokens = _through_eos(new_tokens[: max_new_tokens - len(tokens)], eos)
        if hooks is not None:
            committed = prompt.shape[1] + len(tokens) + len(new_tokens)  # the cuts above shorten the round
            history = torch.cat([history, draft.ids[0, 1 : 1 + accepted], last.view(-1)])[:committed]
            keep = hooks.stop(history.view(1, -1), len(new_tokens))
            if keep is not None:
                stopped, new_tokens = True, new_tokens[:keep]
            if hooks.commit is not None:
                hooks.commit(new_tokens)
        tokens.extend(new_tokens)
        cached += accepted + 1

    synchronize(device)
    stats.wall_time_s = time.perf_counter() - start_time
    stats.new_tokens = len(tokens)
    return GenerationOutput(tokens=tokens, stats=stats, final_threshold=threshold if policy.adaptive else None)


def _rejection_sample(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, list[int], torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    sample from the residual max(0, p - q) renormalised, and after k acceptances from the
    full model's next distribution. Returns the accepted count, the committed tokens, and
    the last of them as a device tensor.
    """
    k = drafts.shape[0]
    if k == 0:
        token = torch.multinomial(target_probs[-1], 1, generator=generator)
        return 0, token.tolist(), token
    index = drafts.view(-1, 1)
    p_draft = target_probs[:-1].gather(1, index).view(-1)
    q_draft = draft_probs.gather(1, index).view(-1)
    uniform = torch.rand(k, device=drafts.device, generator=generator)
    accepts = (uniform * q_draft <= p_draft).int()
    n_accepted = accepts.cumprod(0).sum()
    residual = (target_probs[:-1] - draft_probs).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # Where p == q the residual is empty; a rejection cannot happen there, so any row will do.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs[:-1])
    candidates = torch.cat([residual, target_probs[-1:]])
    corrections = torch.multinomial(candidates, 1, generator=generator).view(-1)
    host = torch.cat([n_accepted.view(1), drafts, corrections]).tolist()
    accepted = host[0]
    return accepted, host[1 : 1 + accepted] + [host[1 + k + accepted]], corrections[accepted : accepted + 1]


@dataclass(frozen=True)
class Divergence:
    """Where two greedy decodings first differ, and how close the full model's top two choices were there."""

    position: int  # index into the new tokens
    top2_gap: float  # top-1 minus top-2 logit of the reference forward at that position (nan past its logits)


def first_divergence(reference: Sequence[int], candidate: Sequence[int], logits: torch.Tensor) -> Divergence | None:
    """The first position where `candidate` leaves `reference`, with the top-2 logit gap there.

    `logits` (len(reference), vocab) are the full model's logits predicting each reference token
    (`reference_logits`). In bf16 / fp16 a batched verify forward rounds differently from a
    one-token forward, so a near-tie (a small gap) can flip; a large gap points at a bug.
    """
    common = min(len(reference), len(candidate))
    position = next((i for i in range(common) if reference[i] != candidate[i]), common)
    if position == common and len(reference) == len(candidate):
        return None
    if position >= logits.shape[0]:
        return Divergence(position, float("nan"))
    top2 = logits[position].float().topk(2).values
    return Divergence(position, float(top2[0] - top2[1]))


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """The model's logits predicting each of `tokens` after `prompt`, teacher-forced in one forward."""
    ids = torch.tensor([list(prompt) + list(tokens)], device=model.device)
    return model(ids[:, :-1]).logits[0, len(prompt) - 1 :]
