"""One speculative round's parts: drafting up to k tokens with the draft step, and verifying them against the full
model's logits (greedy, or by rejection sampling), with the hooks that put transformers' processors and stopping
criteria in the loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .economics import Cut
from .sampling import Sampling, rejection_sample
from .steps import Step


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


@dataclass
class Draft:
    """What a draft round produced: the verify input `[last, d1..dk]`, its k drafts, and when sampling their
    distributions."""

    ids: torch.Tensor  # (1, k + 1)
    count: int
    probs: torch.Tensor | None = None  # (k, vocab)
    confidences: list[float] | None = None  # each draft's confidence, where it was read back (the cut)
    seconds: float | None = None  # the drafts' wall time, where each was read back (the cut): no sync needed


def draft_round(
    step: Step, last: torch.Tensor, budget: int, cut: Cut | None, sampling: Sampling,
    generator: torch.Generator | None, hooks: DecodeHooks | None = None, history: torch.Tensor | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Draft:
    """Draft up to `budget` tokens after `last` with the draft step. With `cut` (where a draft's confidence is free to
    read, `DraftController.cut`), a draft's chance of acceptance is the one drafts of its confidence have had, and
    drafting stops once the chance that the next draft is accepted with all before it (their chances' product times
    the acceptance estimate) is below its price: a host read per drafted token. Without, every draft stays on the
    device. With `hooks`, each draft's logits are processed with `history` (the committed ids, `last` included) and
    the drafts so far. With `cut`, the drafts are timed by `clock` too: each read ends its draft's work."""
    tokens, probs, chance, confidences, start = [last.view(1)], [], 1.0, [], clock() if cut is not None else 0.0
    for _ in range(budget):
        logits = _draft_logits(step, tokens, hooks, history)
        if sampling.do_sample:
            probs.append(_proper(sampling.probabilities(logits)[0]))
            tokens.append(torch.multinomial(probs[-1], 1, generator=generator))
        else:
            tokens.append(logits.argmax(-1))
        # The unsure token is kept: its forward is already paid, and verifying one
        # more token costs far less than a forward on memory-bound hardware.
        if cut is not None:
            confidences.append(float(probs[-1].max() if probs else torch.softmax(logits.float(), -1).max()))  # the read
            chance *= cut.chance(confidences[-1])
            if chance * cut.acceptance < cut.price:
                break
    timed = cut is not None
    return Draft(torch.cat(tokens).view(1, -1), len(tokens) - 1, torch.stack(probs) if probs else None,
                 confidences if timed else None, clock() - start if timed else None)


def _proper(probs: torch.Tensor) -> torch.Tensor:
    """A draft distribution that sums to one: a row with no mass left (NaN where the logits processors banned every
    token a trimmed head names, and a temperature below 1 took its floor to -inf) drafts uniformly instead, on the
    device. Rejection sampling is exact for any draft distribution: only the acceptance suffers."""
    return torch.where(probs.sum() > 0, probs, 1.0 / probs.shape[-1])  # a scalar: no row allocated per draft


def _draft_logits(step: Step, tokens: list[torch.Tensor], hooks: DecodeHooks | None, history: torch.Tensor | None
                  ) -> torch.Tensor:
    logits = step(tokens[-1].view(1, 1))
    if hooks is not None:
        logits = hooks.process(torch.cat([history, *tokens[1:]]).view(1, -1), logits)
    return logits


def verify_greedy(logits: torch.Tensor, draft: Draft) -> tuple[int, list[int], torch.Tensor]:
    """Keep the longest prefix of the drafts that the full model's argmax agrees with, then its own token.

    Acceptance is decided on the device; the round's one host read brings the accepted count and
    the tokens. Returns those and the last committed token on the device.
    """
    targets = logits[: draft.count + 1].argmax(-1)
    agree = draft.ids[0, 1:] == targets[:-1]
    accepted = agree.int().cumprod(0).sum().view(1)
    host = torch.cat([accepted, targets]).tolist()
    n = host[0]
    return n, host[1 : n + 2], targets.gather(0, accepted)


def verify_sampling(
    logits: torch.Tensor, draft: Draft, sampling: Sampling, generator: torch.Generator | None
) -> tuple[int, list[int], torch.Tensor]:
    """Speculative rejection sampling of the drafts against the full model's distributions."""
    accepted, tokens, last = rejection_sample(
        draft.ids[0, 1:], draft.probs, sampling.probabilities(logits[: draft.count + 1]), generator)
    return accepted, tokens, last.clone()  # a fresh tensor, not a view into the round's samples


def pad_to(ids: torch.Tensor, width: int) -> torch.Tensor:
    """`ids` padded to `width` tokens by repeating its last: padded positions land past the query, unseen."""
    missing = width - ids.shape[1]
    return torch.cat([ids, ids[:, -1:].expand(1, missing)], dim=1) if missing > 0 else ids
