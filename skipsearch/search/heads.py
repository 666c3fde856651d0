"""A study's draft heads: the vocabulary ranking it makes once, from prompts beside its calibration prompts, and
keeps; a stop signal while it is made ends the study before its trials (`ranked_space`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import optuna

from ..decode.loop import generate
from . import records
from .evaluation import Evaluator
from .space import SearchSpace
from .vocabulary import rank_vocabulary
from .worker import Interrupted, StopRequest, stop_on_signals


def with_ranking(study: optuna.Study, space: SearchSpace, evaluator: Evaluator, special_token_ids: Sequence[int],
                 prompts: Sequence[Sequence[int]] = ()) -> SearchSpace:
    """The space with the study's vocabulary ranking, where it tries trimmed heads: the one the study keeps (a
    resumed study, a second worker: every trial of a study reads the same rows), else one made from `prompts` and
    their plain greedy continuations (vocabulary.py), then kept; without `prompts`, from the calibration prompts and
    their reference decoding."""
    if not space.head_rows:
        return space
    ranking = records.read_vocabulary(study)
    if ranking is None:
        prompts, continuations = _decoded(evaluator, prompts)
        made = rank_vocabulary(evaluator.model, prompts, continuations, first=special_token_ids,
                               keep=max(space.head_rows))
        # A worker started beside this one may have stored its ranking while this one ranked: the study keeps the
        # first, and this worker drafts with the stored rows, which later reads of its trials rebuild.
        if records.read_vocabulary(study) is None:
            records.write_vocabulary(study, made)
        ranking = records.read_vocabulary(study)
    if len(ranking.ids) < max(space.head_rows):
        raise ValueError(f"study {study.study_name!r} ranked {len(ranking.ids)} tokens, fewer than the largest head "
                         f"asked for ({max(space.head_rows)}): use a new --study-name")
    return replace(space, ranking=ranking)


def _decoded(evaluator: Evaluator, prompts: Sequence[Sequence[int]]
             ) -> tuple[Sequence[Sequence[int]], list[list[int]]]:
    """The prompts to rank on and their plain greedy continuations, as long as the trials' (untimed)."""
    if not prompts:
        return evaluator.prompts, evaluator.reference_tokens()
    from tqdm.auto import tqdm

    decoded = tqdm(prompts, desc="ranking the vocabulary: plain decoding", unit="prompt", leave=False,
                   disable=not evaluator.show_progress)
    return prompts, [generate(evaluator.model, list(p), max_new_tokens=evaluator.max_new_tokens,
                              eos_token_id=evaluator.eos_token_id).tokens for p in decoded]


def ranked_space(study: optuna.Study, space: SearchSpace, evaluator: Evaluator, special_token_ids: Sequence[int],
                 ranking_prompts: Sequence[Sequence[int]], stop: StopRequest) -> SearchSpace:
    """`with_ranking` (a first run decodes every ranking prompt) under the stop signals: a first one lets the ranking
    finish and the study stop before its trials, a second abandons it; either way the caller still exports."""
    with stop_on_signals(stop):
        stop.running = "vocabulary ranking"
        try:
            return with_ranking(study, space, evaluator, special_token_ids, ranking_prompts)
        except Interrupted:
            return space
        finally:
            stop.running = StopRequest.running
