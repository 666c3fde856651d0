"""Paired speed measurement: a candidate and its baseline timed back to back, summarised with an interval.

Load and clock drift on a shared machine move absolute timings by more than the differences a
study ranks, so no figure here divides by a baseline measured at another time. Each pair is the
baseline and the candidate decoding the same prompt one right after the other, in alternating
order (so that neither always runs on a warmer or a colder machine), and a speedup is the
geometric mean of the per-pair ratios with a Student t interval on their logarithms.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from scipy import stats as scipy_stats

T = TypeVar("T")
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A ratio's point estimate (geometric mean) and its two-sided confidence interval."""

    estimate: float
    low: float
    high: float
    pairs: int

    def __str__(self) -> str:
        if self.pairs < 2:
            return f"{self.estimate:.2f}x (one paired run: no interval)"
        return f"{self.estimate:.2f}x (95% interval {self.low:.2f}-{self.high:.2f}, {self.pairs} paired runs)"


def ratio_interval(ratios: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Geometric mean of `ratios` with a t interval on the log scale (ratios multiply, their logs add)."""
    if not ratios or any(r <= 0 or not math.isfinite(r) for r in ratios):
        raise ValueError(f"ratios must be finite and > 0, got {list(ratios)!r}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        # One pair says nothing about its own spread: an unbounded interval, never a confident claim.
        return Interval(math.exp(mean), 0.0, math.inf, 1)
    half = scipy_stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


def paired_runs(
    baseline: Callable[[], T], candidate: Callable[[], T], repeats: int, first_index: int = 0,
    clock: Callable[[], float] | None = None,
) -> list[tuple[tuple[T, float], tuple[T, float]]]:
    """`repeats` pairs of ((baseline result, seconds), (candidate result, seconds)), timed back to back.

    The order alternates from pair to pair (and with `first_index`, from prompt to prompt), so that
    a machine warming up or slowing down during a pair favours each side equally often.
    `clock` defaults to `time.perf_counter`; the callables must synchronise any device work themselves.
    """
    import time

    clock = clock or time.perf_counter

    def timed(run: Callable[[], T]) -> tuple[T, float]:
        start = clock()
        result = run()
        return result, clock() - start

    pairs = []
    for r in range(repeats):
        if (first_index + r) % 2 == 0:
            base = timed(baseline)
            cand = timed(candidate)
        else:
            cand = timed(candidate)
            base = timed(baseline)
        pairs.append((base, cand))
    return pairs
