import json
import re
import shutil
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import VirtualTimer, tiny_model
from skipsearch.cli import main
from skipsearch.costs.profiler import profile_costs
from skipsearch.decode.cost_profile import ContextCosts, CostProfile, Overheads
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import DraftHead, SkipSet
from skipsearch.decode.stats import DecodeStats
from skipsearch.io.models import model_from_config
from skipsearch.report.projections import projection_lines

SHAPES = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"  # the configs the shipped profiles built


def synthetic(contexts=None, **overrides):
    contexts = contexts or (ContextCosts(context_tokens=16, attn_s=1.0, mlp_s=1.0, rest_s=2.0,
                                         verify_s=[10.0, 10.5, 11.0]),)
    fields = dict(device="cpu", dtype="float32", architecture="LlamaForCausalLM", num_hidden_layers=4,
                  contexts=contexts)
    fields.update(overrides)
    return CostProfile(**fields)


def two_contexts(**overrides):
    # Attention costs 1 s per sublayer at 16 tokens of context and 3 s at 64; the rest does not change.
    return synthetic(contexts=(
        ContextCosts(context_tokens=64, attn_s=3.0, mlp_s=1.0, rest_s=2.0, verify_s=[18.0, 20.0]),
        ContextCosts(context_tokens=16, attn_s=1.0, mlp_s=1.0, rest_s=2.0, verify_s=[10.0, 12.0]),
    ), **overrides)


def test_draft_cost_drops_with_each_skipped_sublayer():
    profile = synthetic()
    assert profile.draft_s(SkipSet()) == 10.0
    assert profile.draft_s(SkipSet.of([0, 1], [3], 4)) == 2.0 + 2 * 1.0 + 3 * 1.0


def test_verify_time_interpolates_and_extrapolates():
    profile = synthetic()
    assert profile.verify_time(1) == 10.0 and profile.verify_time(2.5) == 10.75
    assert profile.verify_time(5) == 12.0  # past the last size: the last slope continues


def test_costs_interpolate_between_context_lengths():
    profile = two_contexts()
    assert profile.context_lengths == [16, 64]  # sorted whatever the order given
    assert profile.attn_at(16) == 1.0 and profile.attn_at(40) == 2.0 and profile.attn_at(64) == 3.0
    assert profile.attn_at(112) == 5.0  # past the longest: the last segment's slope continues
    assert profile.forward_at(40) == 14.0 and profile.verify_time(2, 40) == 16.0
    # Skipping one attention saves more at a longer context.
    skip = SkipSet.of([1], [], 4)
    assert profile.draft_s(SkipSet(), 40) - profile.draft_s(skip, 40) == 2.0
    assert profile.draft_s(SkipSet(), 64) - profile.draft_s(skip, 64) == 3.0
    lengths = range(16, 65, 8)
    assert all(profile.forward_at(a) <= profile.forward_at(b) for a, b in zip(lengths, lengths[1:]))


def test_predicted_speedup_by_hand():
    stats = DecodeStats(new_tokens=14, rounds=5, drafted=9, accepted=8, verify_sizes=Counter({3: 4, 2: 1}))
    # Stats without contexts are priced at the profile's context: 9 drafts at 8 s + 4 verifications of 3 tokens
    # at 11 s + 1 of 2 tokens at 10.5 s, against 13 forwards at 10 s
    assert synthetic().predict_speedup(SkipSet.of([0, 1], [], 4), stats) == pytest.approx(130 / (72 + 44 + 10.5))
    assert synthetic().predict_speedup(SkipSet(), stats) == 1.0


def test_predicted_speedup_prices_rounds_at_their_context_with_overheads():
    overheads = Overheads(round_s=0.5, switch_s=0.25, switch_sublayer_s=0.125, draft_token_s=0.1,
                          adaptive_token_s=0.2)
    profile = two_contexts(overheads=overheads)
    skip = SkipSet.of([0, 1], [], 4)  # drafts cost 2 + 2 * attn + 4 * 1
    # Round 1 at context 16: 1 draft, 2 verified, 1 accepted; round 2 at context 64: 1 draft, 2 verified, none accepted.
    stats = DecodeStats(new_tokens=4, rounds=2, drafted=2, accepted=1,
                        verify_contexts=Counter({(2, 16): 1, (2, 64): 1}))
    switch = 0.25 + 2 * 0.125
    speculative = (8.0 + 0.1 + 12.0 + 0.5 + switch) + (12.0 + 0.1 + 20.0 + 0.5 + switch)
    # 1.5 committed tokens a round, priced at context + 0.25 (the mean offset of a round's tokens).
    plain = 1.5 * (10.0 + 8.0 * 0.25 / 48 + 0.5) + 1.5 * (18.0 + 8.0 * 0.25 / 48 + 0.5)
    assert profile.predict_speedup(skip, stats) == pytest.approx(plain / speculative)
    assert profile.predict_speedup(skip, stats, adaptive=True) == pytest.approx(plain / (speculative + 2 * 0.2))


def test_decoder_records_each_rounds_size_and_context():
    model = tiny_model(dtype=torch.float64)
    prompt = [5, 9, 14, 3, 5, 9]
    stats = generate(model, prompt, skip=SkipSet.of([1], [2], 4), max_new_tokens=12,
                     policy=DraftPolicy(max_draft_tokens=3, adaptive=False)).stats
    assert sum(stats.verify_contexts.values()) == stats.rounds
    sizes = Counter()
    for (n_tokens, _), count in stats.verify_contexts.items():
        sizes[n_tokens] += count
    assert sizes == stats.verify_sizes
    contexts = sorted(context for _, context in stats.verify_contexts)
    assert contexts[0] == len(prompt) and contexts[-1] < len(prompt) + 12
    total = DecodeStats()
    total.add(stats)
    total.add(stats)
    assert total.verify_contexts == stats.verify_contexts + stats.verify_contexts


def positions_1024():
    """A tiny random Llama (seeded) with room for contexts of several cache blocks."""
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_profile_has_one_table_per_context_and_round_trips(tmp_path):
    model = positions_1024()
    profile = profile_costs(model, contexts=(512, 64), max_verify_tokens=3, repeats=2, calibrate=False,
                            clock=VirtualTimer(model))
    assert profile.context_lengths == [64, 512]
    for costs in profile.contexts:
        assert len(costs.verify_s) == 3 and all(t > 0 for t in costs.verify_s)
        assert costs.attn_s >= 0 and costs.mlp_s >= 0 and costs.rest_s >= 0
    assert profile.provenance["torch"] == torch.__version__ and profile.overheads == Overheads()
    assert profile.provenance["attention"] == "SDPA's own grouped query"  # the way a CPU's steps attend
    assert profile.provenance["projections"] == "unfused: a GEMM a linear (eager steps)"
    profile.save(tmp_path / "p.json")
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["version"] == 5 and [c["context_tokens"] for c in saved["contexts"]] == [64, 512]
    assert saved["vocab_size"] == 96 and all(c["head_s"] >= 0 for c in saved["contexts"])
    assert saved["hidden_size"] == 32  # version 5: the hidden size, checked against a model's
    assert saved["attn_shares"] == [1.0] * 4 and saved["mlp_shares"] == [1.0] * 4  # alike in a dense model
    assert CostProfile.load(tmp_path / "p.json") == profile
    profile.check_model(model)
    with pytest.raises(ValueError, match="4 layers"):
        profile.check_model(tiny_model(num_layers=6))
    with pytest.raises(ValueError, match="exceeds the model's 1024 positions"):
        profile_costs(model, contexts=(1020,), max_verify_tokens=9, repeats=1, calibrate=False)


def virtual_time(monkeypatch, model):
    """Time that only forwards advance (`VirtualTimer`), for the profile's forwards and the decoder's wall time."""
    from skipsearch.decode import loop as decoding

    timer = VirtualTimer(model)
    monkeypatch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=timer))
    return timer


def test_overheads_are_measured_in_the_decoder(monkeypatch):
    """Real decoding runs, in virtual time: the loop costs nothing besides its forwards but what is added here, 0.5 ms
    a round and 0.2 ms a drafted token; the residuals find exactly those. The confidence read that a cut round pays
    per draft is timed directly: in virtual time, where only forwards take time, it is free."""
    from skipsearch.costs import calibration

    model = tiny_model()
    timer = virtual_time(monkeypatch, model)
    real_generate = calibration.generate

    def generate_with_bookkeeping(*args, **kwargs):
        output = real_generate(*args, **kwargs)
        stats = output.stats
        stats.wall_time_s += 0.5e-3 * stats.rounds + 0.2e-3 * stats.drafted
        return output

    monkeypatch.setattr(calibration, "generate", generate_with_bookkeeping)
    profile = profile_costs(model, contexts=(8,), max_verify_tokens=5, repeats=1, clock=timer)
    o = profile.overheads
    assert o.round_s == pytest.approx(0.5e-3) and o.draft_token_s == pytest.approx(0.2e-3)
    assert o.adaptive_token_s == 0.0 and "clipped" not in profile.provenance
    assert o.switch_s == o.switch_sublayer_s == 0.0  # decoding runs the draft views: it switches nothing


def test_old_single_context_profiles_still_load(tmp_path):
    old = {"format": "skipsearch/cost-profile", "device": "cpu", "dtype": "float32", "architecture": "LlamaForCausalLM",
           "num_hidden_layers": 4, "context_tokens": 128, "attn_s": 1.0, "mlp_s": 1.0, "rest_s": 2.0,
           "verify_s": [10.0, 10.5]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    profile = CostProfile.load(tmp_path / "old.json")
    assert profile.context_lengths == [128] and profile.overheads == Overheads()
    assert profile.forward_at(16) == profile.forward_at(4096) == 10.0  # one context: the same costs everywhere
    (tmp_path / "new.json").write_text(json.dumps({**old, "version": 6}))
    with pytest.raises(ValueError, match="version 6 is newer"):
        CostProfile.load(tmp_path / "new.json")
    h100 = CostProfile.load(Path(__file__).parent.parent / "benchmarks/results/h100-2026-11-22/profile-llama-2-7b.json")
    assert h100.mlp_shares == () and h100.draft_s(SkipSet.of([], [3], 32)) == h100.draft_s(SkipSet.of([], [30], 32))


def test_each_layer_is_priced_by_its_share_of_the_weights_read():
    """A model of dense and routed feed-forward blocks: skipping the dense one (which a token reads whole) saves
    more than skipping a routed one (of which a token reads the experts it is routed to)."""
    profile = synthetic(mlp_shares=(1.6, 0.8, 0.8, 0.8))
    assert profile.draft_s(SkipSet()) == pytest.approx(10.0)
    assert profile.draft_s(SkipSet.of([], [0], 4)) == pytest.approx(10.0 - 1.6)
    assert profile.draft_s(SkipSet.of([], [2], 4)) == pytest.approx(10.0 - 0.8)
    assert CostProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        synthetic(attn_shares=(1.0, 1.0, 1.0))


def test_a_trimmed_head_is_priced_by_its_rows():
    """A head of a quarter of the vocabulary saves three quarters of the head's time; a profile that did not measure
    the head (version 3 and before) prices trimming as saving nothing, never as free."""
    costs = ContextCosts(context_tokens=64, attn_s=1.0, mlp_s=1.0, rest_s=3.0, verify_s=[11.0, 12.0], head_s=2.0)
    profile = CostProfile(device="cpu", dtype="float32", architecture="LlamaForCausalLM", num_hidden_layers=4,
                          contexts=(costs,), vocab_size=100)
    quarter = SkipSet(head=DraftHead(tuple(range(25))))
    assert profile.draft_s(SkipSet()) == pytest.approx(11.0)
    assert profile.draft_s(quarter) == pytest.approx(11.0 - 0.75 * 2.0)
    assert profile.draft_s(SkipSet.of([1], [], 4, quarter.head)) == pytest.approx(11.0 - 1.5 - 1.0)
    assert CostProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile
    unmeasured = CostProfile(device="cpu", dtype="float32", architecture="LlamaForCausalLM", num_hidden_layers=4,
                             contexts=(costs,))
    assert unmeasured.draft_s(quarter) == pytest.approx(11.0)
    assert unmeasured.to_dict()["version"] == 2 and "head_s" not in unmeasured.to_dict()["contexts"][0]


def test_bad_profiles_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CostProfile.load(tmp_path / "missing.json")
    (tmp_path / "p.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a skipsearch cost profile"):
        CostProfile.load(tmp_path / "p.json")
    (tmp_path / "p.json").write_text('{"format": "skipsearch/cost-profile", "device": "cpu"}')
    with pytest.raises(ValueError, match="malformed"):
        CostProfile.load(tmp_path / "p.json")
    (tmp_path / "p.json").write_text('{"format": "skipsearch/cost-profile", "version": 2, "device": "cpu"}')
    with pytest.raises(ValueError, match="malformed"):
        CostProfile.load(tmp_path / "p.json")


def test_projection_lines_are_labelled_predictions():
    stats = DecodeStats(new_tokens=14, rounds=5, drafted=10, accepted=8, verify_sizes=Counter({3: 5}))
    skip = SkipSet.of([0, 1], [], 4)
    lines = projection_lines([("gpu.json [cuda, bfloat16]", synthetic())], [("attn 0, 1", skip, stats)], 8)
    assert lines[0] == "PREDICTION (cost model, not measured) on gpu.json [cuda, bfloat16]:"
    assert f"{synthetic().predict_speedup(skip, stats):.2f}x" in lines[1] and "acceptance 0.80" in lines[1]
    # A run that drafted nothing (every prompt ended at its first token) has no acceptance to predict from.
    [_, line] = projection_lines([("gpu.json", synthetic())], [("attn 0, 1", skip, DecodeStats(new_tokens=2))], 8)
    assert "drafted nothing" in line


def test_model_from_a_config_folder_or_file_has_random_weights(tmp_path):
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    from_folder = model_from_config(str(tmp_path), device="cpu", dtype="bfloat16")
    from_file = model_from_config(str(tmp_path / "config.json"), device="cpu")
    assert type(from_folder).__name__ == "LlamaForCausalLM" and from_folder.config.num_hidden_layers == 3
    assert from_folder.dtype == torch.bfloat16 and from_file.dtype == torch.float32
    assert not from_folder.training and from_file.model.layers[0].mlp.up_proj.weight.std() > 0
    with pytest.raises(ValueError, match="does not exist"):
        model_from_config(str(tmp_path / "missing.json"))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_config_only_and_the_folder_without_weights(capsys, tmp_path, tiny_model_dir, virtual_profiles):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    code, _, err = run(capsys, "profile", "--model", folder, "--output", tmp_path / "p.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--config-only" in err
    assert not (tmp_path / "p.json").exists()
    code, out, _ = run(capsys, "profile", "--model", folder / "config.json", "--config-only", "--contexts", "8,32",
                       "--repeats", 1, "--output", tmp_path / "p.json", "--no-progress")
    assert code == 0 and re.search(r"^ +8 .*\n +32 ", out, re.MULTILINE)
    # One timed run a measurement has no interval to judge noise by: the profile says so, and the command prints it.
    assert "noise: not checked (1 repeat: telling noise takes 5 or more)" in out.splitlines()
    profile = CostProfile.load(tmp_path / "p.json")
    assert profile.context_lengths == [8, 32] and profile.provenance["weights"].startswith("random")
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--contexts", "0,x", "--output", str(tmp_path / "q.json")])
    assert exit_info.value.code == 2 and "context lengths" in capsys.readouterr().err


def test_project_with_prints_and_stores_predictions(capsys, tmp_path, tiny_model_dir):
    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    contexts = tuple(ContextCosts(context_tokens=c, attn_s=0.001, mlp_s=0.001, rest_s=0.002, verify_s=[0.01, 0.0101])
                     for c in (16, 256))
    # Timed eager steps, as this bench runs: its own prediction and the projection price alike.
    projected = synthetic(contexts=contexts, device="cuda", dtype="bfloat16",
                          provenance={"device_name": "Some GPU", "steps": "eager"})
    projected.save(tmp_path / "gpu.json")
    save_skip_config(SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [2], 4),
                                draft=DraftPolicy(max_draft_tokens=2, adaptive=False)), tmp_path / "c.json")
    code, out, _ = run(capsys, "bench", "--model", tiny_model_dir, "--config", tmp_path / "c.json", "--project-with",
                       tmp_path / "gpu.json", "--cost-profile", tmp_path / "gpu.json", "--num-prompts", 1,
                       "--max-new-tokens", 4, "--repeats", 1, "--prompt-lookup-tokens", 0,
                       "--output-dir", tmp_path / "bench", "--no-progress")
    assert code == 0, out
    assert re.search(r"PREDICTION \(cost model, not measured\) on .*gpu\.json \[cuda \(Some GPU\), bfloat16\]: "
                     r"skipsearch attn=\[1\] mlp=\[2\] \(unguarded, as its study measured\) \d+\.\d\dx", out)
    assert "(guarded) " not in out[out.index("PREDICTION"):]  # the guard's choices are this machine's
    saved = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert saved["rows"][-2]["projected_speedups"] is None
    assert list(saved["rows"][-1]["projected_speedups"].values())[0] == pytest.approx(
        saved["rows"][-1]["predicted_speedup"])  # the same profile twice: the same prediction
    code, out, _ = run(capsys, "optimize", "--model", tiny_model_dir, "--num-prompts", 1, "--max-new-tokens", 4,
                       "--n-trials", 3, "--studies-dir", tmp_path / "studies", "--no-plots", "--no-progress",
                       "--allow-first-last", "--min-match", 0, "--project-with", tmp_path / "gpu.json")
    assert code == 0 and "PREDICTION (cost model, not measured) on" in out
    assert re.search(r"trial \d+, attn=.* predicted \d+\.\d\dx over plain decoding", out)
    # A modeled study times nothing: each set is quoted with the speedup its study predicted for its profile's device
    # (this "Some GPU", not the machine it decoded on), never "nan".
    code, out, _ = run(capsys, "optimize", "--model", tiny_model_dir, "--num-prompts", 2, "--max-new-tokens", 4,
                       "--n-trials", 3, "--studies-dir", tmp_path / "studies", "--study-name", "modeled", "--no-plots",
                       "--no-progress", "--allow-first-last", "--min-match", 0, "--objective", "modeled",
                       "--cost-profile", tmp_path / "gpu.json", "--project-with", tmp_path / "gpu.json")
    assert code == 0 and re.search(r"trial \d+, attn=.* \(predicted for Some GPU \d+\.\d\dx\): predicted \d+\.\d\dx", out)
    assert "measured here" not in out and "nan" not in out


def expected_verify(n_tokens, num_layers=4):
    cost = lambda part: VirtualTimer.COSTS[part][0] + VirtualTimer.COSTS[part][1] * n_tokens  # noqa: E731
    return (num_layers * (cost("attn") + cost("mlp")) + cost("rest")) / 1e3


def test_a_quiet_profile_measures_each_part_once():
    model = tiny_model()
    timer = VirtualTimer(model)
    profile = profile_costs(model, contexts=(8,), max_verify_tokens=3, repeats=6, calibrate=False, clock=timer)
    [costs] = profile.contexts
    assert costs.attn_s == pytest.approx(1.1e-3) and costs.mlp_s == pytest.approx(0.55e-3)
    assert costs.rest_s == pytest.approx(2.2e-3)
    assert costs.verify_s == pytest.approx([expected_verify(n) for n in (1, 2, 3)])
    first_round = timer.forwards
    timer.forwards = 0
    profile_costs(model, contexts=(8,), max_verify_tokens=3, repeats=6, calibrate=False, clock=VirtualTimer(model))
    assert first_round == timer.forwards  # one round of runs: nothing repeated


def test_noise_that_passes_is_measured_again_until_the_figures_settle():
    model = tiny_model()
    quiet = VirtualTimer(model)
    profile_costs(model, contexts=(8,), max_verify_tokens=3, repeats=6, calibrate=False, clock=quiet)
    one_round = quiet.forwards
    model = tiny_model()
    # The first round's forwards are delayed by 20 ms on average (a forward costs about 10 ms), then it is quiet.
    burst = VirtualTimer(model, noise=0.02, noisy_forwards=one_round)
    profile = profile_costs(model, contexts=(8,), max_verify_tokens=3, repeats=6, calibrate=False, clock=burst)
    assert burst.forwards > 2 * one_round  # measured again, pooled with the noisy round, until that was outvoted
    [costs] = profile.contexts
    assert costs.attn_s == pytest.approx(1.1e-3, rel=0.05) and costs.mlp_s == pytest.approx(0.55e-3, rel=0.05)
    assert costs.verify_s == sorted(costs.verify_s) and costs.rest_s > 0


def test_a_time_budget_bounds_measuring_again_not_the_first_round():
    """On a GPU a shape gets a budget of wall time for measuring again (README: no context begun again "past 60 s
    after the first round"): the first round measures every context whatever the budget, so none is left out; past
    the budget nothing is measured again."""
    from skipsearch.costs.profiler import NoisyMachine

    model = tiny_model()
    profile = profile_costs(model, contexts=(8, 16, 32), max_verify_tokens=3, repeats=2, calibrate=False,
                            clock=VirtualTimer(model), budget_s=0.0)
    assert profile.context_lengths == [8, 16, 32]
    noisy = VirtualTimer(model, noise=0.02)
    with pytest.raises(NoisyMachine, match=r"after 1 rounds of 6 timed runs"):
        profile_costs(model, contexts=(8, 16), max_verify_tokens=3, repeats=6, calibrate=False, clock=noisy,
                      budget_s=0.0)


def test_a_machine_too_noisy_to_profile_is_said_in_one_line():
    from skipsearch.costs.profiler import NoisyMachine

    model = tiny_model()
    noisy = VirtualTimer(model, noise=0.02)  # every forward delayed by 20 ms on average: costs vanish in the noise
    with pytest.raises(NoisyMachine, match=r"^this machine is too noisy to profile: after 4 rounds of 6 timed runs, "
                                           r"repeats disagree: at context 8, .*profile again when it is idle") as raised:
        profile_costs(model, contexts=(8,), max_verify_tokens=3, repeats=6, calibrate=False, clock=noisy)
    assert len(str(raised.value).splitlines()) == 1


def test_only_repeats_that_disagree_refuse_a_profile():
    """The figures of issue 27's quiet AMD EPYC (verify costs out of order by width, stable run after run) are a
    profile, priced by the envelope; zero or negative parts are clipped and said; repeats that spread widely refuse."""
    from skipsearch.costs.profiler import _ContextRuns

    def runs(verify, one_token):
        made = _ContextRuns(128, [[v / 1e3 for v in r] for r in verify],
                            {k: [v / 1e3 for v in r] for k, r in one_token.items()})
        return made

    epyc = [36.5, 57.8, 70.8, 55.5, 56.2, 61.6, 75.5, 58.9, 67.3]
    stepped = runs([[v] * 5 for v in epyc], {"full": [36.5] * 5, "no_attn": [30.0] * 5, "no_mlp": [25.0] * 5})
    assert stepped.problems() == [] and stepped.clipped(num_layers=1) == []
    costs = stepped.costs(num_layers=1)
    assert costs.verify_s == pytest.approx([v / 1e3 for v in epyc])  # as measured
    assert costs.envelope() == pytest.approx([v / 1e3 for v in (36.5, 55.5, 55.5, 55.5, 56.2, 58.9, 58.9, 58.9, 67.3)])
    assert costs.verify_time(3) == pytest.approx(55.5e-3)  # padded to 4 tokens
    parts = runs([[10.0], [10.5]], {"full": [10.0], "no_attn": [11.0], "no_mlp": [10.0]})
    assert parts.problems() == []
    assert parts.clipped(num_layers=1) == ["at context 128, a attention cost of -1.000 ms, clipped to 0",
                                           "at context 128, a MLP cost of 0.000 ms, clipped to 0"]
    assert parts.costs(num_layers=1).attn_s == 0.0 and parts.costs(num_layers=1).mlp_s == 0.0
    spread = runs([[10.0], [10.5]], {"full": [7.0, 9.0, 12.0, 15.0, 20.0, 30.0], "no_attn": [7.0], "no_mlp": [8.0]})
    assert any(re.search(r"full's 95% interval is \+-\d+% of it", p) for p in spread.problems())
    few_runs = runs([[10.0], [8.0]], {"full": [10.0], "no_attn": [7.0], "no_mlp": [8.0]})
    assert few_runs.problems() == []  # one run has no interval
    # A head of one row no cheaper than the full one: the LM head's cost is clipped to 0, and said as the others are
    # (the shipped qwen2.5-1.5b's at 32,758 tokens was, unsaid).
    no_head = runs([[10.0], [10.5]], {"full": [10.0], "no_attn": [9.0], "no_mlp": [9.5], "one_row_head": [10.2]})
    assert no_head.costs(num_layers=1).head_s == 0.0
    assert no_head.clipped(num_layers=1) == ["at context 128, a language-model head cost of -0.200 ms, clipped to 0"]
    head = runs([[10.0], [10.5]], {"full": [10.0], "no_attn": [9.0], "no_mlp": [9.5], "one_row_head": [9.0]})
    assert head.costs(num_layers=1).head_s == pytest.approx(1e-3) and head.clipped(num_layers=1) == []
    # A head dearer than all the rest holds (forward less its sublayers): priced at the rest, and said.
    capped = runs([[10.0], [10.5]], {"full": [10.0], "no_attn": [6.0], "no_mlp": [6.5], "one_row_head": [7.0]})
    assert capped.costs(num_layers=1).head_s == pytest.approx(2.5e-3)
    assert capped.clipped(num_layers=1) == [
        "at context 128, a language-model head cost of 3.000 ms, capped at the rest's 2.500 ms"]


def test_overheads_below_zero_are_clipped_and_said_a_little_below_is_zero():
    from skipsearch.costs.calibration import _overheads

    model = tiny_model()
    profile = synthetic(contexts=(ContextCosts(context_tokens=8, attn_s=1e-3, mlp_s=1e-3, rest_s=2e-3,
                                               verify_s=[10e-3, 10.5e-3, 11e-3, 11.5e-3, 12e-3]),))

    def plain(seconds_per_round, rounds=15):
        return DecodeStats(rounds=rounds, wall_time_s=rounds * seconds_per_round,
                           verify_contexts=Counter({(1, 8): rounds}))

    no_drafts = DecodeStats(rounds=1, verify_contexts=Counter({(1, 8): 1}))
    overheads, clipped = _overheads(profile, [(plain(9.8e-3), no_drafts)], model)
    assert overheads.round_s == 0.0 and clipped == []  # 0.2 ms below a 10 ms forward: noise
    overheads, clipped = _overheads(profile, [(plain(5e-3), no_drafts)], model)
    assert overheads.round_s == 0.0 and clipped == ["a negative decoding overhead per round (-5.000 ms), clipped to 0"]
    overheads, clipped = _overheads(profile, [(plain(10.5e-3), no_drafts)], model)
    assert overheads.round_s == pytest.approx(0.5e-3) and clipped == []


def test_a_compiled_profile_times_the_engines_own_steps(monkeypatch):
    """With `compile_mode`, the profile times the steps decoding runs (on CUDA: the CUDA graphs). Each engine step is
    charged a made-up cost by what it is (a verify step by its width, a draft step by what it skips); the profile
    must find exactly those costs, which it can only by timing the engine's steps."""
    from skipsearch.decode.engine import engine_for
    from skipsearch.decode.steps import Step

    model = tiny_model()
    now, real_call = [0.0], Step.__call__

    def charged(step, ids):
        kind = next(key for key, kept in engine_for(model).steps.items() if kept is step)
        if kind[0] == "verify":
            now[0] += (10 + ids.shape[1]) / 1e3  # 11 ms for one token, +1 ms a token
        else:
            skip = kind[1]
            now[0] += (11 - len(skip.attn) * 1.0 - len(skip.mlp) * 0.5) / 1e3  # 1 ms an attention, 0.5 ms an MLP
        return real_call(step, ids)

    monkeypatch.setattr(Step, "__call__", charged)
    profile = profile_costs(model, contexts=(8,), max_verify_tokens=3, repeats=6, calibrate=False, clock=lambda: now[0],
                            compile_mode="regional")
    [costs] = profile.contexts
    assert costs.verify_s == pytest.approx([11e-3, 12e-3, 13e-3])
    assert costs.attn_s == pytest.approx(1e-3) and costs.mlp_s == pytest.approx(0.5e-3)
    assert costs.rest_s == pytest.approx(11e-3 - 4 * 1.5e-3)
    # How the timed steps ran their projections, read from the engine: 4 layers' query/key/value and gate/up groups.
    assert profile.provenance["projections"].startswith("fused: 8 groups of linears of one input")


def test_a_profile_says_whether_its_steps_fused_the_projections():
    """A profile's provenance says how its steps ran a layer's linears of one input (a shipped GPU profile timed fused
    steps or not): as the engine made them after the steps ran, without compiling anything here."""
    from skipsearch.costs.profiler import projections_way
    from skipsearch.decode.adapter import decoder_layers
    from skipsearch.decode.engine import engine_for

    fused, unfused = tiny_model(), tiny_model()
    compiled = engine_for(fused)._layers_for("inductor")  # what a regional step runs: each layer's fused view
    for layer in decoder_layers(fused):
        compiled.layer(layer)
    assert projections_way(fused, "regional") == ("fused: 8 groups of linears of one input (query, key, value; gate, "
                                                  "up), one GEMM each (decode/fused.py)")
    engine_for(unfused).fuse_projections = False
    engine_for(unfused)._layers_for("inductor")
    assert projections_way(unfused, "regional") == "unfused: a GEMM a linear (the engine's fuse_projections off)"
    assert projections_way(fused, None) == "unfused: a GEMM a linear (eager steps)"
    assert projections_way(fused, "reduce-overhead") == "unfused: a GEMM a linear (reduce-overhead steps)"
    assert projections_way(fused, "frozen").startswith("not fused by the engine (frozen steps")


def test_a_profile_times_the_engines_steps_only_while_it_holds_them():
    """The steps a profile times write the engine's one cache, as a compiled decode's do: it holds them as a decode
    does (`Engine.exclusive`), so that it waits for another thread's decode and never times over one. Held already
    in this thread, the profile is refused rather than waiting forever."""
    from skipsearch.decode.engine import engine_for

    model = tiny_model()
    with engine_for(model).exclusive(), pytest.raises(RuntimeError, match="compiled steps are in use in this thread"):
        profile_costs(model, contexts=(8,), max_verify_tokens=2, repeats=2, calibrate=False, compile_mode="regional")
    assert profile_costs(model, contexts=(8,), max_verify_tokens=2, repeats=2, calibrate=False, attempts=1,
                         clock=iter(range(10**6)).__next__).contexts  # released: it times


def test_the_calibration_decodes_on_a_cache_of_its_own_length(monkeypatch):
    """A compiled step costs what its cache's slots cost, whatever the position (on an H200, 3.3x at 8,192 slots what
    it costs at 256). The profile's longest context grows the engine's cache; its calibration must not decode on that
    cache, or the longer cache's cost lands in the overheads (the lease of 2026-11-27 measured 3.4 ms a round on a
    1.5 ms forward so). Here every compiled step costs 11 ms and 1 ms per 256 slots, whatever its width (as on a GPU:
    a padded verification costs what a full one does), and the decoder pays nothing besides its steps: the overheads
    are zero."""
    from skipsearch.decode.engine import engine_for
    from skipsearch.decode.steps import Step
    from skipsearch.decode import loop as decoding

    model = positions_1024()
    now, real_call = [0.0], Step.__call__

    def charged(step, ids):
        now[0] += (11 + step.cache.capacity / 256) / 1e3
        return real_call(step, ids)

    monkeypatch.setattr(Step, "__call__", charged)
    monkeypatch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    profile = profile_costs(model, contexts=(8, 600), max_verify_tokens=5, repeats=2, clock=lambda: now[0],
                            compile_mode="regional")
    assert profile.forward_at(600) - profile.forward_at(8) == pytest.approx(2e-3)  # 768 slots against 256
    # On the longest context's cache both would be about 2 ms; the profile prices the runs' forwards by position,
    # between its two contexts, which leaves a few hundredths of a millisecond at most (clipped to 0).
    assert profile.overheads.round_s == pytest.approx(0.0, abs=0.2e-3)
    assert profile.overheads.draft_token_s == pytest.approx(0.0, abs=0.2e-3)
    assert engine_for(model).cache.capacity == 256  # the calibration's own length, in blocks


def test_releasing_the_cache_drops_the_steps_that_write_it():
    from skipsearch.decode.engine import CompileSettings, engine_for
    from skipsearch.decode.skipping import _draft_cache

    model = tiny_model()
    engine, settings, skip = engine_for(model), CompileSettings(mode="regional"), SkipSet.of((1,), (), 4)
    engine.prepare(600, skip, settings, 3).draft(torch.tensor([[5]]))  # the draft compiles the layer kinds
    assert engine.cache.capacity == 768 and engine.steps and engine.layers["inductor"].warmed and _draft_cache(model)
    engine.release_cache()
    assert engine.cache is None and not engine.steps and not _draft_cache(model)
    assert not engine.layers["inductor"].warmed  # the next set's setup warms the kinds again, at the new length
    assert engine.prepare(20, None, settings, 1).cache.capacity == 256  # without the release, 768 would serve


def test_a_context_measured_again_is_timed_on_a_cache_of_its_own_length():
    """The profile measures contexts again while their repeats disagree, after the longest grew the cache: each is
    timed on a cache of its own length again."""
    from skipsearch.costs.profiler import _compiled_forwards
    from skipsearch.decode.engine import CompileSettings, engine_for

    model = positions_1024()
    engine_for(model).prepare(600, None, CompileSettings(mode="regional"), 1)  # the longest context's cache
    cache, _, _ = _compiled_forwards(model, torch.randint(0, 96, (1, 40)), 8, 3, "regional")
    assert cache.capacity == 256


def test_the_shipped_gpu_profiles_load_by_name_and_match_their_shapes():
    """Each shipped profile is read by its name, is a GPU's (at the shortest context, verifying 9 tokens costs little
    more than one, where the weights' reads dominate; a CPU's costs several times more), has its shape's layers and
    says how its steps attended; a missing file names the shipped ones."""
    from skipsearch.decode.cost_profile import SHIPPED_PROFILES, shipped_profiles

    names = shipped_profiles()
    assert {"nvidia-h200/smollm2-135m", "nvidia-h200/llama-3-8b", "nvidia-h200/llama-2-13b"} <= set(names)
    for name in names:
        profile = CostProfile.load(name)
        assert profile == CostProfile.load(Path(name)) == CostProfile.load(SHIPPED_PROFILES / f"{name}.json")
        assert profile.device.startswith("cuda") and profile.provenance["device_name"]
        assert "unmeasured" not in profile.provenance and profile.overheads.draft_token_s > 0  # measured whole
        config = json.loads((SHAPES / f"{name.split('/')[1]}.json").read_text())
        assert profile.num_hidden_layers == config["num_hidden_layers"] and profile.vocab_size == config["vocab_size"]
        assert profile.contexts[0].verify_s[-1] < 1.25 * profile.contexts[0].verify_s[0]
        grouped = config.get("num_key_value_heads", config["num_attention_heads"]) < config["num_attention_heads"]
        ways = ("query heads folded", "SDPA's own grouped query") if grouped else ("SDPA, no grouped query",)
        assert profile.provenance["attention"].startswith(ways)  # how its steps attended, for whoever reads it
        assert profile.provenance["projections"].startswith(("fused: ", "unfused: "))  # how its steps ran them
    with pytest.raises(ValueError, match="does not exist \\(shipped profiles: .*nvidia-h200/llama-3-8b"):
        CostProfile.load("nvidia-h200/no-such-shape")


def test_a_profile_refuses_a_model_of_another_shape_and_names_the_shipped_ones_that_fit():
    """The layers and the vocabulary must match (a Llama-3-8B profile read for a Llama-2-7B: 32 layers both, 128,256
    tokens against 32,000); the error names the shipped profiles of the model's shape."""
    from skipsearch.decode.cost_profile import model_shape

    llama_3_8b = CostProfile.load("nvidia-h200/llama-3-8b")
    config = json.loads((SHAPES / "llama-2-7b.json").read_text())
    small = LlamaConfig(**{**config, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                           "num_key_value_heads": 4})
    llama_2_7b = AutoModelForCausalLM.from_config(small)  # its shape's layers and vocabulary, tiny matrices
    assert model_shape(llama_2_7b) == ("LlamaForCausalLM", 32, 32000, 32)
    refusal = (r"with 32 layers and 128,256 tokens, not LlamaForCausalLM with 32 layers and 32,000 tokens "
               r"\(shipped profiles of its shape: nvidia-h200/llama-2-7b\)$")
    with pytest.raises(ValueError, match=refusal):
        llama_3_8b.check_model(llama_2_7b)
    CostProfile.load("nvidia-h200/llama-2-7b").check_model(llama_2_7b)


def test_a_profile_label_names_the_overheads_it_prices_at_zero():
    """The shipped profiles measure every overhead (their label names only the device); one whose provenance lists
    overheads as unmeasured says, in every prediction's label, that they are priced at 0."""
    from dataclasses import replace

    llama_3_8b = CostProfile.load("nvidia-h200/llama-3-8b")
    assert llama_3_8b.label() == "cuda:0 (NVIDIA H200), bfloat16"
    assert "unmeasured" not in llama_3_8b.provenance
    partial = replace(llama_3_8b, provenance={**llama_3_8b.provenance, "unmeasured": ["round_s", "draft_token_s"]})
    assert partial.label().endswith("; not measured, priced at 0: round_s, draft_token_s")


def test_default_contexts_on_cuda_fit_a_quarter_of_free_memory(monkeypatch):
    """On CUDA a profile's contexts go as far as a quarter of the free memory holds their cache (every layer's keys
    and values, `cache_bytes`) and the prefill's activations; the CUDA call alone is stood in for."""
    import types

    from skipsearch.costs.profiler import CUDA_CONTEXTS, default_contexts
    from skipsearch.decode.kvcache import cache_bytes

    model = positions_1024()
    config = LlamaConfig(**{**model.config.to_dict(), "max_position_embeddings": 1 << 20})
    per_token = cache_bytes(config, 1, torch.float32) + 4 * config.intermediate_size * 4
    assert per_token == 2 * 4 * 2 * 8 * 4 + 4 * 64 * 4  # 4 layers, 2 key/value heads of 8, fp32; the MLP's 64
    stand_in = types.SimpleNamespace(config=config, dtype=torch.float32, device=torch.device("cuda", 0))
    fitting = CUDA_CONTEXTS[len(CUDA_CONTEXTS) // 2]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * fitting * per_token, 1 << 40))
    assert default_contexts(stand_in) == [c for c in CUDA_CONTEXTS if c <= fitting]


def test_a_profiles_table_names_its_units_and_aligns_its_columns():
    from skipsearch.costs.profiler import format_profile

    lines = format_profile(two_contexts()).splitlines()
    assert lines[0].startswith("milliseconds, one token unless said")
    header, *rows = lines[1:4]
    assert re.split(r"\s{2,}", header.strip()) == ["context", "forward", "attention, a layer", "MLP, a layer", "rest",
                                                   "verify 2 tokens"]
    assert len({len(header), *map(len, rows)}) == 1  # right-aligned under their headers
    assert [row.split()[:3] for row in rows] == [["16", "10000.000", "1000.000"], ["64", "18000.000", "3000.000"]]
    assert "draft-mode switch" not in "\n".join(lines)  # a profile made now switches nothing


def stepped(verify_s):
    """A profile whose verification costs step by width (a forward of 1.0, a draft skipping attention 0 and 1 0.9)."""
    return synthetic(contexts=(ContextCosts(context_tokens=16, attn_s=0.05, mlp_s=0.05, rest_s=0.6,
                                            verify_s=verify_s),))


def test_a_lone_token_is_a_plain_step_never_padded():
    """A round of one token (the guard's plain steps, a round with no room to draft) runs the plain step, never padded
    (loop.py's `_verify`, `_plain_steps`), and `DecodeStats` records the tokens verified: priced at verify_s[0], a run
    that never drafted predicts 1.0x however cheap a wider verification is (the audit's 1.053x)."""
    profile = stepped([1.0, 0.95, 1.2, 1.3])
    assert profile.verify_time(1) == 1.0 and profile.verify_time(2) == 0.95  # two tokens may be padded
    never_drafted = DecodeStats(new_tokens=11, rounds=10, verify_sizes=Counter({1: 10}))
    skip = SkipSet.of([0, 1], [], 4)
    assert profile.predict_speedup(skip, never_drafted) == 1.0
    assert profile.predict_speedup(skip, never_drafted, max_draft_tokens=3, compiled=True) == 1.0
    from skipsearch.costs.profiler import format_profile

    assert "padded" not in format_profile(profile)  # nor does the table say one token is
    assert "verifying 2 tokens is padded" in format_profile(stepped([1.0, 1.2, 1.1, 1.3]))


def test_eager_verification_pads_within_the_largest_round_compiled_to_it():
    """The eager loop pads a verification to the cheapest width up to max_draft_tokens + 1 (`DraftController.width`);
    the compiled verify step takes that width whatever the round's (`_verify`). Predictions price each so; without
    `max_draft_tokens`, any measured width, as before."""
    skip = SkipSet.of([0, 1], [], 4)  # a draft costs 0.6 + 2 * 0.05 + 4 * 0.05 = 0.9
    cheap_at_4 = stepped([1.0, 1.2, 1.3, 1.1])
    three = DecodeStats(new_tokens=9, rounds=4, drafted=8, accepted=4, verify_sizes=Counter({3: 4}))  # 2 a round
    assert cheap_at_4.predict_speedup(skip, three, max_draft_tokens=2) == pytest.approx(8 / (4 * (2 * 0.9 + 1.3)))
    assert cheap_at_4.predict_speedup(skip, three) == pytest.approx(8 / (4 * (2 * 0.9 + 1.1)))  # padded to 4
    assert cheap_at_4.verify_time(3, widest=3) == 1.3 and cheap_at_4.verify_time(3, widest=4) == 1.1
    dear_at_4 = stepped([1.0, 1.05, 1.1, 1.3])
    two = DecodeStats(new_tokens=9, rounds=4, drafted=4, accepted=4, verify_sizes=Counter({2: 4}))
    assert dear_at_4.predict_speedup(skip, two, max_draft_tokens=3) == pytest.approx(8 / (4 * (0.9 + 1.05)))
    assert dear_at_4.predict_speedup(skip, two, max_draft_tokens=3, compiled=True) == pytest.approx(
        8 / (4 * (0.9 + 1.3)))  # padded to 4 tokens, the compiled step's one width
    assert dear_at_4.predict_speedup(skip, two, compiled=True) == pytest.approx(8 / (4 * (0.9 + 1.05)))  # widest: 2
    assert dear_at_4.verify_time(2, widest=6, compiled=True) == pytest.approx(1.3 + 2 * 0.2)  # extrapolated


def test_the_calibration_prices_its_rounds_at_the_widths_they_ran():
    """The calibration decodes without a profile: eager, a round verifies its tokens alone (no padding); compiled,
    at the largest round's width. Its residuals price each so: a decoder that pays nothing besides its forwards has
    no overheads, however the widths step."""
    from skipsearch.costs.calibration import _DRAFT_TOKENS, _calibration, _overheads

    model = tiny_model()
    profile = synthetic(contexts=(ContextCosts(context_tokens=8, attn_s=1e-3, mlp_s=1e-3, rest_s=2e-3,
                                               verify_s=[10e-3, 14e-3, 12e-3, 13e-3, 16e-3]),))
    _, skip, _ = _calibration(model, profile)
    plain = DecodeStats(rounds=10, wall_time_s=10 * 10e-3, verify_contexts=Counter({(1, 8): 10}))
    draft = profile.draft_s(skip, 8)

    def drafted(verify_s):
        return DecodeStats(rounds=5, drafted=5, wall_time_s=5 * (draft + verify_s),
                           verify_contexts=Counter({(2, 8): 5}))

    overheads, clipped = _overheads(profile, [(plain, drafted(14e-3))], model)
    assert overheads.round_s == pytest.approx(0.0, abs=1e-12) and clipped == []
    assert overheads.draft_token_s == pytest.approx(0.0, abs=1e-12)  # priced at 2 tokens' 14 ms, not 3 tokens' 12
    assert _DRAFT_TOKENS + 1 == 5  # compiled: every drafting round verifies 5 tokens
    overheads, clipped = _overheads(profile, [(plain, drafted(16e-3))], model, compiled=True)
    assert overheads.draft_token_s == pytest.approx(0.0, abs=1e-12) and clipped == []


def test_a_profile_knows_the_hidden_size_and_checks_it_where_known():
    """Version 5 holds the hidden size, compared with the model's; a profile of an earlier version (the shipped ones)
    holds none, is not compared, and is written back as it was read."""
    from skipsearch.decode.cost_profile import SHIPPED_PROFILES, shipped_profiles

    model = positions_1024()  # 4 layers, 96 tokens, hidden size 32
    wide = synthetic(vocab_size=96, hidden_size=64)
    with pytest.raises(ValueError, match=r"^cost profile is for LlamaForCausalLM with 4 layers, hidden size 64 and 96 "
                                         r"tokens, not LlamaForCausalLM with 4 layers, hidden size 32 and 96 tokens$"):
        wide.check_model(model)
    synthetic(vocab_size=96, hidden_size=32).check_model(model)
    synthetic(vocab_size=96).check_model(model)  # unknown: not compared
    assert wide.to_dict()["version"] == 5 and CostProfile.from_dict(json.loads(json.dumps(wide.to_dict()))) == wide
    for name in shipped_profiles():
        stored = json.loads((SHIPPED_PROFILES / f"{name}.json").read_text())
        assert stored["version"] == 4 and json.loads(json.dumps(CostProfile.load(name).to_dict())) == stored


@pytest.mark.parametrize("change, message", [
    (lambda p: p["contexts"].append(dict(p["contexts"][0])), "contexts: context_tokens 128 appears more than once"),
    (lambda p: p["contexts"][1].update(verify_s=[]), r"context 512: verify_s is empty"),
    (lambda p: p["contexts"][0].update(attn_s=-1e-3), r"context 128: attn_s is -0.001, not a finite cost at least 0"),
    (lambda p: p["contexts"][0].update(head_s=float("nan")), r"context 128: head_s is nan, not a finite cost"),
    (lambda p: p["contexts"][0]["verify_s"].__setitem__(2, float("inf")), r"context 128: verify_s\[2\] is inf"),
    (lambda p: p["contexts"][0]["verify_s"].__setitem__(0, 0.0),
     r"context 128: verify_s\[0\] is 0.0, not a finite cost above 0"),
    (lambda p: p["contexts"][0].update(context_tokens=0), r"context 0: context_tokens must be a positive number"),
    (lambda p: p["overheads"].update(round_s=float("nan")), r"overheads: round_s is nan, not a finite number"),
    (lambda p: p["mlp_shares"].__setitem__(3, -1.0), r"mlp_shares\[3\] is -1.0, not a finite share at least 0"),
])
def test_a_profile_whose_figures_are_not_costs_is_refused_in_one_line(tmp_path, change, message):
    """Repeated context lengths (a division by zero later), no verification (an index error), costs negative or not
    finite: refused at loading, in one line naming the file and the field."""
    from skipsearch.decode.cost_profile import SHIPPED_PROFILES

    data = json.loads((SHIPPED_PROFILES / "nvidia-h200/smollm2-135m.json").read_text())
    change(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'bad.json'))}: {message}") as raised:
        CostProfile.load(tmp_path / "bad.json")
    assert len(str(raised.value).splitlines()) == 1


def test_a_profile_of_few_repeats_says_its_noise_was_not_checked():
    """Under 5 timed runs a measurement there is no interval to judge noise by: the profile is made, and its
    provenance and table say the noise was not checked; from 5 on nothing is said."""
    from skipsearch.costs.profiler import format_profile

    model = tiny_model()
    few = profile_costs(model, contexts=(8,), max_verify_tokens=2, repeats=2, calibrate=False,
                        clock=VirtualTimer(model))
    assert few.provenance["noise"] == "not checked (2 repeats: telling noise takes 5 or more)"
    assert "noise: not checked (2 repeats: telling noise takes 5 or more)" in format_profile(few).splitlines()
    enough = profile_costs(model, contexts=(8,), max_verify_tokens=2, repeats=5, calibrate=False,
                           clock=VirtualTimer(model))
    assert "noise" not in enough.provenance and "noise" not in format_profile(enough)


def test_a_profile_prices_verification_as_the_steps_it_timed_pad_it():
    """Predictions for a profile's device (modeled studies, projections) pad verification as its steps do: compiled
    where it timed compiled steps (its provenance's `steps`; a CUDA profile without one: the profiler's steps there)."""
    assert synthetic(device="cuda:0").compiled_steps and not synthetic(device="cpu").compiled_steps
    assert synthetic(device="cpu", provenance={"steps": "regional"}).compiled_steps
    assert not synthetic(device="cuda:0", provenance={"steps": "eager"}).compiled_steps
    contexts = tuple(ContextCosts(context_tokens=c, attn_s=0.001, mlp_s=0.001, rest_s=0.002,
                                  verify_s=[0.01, 0.011, 0.012, 0.013, 0.02]) for c in (16, 256))
    gpu = synthetic(contexts=contexts, device="cuda:0")
    stats = DecodeStats(rounds=4, accepted=4, drafted=8, new_tokens=9, verify_sizes={3: 4})
    [_, line] = projection_lines([("gpu.json", gpu)], [("attn 0, 1", SkipSet.of([0, 1], [], 4), stats)], 4)
    padded = gpu.predict_speedup(SkipSet.of([0, 1], [], 4), stats, max_draft_tokens=4, compiled=True)
    assert f"predicted {padded:.2f}x" in line
    assert padded < gpu.predict_speedup(SkipSet.of([0, 1], [], 4), stats, max_draft_tokens=4)  # width 5 costs more
