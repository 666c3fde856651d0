"""A study's draft heads: the vocabulary ranking it makes once, from its own reference decoding, and keeps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import optuna

from . import records
from .evaluation import Evaluator
from .space import SearchSpace
from .vocabulary import rank_vocabulary


def with_ranking(study: optuna.Study, space: SearchSpace, evaluator: Evaluator, special_token_ids: Sequence[int]
                 ) -> SearchSpace:
    """The space with the study's vocabulary ranking, where it tries trimmed heads: the one the study keeps (a
    resumed study, a second worker: every trial of a study reads the same rows), else one made from the plain
    reference decoding of the calibration prompts (vocabulary.py), then kept."""
    if not space.head_rows:
        return space
    ranking = records.read_vocabulary(study)
    if ranking is None:
        ranking = rank_vocabulary(evaluator.model, evaluator.prompts, evaluator.reference_tokens(),
                                  first=special_token_ids, keep=max(space.head_rows))
        records.write_vocabulary(study, ranking)
    if len(ranking.ids) < max(space.head_rows):
        raise ValueError(f"study {study.study_name!r} ranked {len(ranking.ids)} tokens, fewer than the largest head "
                         f"asked for ({max(space.head_rows)}): use a new --study-name")
    return replace(space, ranking=ranking)
