"""Several skip sets, one chosen per prompt at the prefill (choice.py), through `generate`, `self_speculative`
and `python -m skipsearch generate`."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from test_decoding import hf_greedy
from test_engine import HostReads
from skipsearch.decode import loop as decoding
from skipsearch.decode.choice import CHOICE_WINDOW, RoundCosts, agreement, choose, expected_speedup, round_costs
from skipsearch.decode.cost_profile import ContextCosts, CostProfile
from skipsearch.decode.economics import weight_fraction
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.sampling import Sampling
from skipsearch.decode.skipset import SkipSet
from skipsearch.decode.stats import DecodeStats

NUM_LAYERS = 4
CODE, CHAT = range(2, 49), range(49, 96)  # the two kinds of token of `two_kinds_model`
FITS_CODE = SkipSet.of([], [2], NUM_LAYERS)  # skips the MLP that only chat tokens use
FITS_CHAT = SkipSet.of([], [3], NUM_LAYERS)  # skips the MLP that only code tokens use


def two_kinds_model():
    """A tiny Llama where code tokens (2..48) live in the first half of the hidden state and chat tokens (49..95)
    in the second; attention writes nothing; layer 2's MLP reads and writes only the chat half, layer 3's only the
    code half (both large, the other layers' MLPs off); each half's state predicts tokens of its own kind only. So
    skipping layer 2's MLP changes nothing on code tokens and most predictions on chat tokens, and skipping layer
    3's the other way round; and a prompt's continuation stays of its kind."""
    model = tiny_model("llama", seed=3, dtype=torch.float64)
    half = model.config.hidden_size // 2
    code, chat = slice(0, half), slice(half, 2 * half)
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings[: CODE.stop, chat] = 0
        embeddings[CHAT.start :, code] = 0
        model.lm_head.weight[: CODE.stop, chat] = 0
        model.lm_head.weight[CHAT.start :, code] = 0
        model.lm_head.weight[: CODE.start] = 0  # BOS and EOS: never predicted over a token of either kind
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.zero_()
            mlp = layer.mlp
            if index < 2:
                mlp.down_proj.weight.zero_()
                continue
            other = code if index == 2 else chat
            for projection in (mlp.gate_proj, mlp.up_proj):
                projection.weight.normal_(0, 1.0)[:, other] = 0
            mlp.down_proj.weight.normal_(0, 1.0)[other, :] = 0
    return model


MODEL = two_kinds_model()


def prompt_of(kinds, length=24, seed=0):
    """A prompt of `length` tokens drawn from each of `kinds` in turn."""
    generator = torch.Generator().manual_seed(seed)
    return [kinds[i % len(kinds)][int(torch.randint(len(kinds[i % len(kinds)]), (1,), generator=generator))]
            for i in range(length)]


def test_expected_speedup_is_plain_decodings_unless_drafting_pays():
    free = RoundCosts(draft=0.0)
    assert expected_speedup(1.0, free, 4) == 5.0  # every draft accepted and free: 5 tokens a forward
    assert expected_speedup(0.0, free, 4) == 1.0  # nothing accepted: a round commits the full model's one token
    assert expected_speedup(1.0, RoundCosts(draft=1.0), 8) == 1.0  # drafts as dear as the full model never pay
    assert expected_speedup(0.9, RoundCosts(draft=0.5), 0) == 1.0  # no draft tokens: plain decoding
    # a = 0.8, r = 0.2: k = 1 gives 1.8 / 1.2 = 1.5, k = 2 gives 2.44 / 1.4, k = 3 gives 2.952 / 1.6, the best of 1..3.
    assert expected_speedup(0.8, RoundCosts(draft=0.2), 3) == pytest.approx(2.952 / 1.6)
    # Verifying more tokens costs more: the best length shortens.
    dear = RoundCosts(draft=0.2, verify=(1.0, 1.0, 1.0, 3.0))
    assert expected_speedup(0.8, dear, 3) == pytest.approx(2.44 / 1.4)
    assert dear.verification(9) == 3.0 and RoundCosts(0.5).verification(9) == 1.0


def test_plain_decoding_wins_ties_and_the_best_candidate_wins():
    cheap, dear = RoundCosts(draft=0.1), RoundCosts(draft=0.9)
    sets = [SkipSet.of([1]), SkipSet.of([2]), SkipSet.of([3])]
    choice = choose(sets, [0.5, 0.9, 0.9], [cheap, dear, cheap], 4, window=16)
    assert choice.chosen == 2 and choice.skip == sets[2] and choice.speedups[2] > choice.speedups[0] > 1.0
    assert choose(sets[:2], [0.0, 0.0], [cheap, cheap], 4, 16).chosen is None  # 1.0 each: plain decoding wins
    assert choose(sets[:2], [0.9, 0.9], [cheap, cheap], 4, 16).chosen == 0  # equals: the first given
    assert choose(sets[:1], [0.9], [cheap], 4, 16).as_dict() == {
        "candidates": [{"attn": [1], "mlp": []}], "agreements": [0.9],
        "expected_speedups": [expected_speedup(0.9, cheap, 4)], "chosen": 0, "window": 16}


def test_a_drafts_cost_is_the_share_of_weights_it_reads_or_the_profiles():
    model = tiny_model("llama")
    assert weight_fraction(model, SkipSet()) == 1.0
    attn, mlp, head = 3072, 6144, 96 * 32  # this tiny Llama's sublayers and output projection, in parameters
    full = head + NUM_LAYERS * (attn + mlp)
    assert weight_fraction(model, SkipSet.of([0], [1, 2], NUM_LAYERS)) == (full - attn - 2 * mlp) / full
    everything = SkipSet.of(range(NUM_LAYERS), range(NUM_LAYERS), NUM_LAYERS)
    assert weight_fraction(model, everything) == head / full
    assert round_costs(model, everything, 4) == RoundCosts(draft=head / full)
    profile = CostProfile(device="cpu", dtype="float32", architecture="LlamaForCausalLM", num_hidden_layers=4,
                          contexts=(ContextCosts(context_tokens=16, attn_s=1.0, mlp_s=2.0, rest_s=4.0,
                                                 verify_s=[16.0, 18.0, 20.0]),))
    costs = round_costs(model, SkipSet.of([0], [1, 2], NUM_LAYERS), 3, profile, context=16)
    assert costs.draft == (4.0 + 3 * 1.0 + 2 * 2.0) / 16.0
    assert costs.verify == (1.0, 18.0 / 16.0, 20.0 / 16.0, 22.0 / 16.0)  # the last extrapolated


def test_agreement_is_argmax_agreement_or_the_chance_a_sampled_draft_is_accepted():
    full = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]])
    draft = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    assert float(agreement(draft, full, Sampling())) == 0.5
    assert float(agreement(full, full, Sampling(do_sample=True))) == pytest.approx(1.0)
    p, q = torch.softmax(full, -1), torch.softmax(draft, -1)
    assert float(agreement(draft, full, Sampling(do_sample=True))) == pytest.approx(
        float(torch.minimum(p, q).sum(-1).mean()))


@pytest.mark.parametrize("kinds, chosen", [((CODE,), FITS_CODE), ((CHAT,), FITS_CHAT), ((CODE, CHAT), None)],
                         ids=["code", "chat", "mixed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_prompt_gets_the_set_that_suits_it(kinds, chosen, seed):
    """Two sets, each fitting one kind of prompt: code prompts draft with one, chat prompts with the other, and a
    prompt of both kinds, on which each set agrees half the time (not enough to pay), decodes plainly."""
    prompt = prompt_of(kinds, seed=seed)
    # The guard off: this is about the choice, and the guard's verdicts follow this machine's timings.
    out = generate(MODEL, prompt, skip=[FITS_CODE, FITS_CHAT], max_new_tokens=20, eos_token_id=None,
                   policy=DraftPolicy(guard=False))
    assert out.tokens == hf_greedy(MODEL, prompt, 20, eos=None)
    [choice] = out.stats.choices
    assert choice.skip == chosen and choice.candidates == (FITS_CODE, FITS_CHAT) and choice.window == CHOICE_WINDOW
    fitting = {FITS_CODE: 0, FITS_CHAT: 1}
    if chosen is None:
        assert all(0.5 <= a < 0.7 for a in choice.agreements) and out.stats.drafted == 0
    else:
        assert choice.agreements[fitting[chosen]] == 1.0 and choice.agreements[1 - fitting[chosen]] < 0.2
        assert out.stats.drafted > 0


def test_the_choice_costs_one_draft_forward_of_the_window_per_candidate():
    """The prefill is split: the prompt less its window, one draft forward of the window per candidate, the full
    model over the window; a single skip set (or none) prefills in one forward, as without a choice."""
    widths = []
    hook = MODEL.model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        prompt = prompt_of((CODE,), length=20)
        generate(MODEL, prompt, skip=[FITS_CODE, FITS_CHAT, SkipSet()], max_new_tokens=1)
        assert widths == [4, 16, 16, 16]  # the empty set is plain decoding, always a candidate: not drafted
        widths.clear()
        generate(MODEL, prompt[:5], skip=[FITS_CODE, FITS_CHAT], max_new_tokens=1)
        assert widths == [5, 5, 5]  # a prompt shorter than the window is the window
        widths.clear()
        for single in (FITS_CHAT, [FITS_CHAT], [FITS_CHAT, FITS_CHAT], None):
            out = generate(MODEL, prompt, skip=single, max_new_tokens=1)
            assert widths == [20] and out.stats.choices == []
            widths.clear()
    finally:
        hook.remove()


def test_a_one_token_prompt_is_its_own_window():
    out = generate(MODEL, [CHAT[3]], skip=[FITS_CODE, FITS_CHAT], max_new_tokens=12, eos_token_id=None)
    [choice] = out.stats.choices
    assert choice.window == 1 and choice.agreements[1] == 1.0 and choice.skip == FITS_CHAT
    assert out.tokens == hf_greedy(MODEL, [CHAT[3]], 12, eos=None)


def test_a_window_across_longropes_switch_widens_to_the_whole_prompt():
    """Longrope takes its long frequencies for every position of a forward whose last is past the switch: a prefix
    prefilled alone within it would hold other keys than the whole prompt's prefill gives plain decoding. The window
    is then the whole prompt, and the output stays plain decoding's."""
    from conftest import family_model

    switch = 24
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": switch}
    model = family_model("phi3", seed=2, dtype=torch.float64, rope_parameters=rope, max_position_embeddings=256,
                         original_max_position_embeddings=switch)
    sets = [SkipSet.of([1], [], NUM_LAYERS), SkipSet.of([], [2], NUM_LAYERS)]
    wide = switch + CHOICE_WINDOW
    for length, window in ((switch, CHOICE_WINDOW), (switch + 6, switch + 6), (wide, wide), (wide + 1, CHOICE_WINDOW)):
        prompt = [2 + (7 * i) % 90 for i in range(length)]
        out = generate(model, prompt, skip=sets, max_new_tokens=12, eos_token_id=None)
        assert out.stats.choices[0].window == window
        assert out.tokens == hf_greedy(model, prompt, 12, eos=None)


GREEDY_MODEL = tiny_model("qwen2", seed=4, dtype=torch.float64)
layer_ids = st.lists(st.integers(0, NUM_LAYERS - 1), unique=True, max_size=NUM_LAYERS)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sets=st.lists(st.tuples(layer_ids, layer_ids), min_size=2, max_size=4),
       prompt=st.lists(st.integers(2, 95), min_size=1, max_size=30), max_draft=st.integers(0, 6),
       adaptive=st.booleans())
def test_greedy_output_is_plain_decodings_whatever_is_chosen(sets, prompt, max_draft, adaptive):
    skips = [SkipSet.of(attn, mlp, NUM_LAYERS) for attn, mlp in sets]
    policy = DraftPolicy(max_draft_tokens=max_draft, adaptive=adaptive)
    out = generate(GREEDY_MODEL, prompt, skip=skips, max_new_tokens=16, policy=policy, eos_token_id=None)
    assert out.tokens == hf_greedy(GREEDY_MODEL, prompt, 16, eos=None)
    assert len(out.stats.choices) == (len(decoding.drafting_sets(skips, policy)) > 1)


def test_compiled_steps_of_the_chosen_set_decode_exactly():
    for kinds, chosen in (((CODE,), FITS_CODE), ((CHAT,), FITS_CHAT), ((CODE, CHAT), None)):
        prompt = prompt_of(kinds, seed=2)
        out = generate(MODEL, prompt, skip=[FITS_CODE, FITS_CHAT], max_new_tokens=16, eos_token_id=None,
                       compile=True, compile_backend="aot_eager", policy=DraftPolicy(max_draft_tokens=3))
        assert out.tokens == hf_greedy(MODEL, prompt, 16, eos=None) and out.stats.choices[0].skip == chosen


def test_sampling_chooses_by_the_chance_of_acceptance():
    generator = torch.Generator().manual_seed(0)
    out = generate(MODEL, prompt_of((CHAT,)), skip=[FITS_CODE, FITS_CHAT], max_new_tokens=8, eos_token_id=None,
                   sampling=Sampling(do_sample=True), generator=generator)
    [choice] = out.stats.choices
    assert choice.skip == FITS_CHAT and choice.agreements[1] == pytest.approx(1.0, abs=1e-6)  # probabilities in fp32
    assert choice.agreements[0] < 0.8  # a poor draft's distribution overlaps the full model's, but less


def test_the_choice_reads_back_once(monkeypatch):
    """On CUDA's path the choice adds one host read to the prefill's (all agreements at once), and no upload."""
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    reads, decode = HostReads(), decoding._decode

    def counted(*args, **kwargs):
        with reads:
            return decode(*args, **kwargs)

    monkeypatch.setattr(decoding, "_decode", counted)
    out = generate(MODEL, prompt_of((CODE,)), skip=[FITS_CODE, FITS_CHAT], max_new_tokens=20, eos_token_id=None,
                   policy=DraftPolicy(max_draft_tokens=4, guard=False))
    assert out.stats.choices[0].skip == FITS_CODE and out.stats.drafted > 0
    assert reads.count == out.stats.rounds + 2 and reads.uploads == 0


def test_stats_keep_the_choices_and_say_them():
    stats = DecodeStats()
    out = generate(MODEL, prompt_of((CHAT,)), skip=[FITS_CODE, FITS_CHAT], max_new_tokens=4)
    stats.add(out.stats)
    stats.add(generate(MODEL, prompt_of((CODE,)), skip=[FITS_CODE, FITS_CHAT], max_new_tokens=4).stats)
    assert [choice.skip for choice in stats.choices] == [FITS_CHAT, FITS_CODE]
    described = out.stats.as_dict()["choices"]
    assert json.loads(json.dumps(described)) == [out.stats.choices[0].as_dict()]
    assert described[0]["chosen"] == 1 and described[0]["candidates"][1] == {"attn": [], "mlp": [3]}
    assert generate(MODEL, [5, 9], max_new_tokens=2).stats.as_dict()["choices"] == []


def test_a_cost_profile_prices_the_drafts():
    """Drafts priced at the full model's cost never pay: plain decoding is chosen, whatever the agreement."""
    dear = CostProfile(device="cpu", dtype="float64", architecture="LlamaForCausalLM", num_hidden_layers=4,
                       contexts=(ContextCosts(context_tokens=16, attn_s=0.0, mlp_s=0.0, rest_s=1.0,
                                              verify_s=[1.0, 1.0]),))
    prompt = prompt_of((CODE,))
    out = generate(MODEL, prompt, skip=[FITS_CODE, FITS_CHAT], max_new_tokens=8, cost_profile=dear)
    assert out.stats.choices[0].agreements[0] == 1.0 and out.stats.choices[0].skip is None
    with pytest.raises(ValueError, match="cost profile is for LlamaForCausalLM with 4 layers, not"):
        generate(tiny_model("llama", num_layers=2), prompt, skip=[SkipSet.of([0]), SkipSet.of([1])],
                 cost_profile=dear)
    with pytest.raises(TypeError, match="cost_profile must be a CostProfile"):
        generate(MODEL, prompt, cost_profile="costs.json")


@pytest.mark.parametrize("skip, message", [
    ([FITS_CODE, [1]], "a list of them or None, got a list holding list"),
    ([FITS_CODE, None], "got a list holding NoneType"),
    ([FITS_CODE, SkipSet.of([4])], "attn skip id 4 is out of range"),
])
def test_bad_skip_lists_are_refused_before_any_work(skip, message):
    with pytest.raises((TypeError, ValueError), match=message):
        generate(MODEL, [5, 9], skip=skip)


def configs_of(model, tmp_path):
    """Two single-set configs (one per kind of prompt) and one config carrying both, as files."""
    from skipsearch.decode.config import ModelInfo, SkipConfig, SkipEntry, save_skip_config

    info, policy = ModelInfo.of(model, "two-kinds"), DraftPolicy(max_draft_tokens=4)
    save_skip_config(SkipConfig(info, FITS_CODE, policy), tmp_path / "code.json")
    save_skip_config(SkipConfig(info, FITS_CHAT, policy), tmp_path / "chat.json")
    both = SkipConfig.of_entries(info, [SkipEntry(FITS_CODE, "code.jsonl"), SkipEntry(FITS_CHAT, "chat.jsonl")],
                                 policy)
    save_skip_config(both, tmp_path / "both.json")
    return tmp_path / "code.json", tmp_path / "chat.json", tmp_path / "both.json"


def test_self_speculative_chooses_per_prompt(tmp_path):
    from skipsearch import self_speculative

    code, chat, both = configs_of(MODEL, tmp_path)
    for sets in ([FITS_CODE, FITS_CHAT], [code, chat], [str(code), SkipSet.of([], [3], NUM_LAYERS)], both):
        speculative = self_speculative(sets)
        for kinds, chosen in (((CODE,), FITS_CODE), ((CHAT,), FITS_CHAT)):
            prompt = torch.tensor([prompt_of(kinds)])
            plain = MODEL.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
            out = MODEL.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 custom_generate=speculative)
            assert out.tolist() == plain.tolist() and speculative.stats.choices[-1].skip == chosen
    assert self_speculative(both).policy == DraftPolicy(max_draft_tokens=4)  # the configs' own policy


def test_self_speculative_refuses_sets_that_do_not_go_together(tmp_path):
    import dataclasses

    from skipsearch import self_speculative
    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config

    code, chat, _ = configs_of(MODEL, tmp_path)
    save_skip_config(SkipConfig(ModelInfo("other", "LlamaForCausalLM", 6, 32), SkipSet.of([5])), tmp_path / "six.json")
    with pytest.raises(ValueError, match=r"are for different models \(num_hidden_layers=4 and 6\)"):
        self_speculative([code, tmp_path / "six.json"])
    with pytest.raises(ValueError, match="attn skip id 5 is out of range"):
        self_speculative([code, SkipSet.of([5])])
    other_policy = dataclasses.replace(self_speculative(chat).config, draft=DraftPolicy(max_draft_tokens=2))
    with pytest.raises(ValueError, match="draft differently"):
        self_speculative([code, other_policy])
    with pytest.raises(ValueError, match="got an empty list"):
        self_speculative([])
    with pytest.raises(TypeError, match="or a list of them\\), got a list holding int"):
        self_speculative([code, 3])


def test_generate_command_chooses_among_configs(capsys, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from skipsearch.cli import main

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    code, chat, both = configs_of(model, tmp_path)
    common = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "8",
              "--dtype", "float64"]
    assert main([*common, "--config", str(code), "--config", str(chat), "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert main([*common, "--autoregressive", "--json"]) == 0
    assert chosen["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    [choice] = chosen["stats"]["choices"]
    assert choice["candidates"] == [FITS_CODE.as_dict(), FITS_CHAT.as_dict()]
    assert chosen["skip"] == (None if choice["chosen"] is None else choice["candidates"][choice["chosen"]])
    assert main([*common, "--config", str(both)]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "chosen among 2 sets and plain decoding by their agreement with the full model over the prompt's last" \
           in summary and "code.jsonl " in summary and "chat.jsonl " in summary
    # bench measures such a config as generate decodes it: the prefill chooses per prompt (test_spec_bench.py)


def test_generate_command_with_one_drafting_config_among_plain_ones_names_that_set(capsys, tmp_path, tiny_model_dir):
    """A config that skips nothing is no candidate: beside one that drafts, the call decodes with that one, making
    no choice, and must name it (it answered with the tuple of sets and crashed printing it)."""
    from transformers import AutoModelForCausalLM

    from skipsearch.cli import main
    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    code, _, _ = configs_of(model, tmp_path)
    save_skip_config(SkipConfig(ModelInfo.of(model, "two-kinds"), SkipSet(), DraftPolicy(max_draft_tokens=4)),
                     tmp_path / "plain.json")
    common = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello there", "--max-new-tokens", "8",
              "--dtype", "float64", "--config", str(tmp_path / "plain.json")]
    assert main([*common, "--config", str(code), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skip"] == FITS_CODE.as_dict() and out["stats"]["choices"] == []
    assert main([*common, "--config", str(code)]) == 0
    assert f"skip {FITS_CODE}]" in capsys.readouterr().err
    assert main([*common, "--config", str(tmp_path / "plain.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skip"] is None
