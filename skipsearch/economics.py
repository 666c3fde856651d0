"""What one more drafted token costs on this device, in plain decoding steps, measured as decoding goes.

A round that runs `d` draft forwards and verifies `d + 1` tokens takes about `base + d * per_draft`
seconds: `base` is a one-token forward of the full model plus the round's fixed work (a plain step's
worth), `per_draft` one draft forward plus one more verified token. Their ratio is the price of the next
draft in plain steps: drafting it pays only when its chance of being accepted (with all before it) is
above that price. The two are fit by least squares over the call's rounds (with forgetting, so a
growing context is tracked), from the wall time between the rounds' host reads, which the loop has
anyway. Until the rounds vary enough in length to separate the two, the price is the share of the
model's weights the draft still reads (`weight_fraction`): what it costs where decoding is bound
by memory bandwidth and verifying a few more tokens is free.

Where a read stalls the device (CUDA), a round cannot stop drafting at an unsure token without one: the
length of each round is chosen before it from the acceptance rate seen so far and that price
(`AcceptanceRate`, `best_draft_length`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from . import adapter
from .skipping import SkipSet, decoder_layers

FORGET = 0.95  # per round: the fit follows the last few dozen rounds
MIN_SPREAD = 0.25  # variance of the draft counts below which the fit cannot separate base and per-draft cost
PRICE_LIMITS = (0.02, 4.0)  # a fit outside these is noise, not a price


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
    return (weights.total - skipped) / weights.total


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass
class MarginalCost:
    """Online least squares of round time on draft forwards; `price` is per_draft / base, or `prior` until the
    rounds spread enough to tell the two apart."""

    prior: float
    weight: float = 0.0
    sum_d: float = 0.0
    sum_t: float = 0.0
    sum_dd: float = 0.0
    sum_dt: float = 0.0

    def observe(self, drafts: int, seconds: float) -> None:
        self.weight = FORGET * self.weight + 1.0
        self.sum_d = FORGET * self.sum_d + drafts
        self.sum_t = FORGET * self.sum_t + seconds
        self.sum_dd = FORGET * self.sum_dd + drafts * drafts
        self.sum_dt = FORGET * self.sum_dt + drafts * seconds

    @property
    def price(self) -> float:
        if self.weight < 4:
            return self.prior
        mean_d, mean_t = self.sum_d / self.weight, self.sum_t / self.weight
        spread = self.sum_dd / self.weight - mean_d * mean_d
        if spread < MIN_SPREAD:
            return self.prior
        per_draft = (self.sum_dt / self.weight - mean_d * mean_t) / spread
        base = mean_t - per_draft * mean_d
        if base <= 0 or not PRICE_LIMITS[0] <= per_draft / base <= PRICE_LIMITS[1]:
            return self.prior
        return per_draft / base


@dataclass
class AcceptanceRate:
    """A drafted token's chance of being accepted when every draft before it in the round was, from the rounds so
    far: accepted drafts over accepted drafts and rejections, where a round that kept fewer drafts than it ran ended
    in one rejection and a round that kept them all in none. That is the maximum-likelihood rate where acceptances
    are independent draws and a round's length cuts the draws short. Faded per round, as the calibration of the
    stop rule is; starts from `prior` (the policy's target acceptance) with the weight of `PRIOR_DRAFTS` drafts."""

    prior: float
    accepted: float = field(init=False)
    rejected: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted, self.rejected = self.prior * PRIOR_DRAFTS, (1.0 - self.prior) * PRIOR_DRAFTS

    def observe(self, accepted: int, drafted: int) -> None:
        self.accepted = ACCEPTANCE_FADE * self.accepted + accepted
        self.rejected = ACCEPTANCE_FADE * self.rejected + (accepted < drafted)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


PRIOR_DRAFTS = 2.0  # the prior weighs as much as two drafts: the first rounds decide
ACCEPTANCE_FADE = 0.9  # per round: the rate follows the last ten rounds or so


def committed_tokens(acceptance: float, drafts: int) -> float:
    """The tokens a round of `drafts` commits on average, its accepted drafts and the full model's next token, when
    each draft is accepted with probability `acceptance` once the ones before it were: 1 + a + ... + a^drafts."""
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


def best_draft_length(acceptance: float, round_cost: Callable[[int], float], most: int) -> int:
    """The drafts per round, 1 to `most` (0 when `most` is), that commit the most tokens per unit of cost, a round
    of k drafts costing `round_cost(k)` (Leviathan et al. 2023, section 3.4). Chosen before the round where reading
    a draft's confidence back would stall the device; at least one draft, since whether drafting pays at all is the
    guard's verdict (and the choice's, among skip sets)."""
    if most <= 0:
        return 0
    return max(range(1, most + 1), key=lambda drafts: committed_tokens(acceptance, drafts) / round_cost(drafts))
