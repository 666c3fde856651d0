"""What decoding pays besides forwards (`Overheads`): the confidence read, timed directly; per round and per drafted
token, residuals of real decoding runs over a profile's forwards."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import torch

from ..decode.cost_profile import CostProfile, Overheads
from ..decode.engine import engine_for
from ..decode.loop import generate
from ..decode.policy import DraftPolicy
from ..decode.skipset import SkipSet
from ..decode.stats import DecodeStats
from ..decode.steps import synchronize


def calibrated(model: torch.nn.Module, profile: CostProfile, repeats: int, compile_mode: str | None,
                clock: Callable[[], float], show_progress: bool = False) -> tuple[Overheads, list[str]]:
    """What a round pays besides its forwards: the confidence read, timed directly; the rest, residuals of real
    decoding runs over the profiled forwards (`_overheads`), with what was clipped. A drafting round runs the draft
    path's view of the model (skipping.py's `draft_model`), made once per skip set: nothing is switched per round, and
    what the view costs besides its forwards is in the residuals."""
    timed = replace(profile, overheads=Overheads(adaptive_token_s=_confidence_read_s(model, clock)))
    decodes = _decoding_runs(model, timed, max(1, min(repeats, 5)), compile_mode, show_progress)
    return _overheads(timed, decodes, model, compiled=compile_mode is not None)


def _confidence_read_s(model: torch.nn.Module, clock: Callable[[], float], runs: int = 200) -> float:
    """What the cut inside a round pays per draft besides the draft: its confidence (a softmax over the vocabulary)
    read back to the host. Timed directly: a residual of two decodings' times would be a small difference of noise."""
    logits = torch.zeros((1, model.config.vocab_size), device=model.device, dtype=model.dtype)
    times = []
    for _ in range(runs):
        synchronize(model.device)
        start = clock()
        float(torch.softmax(logits.float(), -1).max())
        times.append(clock() - start)
    return statistics.median(times)


def _decode_seconds(stats: DecodeStats) -> float:
    return stats.wall_time_s - stats.prefill_time_s


_NEW_TOKENS, _DRAFT_TOKENS = 16, 4


NOISE_SLACK = 0.1  # a residual overhead less than this share of a forward below zero is noise, stored as 0 unreported


def _calibration(model: torch.nn.Module, profile: CostProfile) -> tuple[list[int], SkipSet, DraftPolicy]:
    """The prompt (at the shortest profiled context), skip set and policy that the overheads are measured with."""
    num_layers = model.config.num_hidden_layers
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    context = max(1, min(profile.context_lengths[0], limit - _NEW_TOKENS - _DRAFT_TOKENS - 1))
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    skip = SkipSet.of(range(1, num_layers - 1, 2), (), num_layers)  # any set will do: drafting's cost is profiled
    # Fixed rounds, the guard off: the overheads are those of the rounds themselves.
    return prompt, skip, DraftPolicy(max_draft_tokens=_DRAFT_TOKENS, adaptive=False, guard=False)


def _decoding_runs(model: torch.nn.Module, profile: CostProfile, repeats: int, compile_mode: str | None = None,
                   show_progress: bool = False) -> list[tuple[DecodeStats, DecodeStats]]:
    """`repeats` pairs of real decoding runs: plain, and fixed drafting (after a pair to warm up)."""
    from tqdm.auto import tqdm

    prompt, skip, fixed = _calibration(model, profile)
    if compile_mode is not None:
        # Compiled runs decode on the engine's cache, which the profile's longest context grew; a step's cost follows
        # the cache's slots, not the position, and these runs' forwards are priced at the shortest context: so the
        # cache is made again at the runs' own length.
        with engine_for(model).exclusive() as engine:
            engine.release_cache()

    def run(skip_set: SkipSet | None) -> DecodeStats:
        return generate(model, prompt, skip=skip_set, max_new_tokens=_NEW_TOKENS, policy=fixed,
                        compile=compile_mode is not None, compile_mode=compile_mode).stats

    pairs = tqdm(range(repeats + 1), desc="decoding, for what a round costs besides forwards", unit="pair",
                 disable=not show_progress)
    decodes = [(run(None), run(skip)) for _ in pairs]
    return decodes[1:]  # the first warmed up


def _overheads(profile: CostProfile, decodes: list[tuple[DecodeStats, DecodeStats]], model: torch.nn.Module,
               compiled: bool = False) -> tuple[Overheads, list[str]]:
    """What the real decoder pays besides the profiled forwards (residuals of `decodes` over them, at the shortest
    profiled context): plain decoding gives the per-round cost, fixed drafting the per-drafted-token cost. A residual
    below zero cannot be a cost: it is clipped to 0, and said (the second value) where beyond noise."""
    _, skip, policy = _calibration(model, profile)

    def verification(n_tokens: int, at: int) -> float:
        """As the runs verified (they decode without a profile): a plain step or, eager, the tokens alone; compiled,
        padded to the widest round's width."""
        if compiled:
            return profile.verify_time(n_tokens, at, widest=policy.max_draft_tokens + 1, compiled=True)
        return profile.verify_measured(n_tokens, at)

    def forwards(stats: DecodeStats, skip_set: SkipSet) -> float:
        """The profiled forwards of the rounds in `stats` (and an older profile's switches: cost_profile.py)."""
        total = 0.0
        for (n_tokens, at), count in stats.verify_contexts.items():
            total += count * (verification(n_tokens, at) + (n_tokens - 1) * profile.draft_s(skip_set, at)
                              + (profile.switch_time(skip_set) if n_tokens > 1 else 0.0))
        return total

    round_s, token_s = [], []
    for plain, drafted in decodes:
        round_s.append((_decode_seconds(plain) - forwards(plain, SkipSet())) / plain.rounds)
        if drafted.drafted:
            token_s.append((_decode_seconds(drafted) - forwards(drafted, skip) - drafted.rounds * round_s[-1])
                           / drafted.drafted)
    context = profile.context_lengths[0]
    scales = {"per round": profile.forward_at(context), "per drafted token": profile.draft_s(skip, context)}
    figures, clipped = [], []
    for (name, scale), values in zip(scales.items(), (round_s, token_s)):
        value = statistics.median(values) if values else 0.0
        if value < -NOISE_SLACK * scale:
            clipped.append(f"a negative decoding overhead {name} ({value * 1e3:.3f} ms), clipped to 0")
        figures.append(max(0.0, value))
    return replace(profile.overheads, round_s=figures[0], draft_token_s=figures[1]), clipped
