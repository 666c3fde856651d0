"""The search space: which sublayers a study may skip, and how a trial's parameters map to a skip set.

Every sublayer that may be skipped gets one parameter u in [0, 1], and is skipped when
u < `skip_prior`. A sampler drawing u uniformly therefore skips about `skip_prior` of the
sublayers (15% by default) instead of half of them, which small and mid-size models never
accept. `skip_prior=0.5` is the plain 2L-switch space of Draft & Verify.

With `head_rows`, one categorical parameter more picks the draft's LM head: the full head (0) or the top rows of the
study's vocabulary ranking (`ranking`, set once the study has ranked it; heads.py, vocabulary.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

from ..decode.skipset import DraftHead, SkipSet
from .vocabulary import VocabularyRanking

HEAD_PARAM = "head_rows"  # the trial parameter of the head's size: 0 for the full head


@dataclass(frozen=True)
class SearchSpace:
    num_layers: int
    keep_first_last: bool = True
    max_skip_fraction: float = 0.5
    skip_prior: float = 0.15
    head_rows: tuple[int, ...] = ()  # trimmed heads the study may draft with, beside the full head (empty: full only)
    # The study's ranking, which the heads' rows come from: made at run time, kept on the study apart (records.py).
    ranking: VocabularyRanking | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        rows = tuple(self.head_rows)
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"head sizes must be distinct whole numbers >= 1, got {list(rows)}")
        object.__setattr__(self, "head_rows", tuple(sorted(rows)))
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ValueError(f"max_skip_fraction must be in [0, 1], got {self.max_skip_fraction}")
        if not 0.0 < self.skip_prior < 1.0:
            raise ValueError(f"skip_prior must be in (0, 1), got {self.skip_prior}")
        if self.keep_first_last and self.num_layers < 3:
            raise ValueError("keep_first_last needs a model with at least 3 layers")

    def sublayers(self) -> list[tuple[str, int]]:
        first = 1 if self.keep_first_last else 0
        last = self.num_layers - 1 if self.keep_first_last else self.num_layers
        return [(kind, i) for i in range(first, last) for kind in ("attn", "mlp")]

    @staticmethod
    def param_name(kind: str, layer: int) -> str:
        return f"{kind}_{layer:03d}"

    @property
    def max_skipped(self) -> int:
        return math.floor(self.max_skip_fraction * 2 * self.num_layers)

    @property
    def size(self) -> int:
        """How many distinct skip sets the space holds (the empty set included), each head size counted."""
        n = len(self.sublayers())
        return sum(math.comb(n, k) for k in range(min(n, self.max_skipped) + 1)) * (1 + len(self.head_rows))

    def as_dict(self) -> dict[str, Any]:
        """What a study's label stores of the space: everything but the ranking, which the study keeps apart, and
        head sizes only where there are some (a space without is stored as releases before them stored it)."""
        return {name: list(value) if name == "head_rows" else value for name, value in asdict(self).items()
                if name != "ranking" and (name != "head_rows" or value)}

    @staticmethod
    def key(skip: SkipSet) -> tuple:
        """What tells two skip sets of a study apart, cheaply: sublayers and head size."""
        return skip.attn, skip.mlp, skip.head_rows

    def random_unevaluated(self, evaluated: set, rng: random.Random, draws: int = 1000) -> SkipSet | None:
        """A skip set drawn like a uniform sampler would (the prior included) whose `key` is not in `evaluated`."""
        for _ in range(draws):
            rows = rng.choice((0, *self.head_rows))
            skip = self.skip_set({sublayer: rng.random() for sublayer in self.sublayers()}, rows)
            if self.key(skip) not in evaluated:
                return skip
        return None

    def suggest(self, trial: optuna.Trial) -> SkipSet:
        names = [self.param_name(kind, i) for kind, i in self.sublayers()]
        params: dict[str, float] = {name: trial.suggest_float(name, 0.0, 1.0) for name in names}
        if self.head_rows:
            params[HEAD_PARAM] = trial.suggest_categorical(HEAD_PARAM, (0, *self.head_rows))
        return self.from_params(params)

    def skip_set(self, draws: dict[tuple[str, int], float], head_rows: int = 0) -> SkipSet:
        # Over the cap, keep the sublayers whose draws are furthest below the prior.
        chosen = sorted((u, kind, i) for (kind, i), u in draws.items() if u < self.skip_prior)[: self.max_skipped]
        return SkipSet.of([i for _, kind, i in chosen if kind == "attn"], [i for _, kind, i in chosen if kind == "mlp"],
                          self.num_layers, self.head(head_rows))

    def head(self, rows: int) -> DraftHead | None:
        """The draft head of `rows` rows of the study's ranking (None: the full head, for 0)."""
        if not rows:
            return None
        if rows not in self.head_rows or self.ranking is None:
            raise ValueError(f"a head of {rows} rows is not in this search space (head sizes: "
                             f"{list(self.head_rows) or 'none'}{'' if self.ranking else ', no ranking yet'})")
        return self.ranking.head(rows)

    def from_params(self, params: dict[str, float]) -> SkipSet:
        """The skip set that a trial's parameters, by name, draw (`params_for` is its inverse)."""
        return self.skip_set({(kind, i): params[self.param_name(kind, i)] for kind, i in self.sublayers()},
                             int(params.get(HEAD_PARAM, 0)))

    def params_for(self, skip: SkipSet, head_rows: int | None = None) -> dict[str, float]:
        """Parameters that make `suggest` return `skip` (for enqueued warm starts); `head_rows` names its head by size
        where the ranking is not made yet (None: `skip`'s own head)."""
        skipped = {("attn", i) for i in skip.attn} | {("mlp", i) for i in skip.mlp}
        params = {self.param_name(kind, i): 0.0 if (kind, i) in skipped else 1.0 for kind, i in self.sublayers()}
        if self.head_rows:
            params[HEAD_PARAM] = (skip.head_rows or 0) if head_rows is None else head_rows
        return params

    def warm_starts(self) -> list[SkipSet]:
        """No skip; the full model drafting through each trimmed head, largest first (nothing skipped: acceptance is
        the head's coverage); then structured sets that tend to be cheap to draft and often accepted."""
        return [SkipSet(skip.attn, skip.mlp, self.head(rows)) for skip, rows in self._warm_start_points()]

    def warm_start_params(self) -> list[dict[str, float]]:
        """The parameters of `warm_starts`, which need no ranking: a study queues them before it has made one."""
        return [self.params_for(skip, rows) for skip, rows in self._warm_start_points()]

    def _warm_start_points(self) -> list[tuple[SkipSet, int]]:
        """The warm starts as sublayer sets and head sizes (0: the full head)."""
        allowed = set(self.sublayers())
        n, half = self.num_layers, self.num_layers // 2

        def keep(kind: str, ids: Sequence[int]) -> list[int]:
            return [i for i in ids if (kind, i) in allowed]

        upper_attn = keep("attn", range(half, n, 2))
        # From sparse to dense: small models accept only a few skipped sublayers, large ones many.
        candidates = [
            (SkipSet(), 0),
            *((SkipSet(), rows) for rows in reversed(self.head_rows)),
            (SkipSet.of(keep("attn", range(n - 3, n - 1)), (), n), 0),
            (SkipSet.of(keep("attn", range(half, n, 4)), (), n), 0),
            (SkipSet.of(upper_attn, (), n), 0),
            (SkipSet.of(upper_attn, keep("mlp", range(half + 1, n, 4)), n), 0),
        ]
        unique = []
        for point in candidates:
            if point not in unique and point[0].size <= self.max_skipped:
                unique.append(point)
        return unique
