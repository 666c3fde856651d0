"""Long silent phases show a progress bar on stderr, and none when it is turned off."""

import pytest

from conftest import VirtualTimer, tiny_model
from skipsearch.costs.profiler import profile_costs
from skipsearch.decode.policy import DraftPolicy
from skipsearch.search.study import Evaluator


@pytest.mark.parametrize("enabled", [True, False])
def test_profile_costs_progress(capsys, enabled):
    model = tiny_model()
    profile_costs(model, contexts=(4, 8), max_verify_tokens=2, repeats=1, calibrate=False, show_progress=enabled,
                  clock=VirtualTimer(model))
    err = capsys.readouterr().err
    assert ("profiling contexts" in err and "/2 " in err) if enabled else err == ""


@pytest.mark.parametrize("enabled", [True, False])
def test_reference_decoding_progress(capsys, enabled):
    evaluator = Evaluator(model=tiny_model(), prompts=[[5, 9], [7, 3]], max_new_tokens=3,
                          policy=DraftPolicy(max_draft_tokens=2), eos_token_id=None, show_progress=enabled)
    evaluator.reference_tokens()
    err = capsys.readouterr().err
    assert ("reference: plain decoding" in err and "/2 " in err) if enabled else err == ""


def test_the_study_bar_is_redrawn_when_a_set_is_measured_not_per_repeated_proposal(capsys, monkeypatch):
    from skipsearch.search import worker

    # Distinct sets the study holds, as the bar reads them: at the start, then after each of four trials, two of
    # which repeat a proposal (and a third fails), measuring nothing new.
    counts = iter([1, 1, 1, 2, 2])
    monkeypatch.setattr(worker, "distinct_trials", lambda study: [None] * next(counts))
    monkeypatch.setattr(worker, "ranked", lambda study: [])
    with worker._progress(None, total=5, enabled=True) as callback:
        capsys.readouterr()
        for _ in range(4):
            callback(None, None)
        err = capsys.readouterr().err
    assert err.count("\r") == 1 and "2/5" in err
