from collections import Counter

import pytest

from conftest import tiny_model
from skipsearch.costs import CostProfile, profile_costs
from skipsearch.decoding import DecodeStats
from skipsearch.skipping import SkipSet


def synthetic(**overrides):
    fields = dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM", num_hidden_layers=4,
                  context_tokens=16, attn_s=1.0, mlp_s=1.0, rest_s=2.0, verify_s=[10.0, 10.5, 11.0])
    fields.update(overrides)
    return CostProfile(**fields)


def test_draft_cost_drops_with_each_skipped_sublayer():
    profile = synthetic()
    assert profile.draft_s(SkipSet()) == 10.0
    assert profile.draft_s(SkipSet.of([0, 1], [3], 4)) == 2.0 + 2 * 1.0 + 3 * 1.0


def test_verify_time_interpolates_and_extrapolates():
    profile = synthetic()
    assert profile.verify_time(1) == 10.0 and profile.verify_time(2.5) == 10.75
    assert profile.verify_time(5) == 12.0  # past the last size: the last slope continues


def test_predicted_speedup_by_hand():
    stats = DecodeStats(new_tokens=14, rounds=5, drafted=10, accepted=8, verify_sizes=Counter({3: 4, 2: 1}))
    # 10 drafts at 8 s + 4 verifications of 3 tokens at 11 s + 1 of 2 tokens at 10.5 s, against 13 forwards at 10 s
    assert synthetic().predict_speedup(SkipSet.of([0, 1], [], 4), stats) == pytest.approx(130 / (80 + 44 + 10.5))
    assert synthetic().predict_speedup(SkipSet(), stats) == 1.0


def test_profile_of_a_tiny_model_round_trips(tmp_path):
    model = tiny_model()
    profile = profile_costs(model, context_tokens=8, max_verify_tokens=4, repeats=3)
    assert len(profile.verify_s) == 4 and all(t > 0 for t in profile.verify_s)
    assert profile.rest_s > 0 and profile.attn_s >= 0 and profile.mlp_s >= 0
    profile.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == profile
    profile.check_model(model)
    with pytest.raises(ValueError, match="4 layers"):
        profile.check_model(tiny_model(num_layers=6))


def test_bad_profiles_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CostProfile.load(tmp_path / "missing.json")
    (tmp_path / "p.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a skipsearch cost profile"):
        CostProfile.load(tmp_path / "p.json")
    (tmp_path / "p.json").write_text('{"format": "skipsearch/cost-profile", "device": "cpu"}')
    with pytest.raises(ValueError, match="malformed"):
        CostProfile.load(tmp_path / "p.json")
