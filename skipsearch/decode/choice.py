"""Choosing, per prompt, which of several skip sets to draft with, or plain decoding.

A skip set found on chat prompts may draft poorly on code. Given several candidate sets, `prefill_choosing` splits the
prompt's prefill so that the choice costs almost nothing: the full model prefills all but the prompt's last `w`
tokens (`CHOICE_WINDOW`, or the whole prompt when it is shorter); each candidate's draft path then runs over those `w`
tokens, reading the full model's cache of the prefix as real drafts do, and the cache's position is moved back; last,
the full model runs over the `w` tokens, overwriting whatever the drafts wrote there, and gives the first new token
as the prefill would have. The extra cost is one draft forward of `w` tokens per candidate, batched like a prefill.

A draft's agreement with the full model over those positions estimates its per-token acceptance: the share of
positions where the two argmaxes agree (greedy), or where sampling, the mean of sum(min(p, q)), which is speculative
sampling's acceptance probability. With a one-token prompt the window is that token alone: one position, compared
all the same. `expected_speedup` turns an acceptance and what the draft costs (`RoundCosts`: a device cost profile's
timings, else the share of the weights the draft reads) into the speedup drafting should give at its best draft
length; the candidate with the highest one is chosen if it beats plain decoding's 1.0, which wins ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .adapter import rope_switches
from .cost_profile import CostProfile
from .economics import RoundCosts, best_draft_length, committed_tokens, weight_fraction  # RoundCosts: re-exported
from .engine import engine_for
from .kvcache import SpeculativeCache
from .sampling import Sampling
from .skipping import draft_model
from .skipset import SkipSet
from .steps import forward_at_position

CHOICE_WINDOW = 16  # the prompt's last tokens the drafts are compared on: enough to tell a fitting set from a poor one


def expected_speedup(acceptance: float, costs: RoundCosts, max_draft_tokens: int) -> float:
    """The speedup over plain decoding expected at the best draft length with 0 (plain decoding) on the menu: the
    draft controller's decision (controller.py), with `acceptance` the estimate the prefill's agreement seeds. A
    round of k drafts commits `committed_tokens(acceptance, k)` for k draft forwards and one verification of k + 1
    tokens (padded to its cheapest width), where plain decoding commits one token per forward."""
    drafts = best_draft_length(acceptance, costs.round, max_draft_tokens, least=0)
    return committed_tokens(acceptance, drafts) / costs.round(drafts)


def round_costs(model: nn.Module, skip: SkipSet, max_draft_tokens: int, profile: CostProfile | None = None,
                context: int = 0) -> RoundCosts:
    """A round's costs with `skip`: from the device's cost profile at `context` cached tokens when given (widths as
    measured: `RoundCosts.width` pads to the cheapest), else the memory-bound estimate (`weight_fraction`, and a
    verification of a few tokens costing one forward)."""
    if profile is None:
        return RoundCosts(draft=weight_fraction(model, skip))
    forward = profile.forward_at(context)
    return RoundCosts(draft=profile.draft_s(skip, context) / forward,
                      verify=tuple(profile.verify_measured(n, context) / forward
                                  for n in range(1, max_draft_tokens + 2)))


@dataclass(frozen=True)
class Choice:
    """Which skip set a prompt is decoded with, and why: each candidate's agreement with the full model over the
    prompt's last `window` tokens and the speedup expected from it (plain decoding: 1.0)."""

    candidates: tuple[SkipSet, ...]
    agreements: tuple[float, ...]
    speedups: tuple[float, ...]
    chosen: int | None  # index into `candidates`; None: plain decoding
    window: int

    @property
    def skip(self) -> SkipSet | None:
        """The chosen skip set; None for plain decoding."""
        return None if self.chosen is None else self.candidates[self.chosen]

    def as_dict(self) -> dict[str, Any]:
        return {"candidates": [skip.as_dict() for skip in self.candidates], "agreements": list(self.agreements),
                "expected_speedups": list(self.speedups), "chosen": self.chosen, "window": self.window}


def choose(candidates: Sequence[SkipSet], agreements: Sequence[float], costs: Sequence[RoundCosts],
           max_draft_tokens: int, window: int) -> Choice:
    """The candidate expected to decode fastest, or plain decoding unless one beats it (plain wins ties; among
    candidates, the first of equals)."""
    speedups = tuple(expected_speedup(a, c, max_draft_tokens) for a, c in zip(agreements, costs))
    chosen, best = None, 1.0
    for index, speedup in enumerate(speedups):
        if speedup > best:
            chosen, best = index, speedup
    return Choice(tuple(candidates), tuple(agreements), speedups, chosen, window)


def agreement(draft_logits: torch.Tensor, full_logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """A device scalar: the draft's expected per-token acceptance over the rows of the two logits (positions):
    argmaxes that agree when greedy; when sampling, the mean over rows of sum(min(p, q)), the probability that
    speculative sampling accepts a draft token there."""
    if not sampling.do_sample:
        return (draft_logits.argmax(-1) == full_logits.argmax(-1)).double().mean()
    p, q = sampling.probabilities(full_logits), sampling.probabilities(draft_logits)
    return torch.minimum(p, q).sum(-1).double().mean()


def prefill_choosing(model: nn.Module, cache: SpeculativeCache, prompt: torch.Tensor, candidates: Sequence[SkipSet],
                     max_draft_tokens: int, sampling: Sampling, profile: CostProfile | None = None
                     ) -> tuple[torch.Tensor, Choice]:
    """Prefill `prompt` (1, n) into `cache` from position 0 and choose among `candidates` and plain decoding.
    Returns the full model's logits predicting the first new token (1, vocab) and the choice; one host read.
    Drafts are compared on raw logits (with `sampling`'s own warpers): logits processors, which act on draft and
    full model alike, are left out of an estimate that needs to rank sets, not predict acceptance exactly."""
    n = prompt.shape[1]
    start = n - min(CHOICE_WINDOW, n)
    if any(start <= switch < n for switch in rope_switches(model.config)):
        start = 0  # the prefix alone would take other rotary frequencies than the whole prompt does (longrope)
    window, tail = n - start, prompt[:, start:]
    drafts = []
    with engine_for(model).attention():  # the forwards attend as the engine's steps do
        if start:
            forward_at_position(model, cache, prompt[:, :start], logits_to_keep=1)
        for skip in candidates:
            drafts.append(forward_at_position(draft_model(model, skip), cache, tail))
            cache.seek(start)  # the full model's forward below overwrites every layer's slots the draft wrote
        full = forward_at_position(model, cache, tail)
    agreements = torch.stack([agreement(draft, full, sampling) for draft in drafts]).tolist()
    costs = [round_costs(model, skip, max_draft_tokens, profile, n) for skip in candidates]
    return full[-1:], choose(candidates, agreements, costs, max_draft_tokens, window)
