"""The economics of a round: what drafting commits and what it costs, as the draft controller (controller.py) weighs it.

- `Acceptance`: the one estimate of a draft's chance of being accepted, per skip set; seeded by the prior (or the
  prefill's agreement, choice.py) and moved by the rounds.
- `RoundCosts`: the shape of a round's price in one-token forwards of the full model (a draft forward; a verification
  by width), from a device cost profile, else from the share of the weights a draft reads (`weight_fraction`): what a
  draft costs where decoding is bound by memory bandwidth and verifying a few more tokens is free. Widths are priced
  as measured: hardware prices them in steps (CPU matrix kernels, GPU tiles), so a verification of n tokens costs
  the cheapest measured width j >= n, and is padded to j (`RoundCosts.width`).
- `PriceFit`: that shape in seconds, fit from the rounds' wall times (faded least squares of a round's time on its
  verification and its draft forwards).
- `ConfidenceBins`, `Cut`: where a draft's confidence is free to read (a CPU), how often drafts of each confidence
  are accepted, and what a round needs to stop at an unsure one.
- `best_draft_length`: the drafts per round that commit the most tokens per unit of time (Leviathan et al. 2023,
  section 3.4), priced; 0 (a plain step) on the menu where the caller puts it there.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from . import adapter
from .adapter import decoder_layers
from .skipset import SkipSet

PRIOR_ACCEPTANCE = 0.7  # before any round or agreement: drafts of a set worth trying are accepted often
PRIOR_DRAFTS = 2.0  # the prior weighs as much as two drafts: the first rounds decide
ACCEPTANCE_FADE = 0.9  # per round: the estimate follows the last ten rounds or so
PRICE_FADE = 0.95  # per round: the price fit follows the last few dozen rounds, so a growing context is tracked
PULL = 0.001  # how strongly the fit keeps the profile's ratio of draft to verification until rounds vary in length
UNIT_LIMITS = (0.1, 10.0)  # a fit unit this far from the common one is noise, not a price


@dataclass(frozen=True)
class SublayerWeights:
    """The parameters a one-token forward reads, per layer and sublayer, and in the output projection (the embedding
    lookup reads one row). A routed feed-forward block counts its router, shared experts and the experts a token is
    routed to (`num_experts_per_tok`), not the experts it does not read."""

    attn: tuple[int, ...]
    mlp: tuple[int, ...]
    head: int

    @property
    def total(self) -> int:
        return self.head + sum(self.attn) + sum(self.mlp)


def sublayer_weights(model: nn.Module) -> SublayerWeights:
    """What each sublayer of `model` reads per token (see `SublayerWeights`)."""
    layers = decoder_layers(model)
    config = model.config.get_text_config(decoder=True)
    return SublayerWeights(attn=tuple(_size(getattr(layer, adapter.ATTENTION)) for layer in layers),
                           mlp=tuple(adapter.feed_forward_parameters_read(getattr(layer, adapter.FEED_FORWARD), config)
                                     for layer in layers),
                           head=_size(model.get_output_embeddings()))


def weight_fraction(model: nn.Module, skip: SkipSet) -> float:
    """The share of the weights a one-token forward reads (`sublayer_weights`) that the draft still reads: what a
    draft forward costs relative to a full one where forwards are memory-bound, as batch-1 decoding is on a GPU."""
    weights = sublayer_weights(model)
    skipped = sum(weights.attn[i] for i in skip.attn) + sum(weights.mlp[i] for i in skip.mlp)
    if skip.head is not None:  # a trimmed head reads its rows of the full head's
        vocab_size = adapter.output_head(model)[1].shape[0]
        skipped += weights.head * (1 - skip.head.rows / vocab_size)
    return (weights.total - skipped) / weights.total


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass
class Acceptance:
    """A drafted token's chance of being accepted when every draft before it in the round was: accepted drafts over
    accepted drafts and rejections, where a round that kept fewer drafts than it ran ended in one rejection and a
    round that kept them all in none (the maximum-likelihood rate where acceptances are independent draws and a
    round's length cuts the draws short). Faded per round; starts from `prior` with the weight of `PRIOR_DRAFTS`."""

    prior: float = PRIOR_ACCEPTANCE
    accepted: float = field(init=False)
    rejected: float = field(init=False)

    def __post_init__(self) -> None:
        self.seed(self.prior)

    def seed(self, rate: float) -> None:
        """Start again from `rate` (the prefill's agreement, or what the rounds so far said) at the prior's weight."""
        self.accepted, self.rejected = rate * PRIOR_DRAFTS, (1.0 - rate) * PRIOR_DRAFTS

    def observe(self, accepted: int, drafted: int) -> None:
        self.accepted = ACCEPTANCE_FADE * self.accepted + accepted
        self.rejected = ACCEPTANCE_FADE * self.rejected + (accepted < drafted)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


# A draft's confidence (its top probability) binned at these edges: each bin learns how often its drafts are accepted.
CONFIDENCE_EDGES = (0.5, 0.8, 0.95)


def confidence_bin(confidence: float) -> int:
    return bisect.bisect_right(CONFIDENCE_EDGES, confidence)


@dataclass
class ConfidenceBins:
    """How often a skip set's drafts are accepted, by their confidence (`CONFIDENCE_EDGES`), where the cut reads it:
    per bin, faded counts of accepted and rejected drafts, shrunk toward the set's overall rate by the prior's weight.
    Whether confidence predicts acceptance is measured, not assumed: a draft that reads the full model through a
    trimmed head agrees with it at any confidence, one that skips layers less often when it is unsure."""

    counts: list[list[float]] = field(default_factory=lambda: [[0.0, 0.0] for _ in range(len(CONFIDENCE_EDGES) + 1)])

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A round whose drafts had `confidences` and whose first `accepted` were accepted: those, and the rejected
        one after them, are counted in their bins; drafts after a rejection were never judged."""
        for index, confidence in enumerate(confidences[: accepted + 1]):
            counts = self.counts[confidence_bin(confidence)]
            counts[0] = ACCEPTANCE_FADE * counts[0] + (index < accepted)
            counts[1] = ACCEPTANCE_FADE * counts[1] + (index >= accepted)

    def chances(self, rate: float) -> tuple[float, ...]:
        """Each bin's chance that a draft is accepted, given the set's overall `rate`."""
        return tuple((kept + PRIOR_DRAFTS * rate) / (kept + rejected + PRIOR_DRAFTS) for kept, rejected in self.counts)


@dataclass(frozen=True)
class Cut:
    """What a round needs to stop at an unsure draft where a draft's confidence is free to read (`rounds.draft_round`):
    the acceptance estimate, a draft's price in plain steps, and each confidence bin's chance (`ConfidenceBins`)."""

    acceptance: float
    price: float
    chances: tuple[float, ...]

    def chance(self, confidence: float) -> float:
        return self.chances[confidence_bin(confidence)]


def committed_tokens(acceptance: float, drafts: int) -> float:
    """The tokens a round of `drafts` commits on average, its accepted drafts and the full model's next token, when
    each draft is accepted with probability `acceptance` once the ones before it were: 1 + a + ... + a^drafts."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


def best_draft_length(acceptance: float, round_cost: Callable[[int], float], most: int, least: int = 1) -> int:
    """The drafts per round, `least` to `most` (`most` when it is below `least`), that commit the most tokens per
    unit of cost, a round of k drafts costing `round_cost(k)` (Leviathan et al. 2023, section 3.4); with `least` 0,
    a plain step is on the menu (`round_cost(0)` its price). The shortest of equals wins."""
    if most <= least:
        return max(most, 0)
    return max(range(least, most + 1), key=lambda drafts: committed_tokens(acceptance, drafts) / round_cost(drafts))


@dataclass(frozen=True)
class RoundCosts:
    """What a round's forwards cost, in one-token forwards of the full model: the shape a profile or the weights give,
    which `PriceFit` scales to seconds."""

    draft: float  # one draft forward
    # verify[n - 1]: one verification of n tokens as measured (past the end: the last one); empty: 1.0 for any n, as
    # on memory-bound hardware, where a forward of a few tokens reads the same weights as a forward of one.
    verify: tuple[float, ...] = ()

    def width(self, n_tokens: int, widest: int | None = None) -> int:
        """The width a verification of `n_tokens` runs at: the cheapest measured width >= n_tokens (up to `widest`),
        the narrowest of equals; n_tokens itself past the measured widths."""
        last = min(len(self.verify), widest or len(self.verify))
        if n_tokens >= last:
            return n_tokens
        return min(range(n_tokens, last + 1), key=lambda j: (self.verify[j - 1], j))

    def verification(self, n_tokens: int) -> float:
        """A verification of `n_tokens`, padded to its cheapest width (`width`)."""
        if not self.verify:
            return 1.0
        return self.verify[min(self.width(n_tokens), len(self.verify)) - 1]

    def round(self, drafts: int) -> float:
        """A round of `drafts` draft forwards and their verification."""
        return drafts * self.draft + self.verification(drafts + 1)


@dataclass
class PriceFit:
    """A round's seconds as `v * shape.verification(k + 1) + d * k * shape.draft` for k drafts: the shape's two parts,
    each scaled by a unit fit from the rounds' times (least squares faded by `PRICE_FADE`, pulled toward one common
    unit by `PULL`, so that until the rounds vary in length the shape's ratio of draft to verification stands).
    Where the drafts were timed apart (a CPU's cut reads each draft back, so its clock needs no sync), each part is
    fit from its own seconds: a round's total alone cannot tell a dearer draft from a verification that grows with
    its width, and over a few dozen noisy rounds of one to four drafts it mistook one for the other."""

    shape: RoundCosts
    sums: list[float] = field(default_factory=lambda: [0.0] * 6)  # weight, x1x1, x1x2, x2x2, x1t, x2t

    def observe(self, drafts: int, seconds: float, draft_seconds: float | None = None) -> None:
        """A round of `drafts` that took `seconds`, `draft_seconds` of them drafting where the drafts were timed."""
        x1, x2 = self.shape.verification(drafts + 1), drafts * self.shape.draft
        if draft_seconds is None:
            terms = (1.0, x1 * x1, x1 * x2, x2 * x2, x1 * seconds, x2 * seconds)
        else:  # each part's own equation: verification = v * x1, drafts = d * x2
            terms = (1.0, x1 * x1, 0.0, x2 * x2, x1 * max(seconds - draft_seconds, 0.0), x2 * draft_seconds)
        self.sums = [PRICE_FADE * s + t for s, t in zip(self.sums, terms)]

    def units(self) -> tuple[float, float] | None:
        """Seconds per unit of verification and of draft forwards; None before any timed round."""
        weight, s11, s12, s22, s1t, s2t = self.sums
        if weight == 0.0:
            return None
        common = (s1t + s2t) / (s11 + 2 * s12 + s22)  # both parts in one unit: the profile's shape, scaled
        pull = PULL * (s11 + s22) / 2
        a11, a22, b1, b2 = s11 + pull, s22 + pull, s1t + pull * common, s2t + pull * common
        det = a11 * a22 - s12 * s12
        v, d = (b1 * a22 - s12 * b2) / det, (a11 * b2 - s12 * b1) / det
        low, high = UNIT_LIMITS[0] * common, UNIT_LIMITS[1] * common
        return min(max(v, low), high), min(max(d, low), high)

    def round_s(self, drafts: int) -> float | None:
        """A round of `drafts` in seconds (0: a verification of one token, a plain step's forward); None before any
        timed round."""
        units = self.units()
        if units is None:
            return None
        return units[0] * self.shape.verification(drafts + 1) + units[1] * drafts * self.shape.draft

    def draft_price(self) -> float:
        """One more draft forward in one-token verifications: what a draft costs relative to a plain step."""
        units = self.units()
        v, d = units if units is not None else (1.0, 1.0)
        return d * self.shape.draft / (v * self.shape.verification(1))
