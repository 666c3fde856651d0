"""A device's cost profile: what drafting and verifying cost at several context lengths, and the speedup it predicts
for a skip set from the rounds decoding took. A plain data type, apart from the profiler that fills it
(costs/profiler.py), so that the decode loop, studies and reports read it without the profiler. Predictions
interpolate every cost at each round's context length. A profile is JSON, so a study on one machine can be scored
with another machine's costs.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..io.files import read_json, write_atomic

if TYPE_CHECKING:  # the types it prices: a plain value needs neither torch nor the decode loop
    import torch

    from .skipset import SkipSet
    from .stats import DecodeStats


PROFILE_FORMAT = "skipsearch/cost-profile"

# Profiles measured on GPUs, shipped so that any machine can price decoding there: <device>/<shape>.json, random
# weights from benchmarks/configs/<shape>.json, their provenance inside (BENCHMARKS.md, "Twenty-first session").
SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def model_shape(model: torch.nn.Module) -> tuple[str, int, int, int]:
    """What a profile must match: the model's class, its layers, its vocabulary and its hidden size (each of the last
    two 0 where its config has none)."""
    config = model.config
    return (type(model).__name__, config.num_hidden_layers, getattr(config, "vocab_size", 0) or 0,
            getattr(config, "hidden_size", 0) or 0)


def shipped_profiles() -> list[str]:
    """The names of the shipped profiles, `<device>/<shape>` (e.g. "nvidia-h200/llama-3-8b"): `CostProfile.load`
    and every `--cost-profile` or `--project-with` take one in place of a file."""
    return sorted(f"{path.parent.name}/{path.stem}" for path in SHIPPED_PROFILES.glob("*/*.json"))


# 5 added the hidden size (checked against the model's where known); 4 the LM head's cost and the vocabulary (a
# trimmed draft head is priced by its rows); 3 each layer's sublayer shares; 2 (no shares) reads as all alike, 3 as a
# head that trimming does not make cheaper, 4 and before as a hidden size unknown (not checked)
PROFILE_VERSION = 5


@dataclass(frozen=True)
class ContextCosts:
    """Forward costs with `context_tokens` already in the KV cache."""

    context_tokens: int
    attn_s: float  # one attention sublayer, one token
    mlp_s: float  # one MLP sublayer, one token
    rest_s: float  # the full forward less all sublayers: embeddings, final norm, lm_head, overhead
    verify_s: list[float]  # verify_s[n - 1]: one full forward of n tokens
    head_s: float = 0.0  # the full LM head's share of rest_s, one token (0: not measured, trimming priced as free)

    def __post_init__(self) -> None:
        """A ValueError naming the field where a cost is not one: a context length that is not positive, no
        verification, a cost that is negative or not finite (a verification's must be above 0)."""
        where = f"context {self.context_tokens!r}"
        if not self.context_tokens > 0:
            raise ValueError(f"{where}: context_tokens must be a positive number of tokens")
        if not self.verify_s:
            raise ValueError(f"{where}: verify_s is empty (it needs one cost a width, from one token)")
        for name in ("attn_s", "mlp_s", "rest_s", "head_s"):
            check_cost(f"{where}: {name}", getattr(self, name))
        for index, cost in enumerate(self.verify_s):
            check_cost(f"{where}: verify_s[{index}]", cost, above_zero=True)

    def verify_time(self, n_tokens: float, widest: int | None = None, compiled: bool = False) -> float:
        """Time to verify `n_tokens` as the decode loop runs it. One token is a plain step, never padded (verify_s[0]);
        more are padded: compiled, to `widest` itself (max_draft_tokens + 1, the one width its verify step takes);
        eager, to the cheapest measured width from n_tokens up to `widest` (None: any measured width), as the loop
        pads with a profile (`DraftController.width`). Interpolated between whole widths, extrapolated past the last."""
        if n_tokens <= 1:
            return self.verify_s[0]
        if compiled and widest is not None:
            n_tokens = max(n_tokens, widest)
        points = [self.verify_s[0], *self.envelope(widest)[1:]]
        low = min(int(n_tokens), len(points))
        if low == len(points):
            slope = points[-1] - points[-2] if len(points) > 1 else 0.0
            return points[-1] + max(0.0, slope) * (n_tokens - low)
        frac = n_tokens - low
        return points[low - 1] * (1 - frac) + points[low] * frac

    def envelope(self, widest: int | None = None) -> list[float]:
        """envelope[n - 1]: the cheapest measured verification of n tokens or more, up to `widest` tokens (None: every
        measured width); non-decreasing in n."""
        cheapest, out = float("inf"), []
        for cost in reversed(self.verify_s[:widest]):
            cheapest = min(cheapest, cost)
            out.append(cheapest)
        return out[::-1]


def check_cost(name: str, value: float, above_zero: bool = False, what: str = "cost") -> None:
    """A ValueError naming `name` unless `value` is finite and at least 0 (above 0 with `above_zero`)."""
    if not math.isfinite(value) or value < 0 or (above_zero and value == 0):
        raise ValueError(f"{name} is {value!r}, not a finite {what} {'above' if above_zero else 'at least'} 0")


@dataclass(frozen=True)
class Overheads:
    """What decoding pays besides forwards, in seconds (zero in profiles that did not measure it).

    `round_s` and `draft_token_s` are residuals of the real decoder's wall time over the profiled forwards, so they
    also absorb any difference between forwards in the loop and forwards timed alone; one below zero is clipped to 0
    (profiles of older versions may hold negatives). `adaptive_token_s` is the confidence read, timed directly.
    """

    round_s: float = 0.0  # every round, plain or speculative: cache roll-back, host transfer, bookkeeping
    # Profiles made before 2026-11-28 timed a switch into draft mode per drafting round (and this per skipped sublayer)
    # and took it out of their residuals; decoding runs the draft path's views and switches nothing, so newer profiles
    # hold 0. Kept so that an older profile predicts as it was calibrated.
    switch_s: float = 0.0
    switch_sublayer_s: float = 0.0
    draft_token_s: float = 0.0  # per drafted token besides its forward: picking it, loop bookkeeping
    adaptive_token_s: float = 0.0  # per drafted token cut by confidence (a CPU's adaptive rounds): the softmax, its read

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():  # below zero is an older profile's residual; NaN or inf none
            if not math.isfinite(value):
                raise ValueError(f"overheads: {name} is {value!r}, not a finite number of seconds")


@dataclass(frozen=True)
class CostProfile:
    device: str
    dtype: str
    architecture: str
    num_hidden_layers: int
    contexts: tuple[ContextCosts, ...]  # sorted by context length
    overheads: Overheads = Overheads()
    provenance: dict = field(default_factory=dict)  # date, device name, versions, how the model was built
    # Each layer's attention and feed-forward block relative to the mean of its kind (whose cost `contexts` hold):
    # the weights a token reads in it (`economics.sublayer_weights`: a routed block by the experts it reads), so that
    # a model of dense and routed layers prices each right. Empty (profiles of older versions): all alike.
    attn_shares: tuple[float, ...] = ()
    mlp_shares: tuple[float, ...] = ()
    vocab_size: int = 0  # the LM head's rows, which `head_s` reads (0: not measured)
    hidden_size: int = 0  # checked against a model's where known (0: unknown, as before version 5)

    def __post_init__(self) -> None:
        """Contexts sorted; a ValueError naming the field where the profile's figures cannot price anything
        (`ContextCosts` and `Overheads` check their own)."""
        if not self.contexts:
            raise ValueError("a cost profile needs at least one context length")
        object.__setattr__(self, "contexts", tuple(sorted(self.contexts, key=lambda c: c.context_tokens)))
        lengths = self.context_lengths
        repeated = sorted({length for length in lengths if lengths.count(length) > 1})
        if repeated:
            raise ValueError(f"contexts: context_tokens {', '.join(map(str, repeated))} "
                             f"{'appears' if len(repeated) == 1 else 'appear'} more than once (each context length "
                             "is profiled once)")
        for name in ("attn_shares", "mlp_shares"):
            shares = tuple(getattr(self, name))
            if shares and len(shares) != self.num_hidden_layers:
                raise ValueError(f"{name} has {len(shares)} entries for {self.num_hidden_layers} layers")
            for layer, share in enumerate(shares):
                check_cost(f"{name}[{layer}]", share, what="share")
            object.__setattr__(self, name, shares)

    @property
    def context_lengths(self) -> list[int]:
        return [c.context_tokens for c in self.contexts]

    @property
    def forward_s(self) -> float:
        """One full one-token forward at the shortest profiled context."""
        return self.contexts[0].verify_s[0]

    def _at(self, context: float, cost: Callable[[ContextCosts], float]) -> float:
        """`cost` at `context` tokens: linear between profiled lengths, the nearest segment's slope beyond them."""
        lengths = self.context_lengths
        if len(lengths) == 1:
            return cost(self.contexts[0])
        i = min(max(bisect.bisect_right(lengths, context), 1), len(lengths) - 1)
        low, high = self.contexts[i - 1], self.contexts[i]
        frac = (context - low.context_tokens) / (high.context_tokens - low.context_tokens)
        return max(0.0, cost(low) + frac * (cost(high) - cost(low)))

    def attn_at(self, context: float) -> float:
        return self._at(context, lambda c: c.attn_s)

    def forward_at(self, context: float) -> float:
        return self._at(context, lambda c: c.verify_s[0])

    def draft_s(self, skip: SkipSet, context: float | None = None) -> float:
        """Predicted time of one draft forward with `skip` skipped (at the shortest profiled context by default)."""
        context = self.context_lengths[0] if context is None else context
        kept_attn, kept_mlp = self._kept(self.attn_shares, skip.attn), self._kept(self.mlp_shares, skip.mlp)
        trimmed = 1 - skip.head.rows / self.vocab_size if skip.head is not None and self.vocab_size else 0.0
        return self._at(context, lambda c: c.rest_s - trimmed * c.head_s + kept_attn * c.attn_s + kept_mlp * c.mlp_s)

    def _kept(self, shares: tuple[float, ...], skipped: tuple[int, ...]) -> float:
        """The sublayers of one kind a draft still runs, each counted by its share (1 each without shares)."""
        if not shares:
            return self.num_hidden_layers - len(skipped)
        return sum(shares) - sum(shares[i] for i in skipped)

    def verify_time(self, n_tokens: float, context: float | None = None, *, widest: int | None = None,
                    compiled: bool = False) -> float:
        """Time to verify `n_tokens` with `context` tokens cached (the shortest profiled context by default), padded
        as the loop pads within `widest` tokens, `compiled` or not (`ContextCosts.verify_time`)."""
        context = self.context_lengths[0] if context is None else context
        return self._at(context, lambda c: c.verify_time(n_tokens, widest, compiled))

    def verify_measured(self, n_tokens: int, context: float | None = None) -> float:
        """A verification of exactly `n_tokens` as measured, out of order where widths step (`verify_time` prices it
        padded); past the measured widths, `verify_time`'s extrapolation."""
        context = self.context_lengths[0] if context is None else context
        return self._at(context, lambda c: c.verify_s[n_tokens - 1] if n_tokens <= len(c.verify_s)
                        else c.verify_time(n_tokens))

    def switch_time(self, skip: SkipSet) -> float:
        return self.overheads.switch_s + self.overheads.switch_sublayer_s * skip.size

    def predict_speedup(self, skip: SkipSet, stats: DecodeStats, adaptive: bool = False, *,
                        max_draft_tokens: int | None = None, compiled: bool = False) -> float:
        """Plain-decoding time over self-speculative time for the decoding that `stats` describes.

        Each round drafts (verified tokens - 1) tokens at its context length, then verifies them at the width the
        loop runs (`verify_time`): a round of one token is a plain step; others are padded, `compiled` to
        `max_draft_tokens` + 1 (without it, the stats' widest round), eager to the cheapest measured width up to
        `max_draft_tokens` + 1 (without it, any measured width). Plain decoding spends one forward and one round per
        committed token, at the contexts those tokens had. `adaptive`: the drafts paid adaptive drafting's
        confidence check.
        """
        if stats.rounds == 0 or not skip.drafts:
            return 1.0
        rounds = stats.verify_contexts or {(n, self.context_lengths[0]): m for n, m in stats.verify_sizes.items()}
        widest = (max_draft_tokens + 1 if max_draft_tokens is not None
                  else max(n for n, _ in rounds) if compiled else None)
        o = self.overheads
        per_draft = o.draft_token_s + (o.adaptive_token_s if adaptive else 0.0)
        # Committed tokens per round (accepted + 1); the first token comes from the prefill in both.
        committed = (stats.accepted + stats.rounds) / stats.rounds
        speculative = plain = 0.0
        for (n_tokens, context), count in rounds.items():
            drafts = n_tokens - 1
            speculative += count * (drafts * (self.draft_s(skip, context) + per_draft)
                                    + self.verify_time(n_tokens, context, widest=widest, compiled=compiled)
                                    + o.round_s
                                    + (self.switch_time(skip) if drafts else 0.0))
            plain += count * committed * (self.forward_at(context + (committed - 1) / 2) + o.round_s)
        return plain / speculative

    def to_dict(self) -> dict:
        """The JSON form: version 2's where the profile has no sublayer shares (read from a version-2 file), version
        3's where it has no head cost, version 4's where it has no hidden size, so that a stored profile is written
        back as it was; version 5 with all."""
        data = {**asdict(self), "contexts": [asdict(c) for c in self.contexts]}
        if self.hidden_size:
            return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **data}
        del data["hidden_size"]
        if not self.vocab_size:
            del data["vocab_size"]
            for context in data["contexts"]:
                del context["head_s"]
            if self.attn_shares or self.mlp_shares:
                return {"format": PROFILE_FORMAT, "version": 3, **data}
        if not self.attn_shares and not self.mlp_shares:
            del data["attn_shares"], data["mlp_shares"]
            return {"format": PROFILE_FORMAT, "version": 2, **data}
        return {"format": PROFILE_FORMAT, "version": 4, **data}

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile:
        """A profile from its JSON form; a version-1 (single context, no overheads) or version-2 (no sublayer shares)
        profile is read as is."""
        data = dict(data)
        data.pop("format", None)
        version = data.pop("version", 1)
        if version == 1:
            single = {k: data.pop(k) for k in ("context_tokens", "attn_s", "mlp_s", "rest_s", "verify_s")}
            return cls(**data, contexts=(ContextCosts(**single),))
        if version not in (2, 3, 4, PROFILE_VERSION):
            raise ValueError(f"cost profile version {version} is newer than this skipsearch reads ({PROFILE_VERSION})")
        contexts = tuple(ContextCosts(**c) for c in data.pop("contexts"))
        overheads = Overheads(**data.pop("overheads", {}))
        return cls(**data, contexts=contexts, overheads=overheads)

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """A profile from its file, or from a shipped profile's name (`shipped_profiles`) where no such file exists."""
        if not Path(path).exists():
            if str(path) not in shipped_profiles():
                raise ValueError(f"cost profile {str(path)!r} does not exist (shipped profiles: "
                                 f"{', '.join(shipped_profiles())})")
            path = SHIPPED_PROFILES / f"{path}.json"
        data = read_json(path, "cost profile")
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path}: not a skipsearch cost profile (expected \"format\": \"{PROFILE_FORMAT}\")")
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{path}: malformed cost profile ({error})") from None
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    def check_model(self, model: torch.nn.Module) -> None:
        """A ValueError where `model` is not of this profile's shape (architecture, layers, and the vocabulary and
        hidden size where the profile has them), naming the shipped profiles of the model's shape."""
        architecture, layers, vocab, hidden = shape = model_shape(model)
        if self.fits(*shape):
            return
        width = f", hidden size {self.hidden_size:,}" if self.hidden_size else ""
        tokens = f" and {self.vocab_size:,} tokens" if self.vocab_size else ""
        matching = ", ".join(name for name in shipped_profiles() if CostProfile.load(name).fits(*shape))
        theirs = f", hidden size {hidden:,}" if width else ""
        raise ValueError(f"cost profile is for {self.architecture} with {self.num_hidden_layers} layers{width}"
                         f"{tokens}, not {architecture} with {layers} layers{theirs} and {vocab:,} tokens"
                         + (f" (shipped profiles of its shape: {matching})" if matching else ""))

    def fits(self, architecture: str, layers: int, vocab: int, hidden: int = 0) -> bool:
        """Whether the profile prices a model of this shape; a vocabulary or hidden size unknown on either side (a
        profile before version 4, or 5, a config without one) is not compared."""
        same_vocabulary = not self.vocab_size or not vocab or self.vocab_size == vocab
        same_width = not self.hidden_size or not hidden or self.hidden_size == hidden
        return (self.architecture, self.num_hidden_layers) == (architecture, layers) and same_vocabulary and same_width

    @property
    def compiled_steps(self) -> bool:
        """Whether the profile timed compiled steps, and so whether decoding priced on its device pads verification as
        they do: its provenance's `steps` (what `profile` ran), else whether it is CUDA's (where the profiler times the
        steps decoding runs: regional, as CUDA graphs)."""
        steps = self.provenance.get("steps")
        return self.device.startswith("cuda") if steps is None else steps != "eager"

    def label(self) -> str:
        """The device and dtype, and the overheads the profile lacks, for whoever reads a prediction made with it."""
        name = self.provenance.get("device_name")
        unmeasured = ", ".join(self.provenance.get("unmeasured", ()))
        return (f"{self.device}{f' ({name})' if name else ''}, {self.dtype}"
                + (f"; not measured, priced at 0: {unmeasured}" if unmeasured else ""))
