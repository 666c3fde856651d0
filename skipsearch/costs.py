"""A device cost model: profile what drafting and verifying cost, and predict a skip set's speedup.

Costs are measured, not assumed: one-token forwards at a fixed context length with all
attention skipped and with all MLPs skipped, subtracted from the full forward, give the
marginal time of one attention and one MLP sublayer; the rest of the full forward
(embeddings, final norm, lm_head, dispatch) is what remains. A draft's cost is thus the full
forward less what it skips, exact for the empty set and closest for the sparse sets that
matter. Verifying n tokens is timed directly for each n. A profile
is JSON, so a study on one machine can be scored with another machine's costs.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import write_atomic
from .decoding import DecodeStats, synchronize
from .kvcache import SpeculativeCache
from .skipping import SkipSet, draft_mode

PROFILE_FORMAT = "skipsearch/cost-profile"


@dataclass(frozen=True)
class CostProfile:
    device: str
    dtype: str
    architecture: str
    num_hidden_layers: int
    context_tokens: int
    attn_s: float  # one attention sublayer, one token
    mlp_s: float  # one MLP sublayer, one token
    rest_s: float  # the full forward less all sublayers: embeddings, final norm, lm_head, overhead
    verify_s: list[float]  # verify_s[n - 1]: one full forward of n tokens

    @property
    def forward_s(self) -> float:
        return self.verify_s[0]

    def draft_s(self, skip: SkipSet) -> float:
        """Predicted time of one draft forward with `skip` skipped."""
        kept_attn = self.num_hidden_layers - len(skip.attn)
        kept_mlp = self.num_hidden_layers - len(skip.mlp)
        return self.rest_s + kept_attn * self.attn_s + kept_mlp * self.mlp_s

    def verify_time(self, n_tokens: float) -> float:
        """Time to verify `n_tokens` (interpolated between profiled sizes, extrapolated past the last)."""
        if n_tokens <= 1:
            return self.verify_s[0]
        low = min(int(n_tokens), len(self.verify_s))
        if low == len(self.verify_s):
            slope = self.verify_s[-1] - self.verify_s[-2] if len(self.verify_s) > 1 else 0.0
            return self.verify_s[-1] + slope * (n_tokens - low)
        frac = n_tokens - low
        return self.verify_s[low - 1] * (1 - frac) + self.verify_s[low] * frac

    def predict_speedup(self, skip: SkipSet, stats: DecodeStats) -> float:
        """Plain-decoding time over self-speculative time for the decoding that `stats` describes.

        Each drafted token costs one draft forward; each round costs one verification of the
        size it had (`stats.verify_sizes`); plain decoding spends one forward per token.
        """
        if stats.rounds == 0 or not skip.size:
            return 1.0
        verifying = sum(count * self.verify_time(size) for size, count in stats.verify_sizes.items())
        speculative = stats.drafted * self.draft_s(skip) + verifying
        # The first token comes from the prefill in both, so neither side counts it.
        return (stats.new_tokens - 1) * self.forward_s / speculative

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps({"format": PROFILE_FORMAT, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"cost profile {str(path)!r} does not exist") from None
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read cost profile {str(path)!r}: {error}") from None
        if not isinstance(data, dict) or data.pop("format", None) != PROFILE_FORMAT:
            raise ValueError(f"{path}: not a skipsearch cost profile (expected \"format\": \"{PROFILE_FORMAT}\")")
        try:
            return cls(**data)
        except TypeError as error:
            raise ValueError(f"{path}: malformed cost profile ({error})") from None

    def check_model(self, model: torch.nn.Module) -> None:
        if (self.architecture, self.num_hidden_layers) != (type(model).__name__, model.config.num_hidden_layers):
            raise ValueError(
                f"cost profile is for {self.architecture} with {self.num_hidden_layers} layers, not "
                f"{type(model).__name__} with {model.config.num_hidden_layers}"
            )


@torch.inference_mode()
def profile_costs(
    model: torch.nn.Module, context_tokens: int = 128, max_verify_tokens: int = 9, repeats: int = 20
) -> CostProfile:
    """Time the pieces of a forward on the model's device and dtype (median of `repeats` runs)."""
    device = model.device
    num_layers = model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (1, context_tokens + max_verify_tokens), generator=generator)
    context = context.to(device)
    cache = SpeculativeCache(model.config, context.shape[1], device)
    model(input_ids=context[:, :context_tokens], past_key_values=cache, use_cache=True, logits_to_keep=1)
    positions = torch.arange(context.shape[1], device=device).view(1, -1)

    def timed(n_tokens: int, skip: SkipSet | None) -> float:
        ids = context[:, context_tokens : context_tokens + n_tokens]
        times = []
        for _ in range(repeats + 2):  # two warm-ups
            cache.seek(context_tokens)
            synchronize(device)
            start = time.perf_counter()
            if skip is None:
                model(input_ids=ids, position_ids=positions[:, context_tokens : context_tokens + n_tokens],
                      past_key_values=cache, use_cache=True, logits_to_keep=0)
            else:
                with draft_mode(model, skip):
                    model(input_ids=ids, position_ids=positions[:, context_tokens : context_tokens + 1],
                          past_key_values=cache, use_cache=True, logits_to_keep=1)
            synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    every = range(num_layers)
    verify = [timed(n, None) for n in range(1, max_verify_tokens + 1)]
    # The full one-token forward, timed inside draft mode like the others so the mode switch cancels out.
    full = timed(1, SkipSet())
    no_attn = timed(1, SkipSet.of(every, (), num_layers))
    no_mlp = timed(1, SkipSet.of((), every, num_layers))
    attn_s, mlp_s = max(0.0, full - no_attn) / num_layers, max(0.0, full - no_mlp) / num_layers
    return CostProfile(
        device=str(device), dtype=str(model.dtype).removeprefix("torch."), architecture=type(model).__name__,
        num_hidden_layers=num_layers, context_tokens=context_tokens, attn_s=attn_s, mlp_s=mlp_s,
        rest_s=max(0.0, full - num_layers * (attn_s + mlp_s)), verify_s=verify,
    )
