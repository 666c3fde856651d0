"""Projections: a measured skip set's speedup predicted on other devices from their cost profiles (`--project-with`),
from the rounds decoding takes here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ..decode.cost_profile import CostProfile
from ..decode.loop import generate
from ..decode.policy import DraftPolicy
from ..decode.skipset import SkipSet
from ..decode.stats import DecodeStats


def decode_stats(model: torch.nn.Module, prompts: Iterable[list[int]], skip: SkipSet, policy: DraftPolicy,
                 max_new_tokens: int, eos_token_id: int | list[int] | None) -> DecodeStats:
    """The rounds that decoding `prompts` with `skip` takes: greedy and untimed (`generate`'s `timed`), so the same on
    any machine, busy or quiet; unguarded, since the guard's choices depend on this machine's timings."""
    total, policy = DecodeStats(), replace(policy, guard=False)
    for prompt in prompts:
        total.add(generate(model, prompt, skip=skip, max_new_tokens=max_new_tokens, policy=policy,
                           eos_token_id=eos_token_id, timed=False).stats)
    return total


def load_projections(paths: Sequence[str | Path], model: torch.nn.Module) -> list[tuple[str, CostProfile]]:
    """The profiles of `--project-with`, each labelled by its file and device, checked against `model`."""
    projections = []
    for path in paths:
        profile = CostProfile.load(path)
        try:
            profile.check_model(model)
        except ValueError as error:
            raise ValueError(f"--project-with {path}: {error}") from None
        projections.append((f"{path} [{profile.label()}]", profile))
    return projections


def projection_lines(projections: Sequence[tuple[str, CostProfile]],
                     measured: Sequence[tuple[str, SkipSet, DecodeStats]], max_draft_tokens: int) -> list[str]:
    """Predicted speedups over plain decoding of each measured skip set on each projected device, from untimed rounds
    (`decode_stats`), which no confidence read cut, verified as that device's steps pad them (`compiled_steps`)."""
    lines = []
    for label, profile in projections:
        lines.append(f"PREDICTION (cost model, not measured) on {label}:")
        for name, skip, stats in measured:
            if stats.acceptance_rate is None:  # nothing drafted (every prompt ended at once): nothing to price
                lines.append(f"  {name}: drafted nothing in this run, so no acceptance to predict from")
                continue
            speedup = profile.predict_speedup(skip, stats, max_draft_tokens=max_draft_tokens,
                                              compiled=profile.compiled_steps)
            lines.append(f"  {name}: predicted {speedup:.2f}x over plain decoding at this run's acceptance "
                         f"{stats.acceptance_rate:.2f}")
    return lines
