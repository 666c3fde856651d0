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
