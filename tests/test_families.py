"""Every tested decoder family (conftest.FAMILY_CONFIGS), on a tiny random-weight model of its config.

Identical greedy output proves nothing about the draft, since verification corrects any draft: so each family's
draft is checked against the definition of a skip first (the model's own sublayers zeroed by forward hooks), then
decoding against transformers' greedy output, eager and compiled. Sampling, `profile --config-only`, a 3-trial
`optimize` and the refusals run on a few representative families (a routed mixture of experts, Gemma's norms,
GPT-OSS's eager-only attention with sinks and router scores) to keep the file fast.
"""

import json
import re

import pytest
import torch

from conftest import FAMILY_CONFIGS, family_config, family_model
from skipsearch.cli import main
from skipsearch.decode import adapter, families
from skipsearch.decode.config import ModelInfo, SkipConfig
from skipsearch.decode.economics import sublayer_weights, weight_fraction
from skipsearch.decode.engine import engine_for
from skipsearch.decode.families import zeroed_logits
from skipsearch.decode.kvcache import check_layer_types
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipping import SkippedLayer, draft_mode, draft_model, model_with_layers
from skipsearch.decode.skipset import DraftHead, SkipSet
from test_decoding import assert_sampling_follows_the_full_model

FAMILIES = sorted(FAMILY_CONFIGS)
NUM_LAYERS = families.TINY_LAYERS
PROMPT = [5, 9, 14, 3, 22, 7, 11, 2]
REGIONAL = dict(compile=True, compile_backend="aot_eager", compile_mode="regional")
# Each kind of layer a draft runs: attention alone skipped, feed-forward alone, both, neither (layer 0).
SKIPS = (SkipSet.of([1], [], NUM_LAYERS), SkipSet.of([], [2], NUM_LAYERS), families.SKIP)
# A draft head over every third token of the tiny vocabulary (96), the prompt's own tokens among them or not.
HEAD = DraftHead(tuple(range(0, 96, 3)))
TRIMMED = SkipSet(families.SKIP.attn, families.SKIP.mlp, HEAD)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("family", FAMILIES)
def test_the_draft_is_the_model_with_its_skipped_sublayers_zeroed(family):
    model = family_model(family, seed=1)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        full = model(ids).logits
    for skip in SKIPS:
        with draft_mode(model, skip), torch.no_grad():
            drafted = model(ids).logits
        expected = zeroed_logits(model, ids, skip)
        torch.testing.assert_close(drafted, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(draft_model(model, skip)(ids).logits, drafted, atol=0, rtol=0)  # the engine's view
        assert (expected - full).abs().max() > 1e-2  # the skip has teeth: 100 times the tolerance
    # With every sublayer zeroed, the family's own layers pass the residual stream through: the norms around a
    # skipped sublayer add nothing, which is what lets the draft replace such a layer by the identity.
    every = range(NUM_LAYERS)
    with torch.no_grad():
        passed = model_with_layers(model, torch.nn.ModuleList(SkippedLayer() for _ in every))(ids).logits
    torch.testing.assert_close(zeroed_logits(model, ids, SkipSet.of(every, every)), passed, atol=1e-4, rtol=0)


# The families whose layers' linears of one input fuse (decode/fused.py), and which of their sublayers fuse.
FUSED_SUBLAYERS = {"phi3": set(), "qwen3_moe": {"self_attn"}, "mixtral": {"self_attn"}, "gpt_oss": {"self_attn"}}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_with_its_projections_fused_computes_what_the_layer_does(family):
    """What inductor's regional steps run (fused.py), checked eagerly against the family's own layers: each fused
    projection is its linear's columns of the group's GEMM, the model's parameters keep their values and become views
    of the fused weights (no memory more), and only the sublayers with the names fused.py knows are fused (Phi-3's
    projections are fused by the family already, a routed mixture of experts has no gate and up projections)."""
    from skipsearch.decode.fused import FusedProjections, ProjectionSlice

    model = family_model(family, seed=1)
    ids = torch.tensor([PROMPT])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        expected = model(ids).logits
    fusion = FusedProjections()
    layers = torch.nn.ModuleList(fusion.layer(layer) for layer in adapter.decoder_layers(model))
    fused = {name for name in ("self_attn", "mlp")
             if any(isinstance(child, ProjectionSlice) for child in getattr(layers[0], name).children())}
    assert fused == FUSED_SUBLAYERS.get(family, {"self_attn", "mlp"})
    with torch.no_grad():
        torch.testing.assert_close(model_with_layers(model, layers)(ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(ids).logits, expected, atol=0, rtol=0)  # the model's own forward, unchanged
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert fusion.intact() and (len(fusion.groups) == NUM_LAYERS * len(fused))
    for linears, group in fusion.groups:  # the linears read the fused weights
        assert {linear.weight.untyped_storage().data_ptr() for linear in linears} == {
            group.weight.untyped_storage().data_ptr()}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trimmed_draft_head_is_the_argmax_over_its_rows_of_the_full_logits(family):
    """The definition of a trimmed head: the draft path's logits at the head's rows, the lowest finite value at every
    other token; so its greedy draft is the argmax over the head's rows of what the untrimmed draft computes."""
    model = family_model(family, seed=1)
    ids = torch.tensor([PROMPT])
    untrimmed = zeroed_logits(model, ids, families.SKIP)
    rows = torch.tensor(HEAD.ids)
    for drafted in (draft_model(model, TRIMMED)(ids).logits, _in_draft_mode(model, TRIMMED, ids)):
        torch.testing.assert_close(drafted[..., rows], untrimmed[..., rows], atol=1e-4, rtol=0)
        outside = torch.ones(drafted.shape[-1], dtype=torch.bool)
        outside[rows] = False
        # The lowest finite value, or its image under a family's soft cap (Gemma 2's -30): below every kept row.
        lowest = drafted[..., outside]
        assert (lowest == lowest.flatten()[0]).all() and lowest.max() < drafted[..., rows].min()
        assert drafted.argmax(-1).tolist() == rows[untrimmed[..., rows].argmax(-1)].tolist()
    assert (untrimmed.argmax(-1) % 3 != 0).any()  # the trim has teeth: the untrimmed argmax leaves the head


def _in_draft_mode(model, skip, ids):
    with draft_mode(model, skip), torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_equals_transformers_eager_and_compiled(family, compiled_prefill_on_cpu):
    model = family_model(family, seed=2)
    expected = families.greedy_tokens(model, PROMPT, 24)
    for skip in (families.SKIP, TRIMMED):
        for options in ({}, REGIONAL):
            out = generate(model, PROMPT, skip=skip, max_new_tokens=24, eos_token_id=None,
                           policy=DraftPolicy(max_draft_tokens=3, guard=False), **options)
            assert out.tokens == expected, (skip, options)
            assert out.stats.drafted > 0
    assert engine_for(model).prefill_steps  # the regional run prefilled through its compiled widths


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "mistral", "smollm3"])
def test_a_longer_call_keeps_the_regional_layers_and_decodes_alike(family):
    """Sliding windows, attention sinks, layers without rotary embeddings: a call that needs a longer cache recompiles
    the regional layers once (the cache's length dynamic) and decodes as HF greedy; a third length compiles nothing."""
    from torch._dynamo.utils import counters

    torch._dynamo.pgo.reset_code_state()  # as a fresh process starts (regional.py: dynamo remembers a changed length)
    model, new_graphs = family_model(family, seed=2), []
    for length in (8, 300, 560):  # caches of 256, 512 and 768 slots
        prompt = [(7 * i + 3) % 90 + 2 for i in range(length)]
        graphs = counters["stats"]["unique_graphs"]
        out = generate(model, prompt, skip=families.SKIP, max_new_tokens=8, eos_token_id=None,
                       policy=DraftPolicy(max_draft_tokens=3, guard=False), **REGIONAL)
        assert out.tokens == families.greedy_tokens(model, prompt, 8), length
        new_graphs.append(counters["stats"]["unique_graphs"] - graphs)
    assert new_graphs[0] > 0 and new_graphs[1] > 0 and new_graphs[2] == 0


def test_a_mixture_of_experts_compiles_with_inductor_once_for_every_skip_set():
    """The file's one real inductor compile (what a study runs on a CPU): Qwen3-MoE's routed experts, regional steps
    equal to HF greedy, and a second skip set compiles nothing."""
    from torch._dynamo.utils import counters

    model = family_model("qwen3_moe", seed=2)
    expected = families.greedy_tokens(model, PROMPT, 16)
    graphs = None
    # A trimmed head's rows are read outside the compiled layers: a head compiles nothing either.
    for skip in (families.SKIP, SkipSet.of([2], [1], NUM_LAYERS), SkipSet.of([2], [1], NUM_LAYERS, HEAD)):
        out = generate(model, PROMPT, skip=skip, max_new_tokens=16, eos_token_id=None, compile=True,
                       compile_mode="regional", policy=DraftPolicy(max_draft_tokens=3, guard=False))
        assert out.tokens == expected and out.stats.drafted > 0
        assert graphs is None or counters["stats"]["unique_graphs"] == graphs
        graphs = counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family, seed", [("gemma3", 1), ("qwen3_moe", 1), ("olmo2", 0)])
def test_sampling_keeps_the_full_models_distribution(family, seed):
    assert_sampling_follows_the_full_model(family_model(family, seed=seed, vocab_size=8),
                                           SkipSet.of([0, 2], [1, 3], NUM_LAYERS))


def test_sampling_with_a_trimmed_head_keeps_the_full_models_distribution():
    """A draft over 3 of 8 tokens proposes nothing else, yet rejection sampling keeps the full model's marginal."""
    assert_sampling_follows_the_full_model(family_model("llama", seed=1, vocab_size=8),
                                           SkipSet.of([0], [3], NUM_LAYERS, DraftHead((1, 4, 6))))


def test_a_routed_block_is_priced_by_the_experts_a_token_reads():
    """A Qwen3-MoE whose first feed-forward block is dense: the others count their router and the 2 of 4 experts a
    token is routed to, not all 4."""
    model = family_model("qwen3_moe", mlp_only_layers=[0])
    layers = adapter.decoder_layers(model)
    routed = layers[1].mlp
    per_expert = sum(p.numel() for p in routed.experts.parameters()) // 4
    read = routed.gate.weight.numel() + 2 * per_expert
    dense = sum(p.numel() for p in layers[0].mlp.parameters())
    weights = sublayer_weights(model)
    assert weights.mlp == (dense, read, read, read)
    assert read < sum(p.numel() for p in routed.parameters())
    assert weight_fraction(model, SkipSet.of([], [1], NUM_LAYERS)) == (weights.total - read) / weights.total
    assert weight_fraction(model, SkipSet.of([], [0], NUM_LAYERS)) == (weights.total - dense) / weights.total


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_config_only_runs_on_the_familys_config(capsys, tmp_path, family, virtual_profiles):
    family_config(family).save_pretrained(tmp_path)
    code, out, err = run(capsys, "profile", "--model", tmp_path / "config.json", "--config-only", "--contexts", 8,
                         "--repeats", 1, "--output", tmp_path / "p.json", "--no-progress")
    assert code == 0, err
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["architecture"] == type(family_model(family)).__name__
    assert len(profile["mlp_shares"]) == NUM_LAYERS


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, default_model):
    """Tiny models of three families with the default model's tokenizer, saved as Hugging Face folders."""
    tokenizer, folders = default_model.tokenizer, {}
    for family in ("qwen3_moe", "gemma3", "gpt_oss"):
        folder = tmp_path_factory.mktemp(family)
        model = family_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.eos_token_id)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[family] = folder
    return folders


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3", "gpt_oss"])
def test_optimize_runs_a_three_trial_study_and_its_config_is_refused_by_another_family(capsys, tmp_path, family,
                                                                                       family_dirs):
    code, out, err = run(capsys, "optimize", "--model", family_dirs[family], "--studies-dir", tmp_path,
                         "--study-name", "f", "--n-trials", 3, "--num-prompts", 1, "--max-new-tokens", 6,
                         "--no-progress", "--no-plots", "--min-match", 0, "--confirm-top", 1, "--confirm-repeats", 2)
    assert code == 0, err
    assert ": 3 distinct skip sets evaluated" in out and (tmp_path / "f" / "best.json").is_file()
    other = next(f for f in family_dirs if f != family)
    code, _, err = run(capsys, "generate", "--model", family_dirs[other], "--prompt", "hi", "--max-new-tokens", 2,
                       "--config", tmp_path / "f" / "best.json")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "architecture=" in err


def test_a_skip_config_made_for_one_family_is_refused_for_every_other():
    models = {family: family_model(family) for family in FAMILIES}
    for family, other in zip(FAMILIES, FAMILIES[1:] + FAMILIES[:1]):
        config = SkipConfig(model=ModelInfo.of(models[family], family), skip=SkipSet.of([1], [2], NUM_LAYERS))
        with pytest.raises(ValueError, match="architecture=") as error:
            config.check_model(models[other])
        assert "\n" not in str(error.value) and type(models[family]).__name__ in str(error.value)


def test_a_decoder_without_separable_sublayers_is_refused_in_one_line_naming_it(capsys, tmp_path):
    """Qwen3-Next's linear-attention layers have no `self_attn`: a ValueError from the API, exit 2 from the CLI."""
    from transformers import Qwen3NextConfig

    model = families.tiny_model(families.tiny_config(Qwen3NextConfig()))
    for call in (lambda: generate(model, PROMPT, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=2),
                 lambda: draft_mode(model, SkipSet.of([1], [], NUM_LAYERS)).__enter__(),
                 lambda: ModelInfo.of(model, "qwen3-next")):
        with pytest.raises(ValueError, match=r"^qwen3_next \(Qwen3NextForCausalLM\) is not a supported decoder: "
                                             r"layer 0 .* no separable `self_attn`") as error:
            call()
        assert "\n" not in str(error.value)
    model.config.save_pretrained(tmp_path)
    code, out, err = run(capsys, "check-family", "--model", tmp_path / "config.json", "--no-compile")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "qwen3_next" in err


def test_an_attention_kind_the_cache_cannot_hold_is_refused_in_one_line_naming_the_family():
    config = family_config("qwen3")
    config.layer_types = ["full_attention", "linear_attention", "sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"^qwen3 is not supported: its layers of kind linear_attention need a cache "
                                         r"that skipsearch's speculative cache is not") as error:
        check_layer_types(config)
    assert "\n" not in str(error.value)
    model = family_model("qwen3")
    model.config.layer_types = config.layer_types
    for call in (lambda: generate(model, PROMPT, max_new_tokens=2), lambda: ModelInfo.of(model, "qwen3"),
                 lambda: draft_mode(model, SkipSet.of([1], [], NUM_LAYERS)).__enter__()):
        with pytest.raises(ValueError, match=r"^qwen3 is not supported: its layers of kind linear_attention"):
            call()


def test_check_family_passes_a_tested_family_and_an_untested_one_and_fails_a_wrong_draft(capsys, tmp_path,
                                                                                         monkeypatch):
    """The command a user runs on a new family's config: Cohere 2 (untested: parallel attention and MLP, every norm
    kept) passes; OLMo 2 with a norm mislabelled fails, and says how."""
    from transformers import Cohere2Config

    family_config("olmo2").save_pretrained(tmp_path / "olmo2")
    code, out, _ = run(capsys, "check-family", "--model", tmp_path / "olmo2")
    assert code == 0 and out.strip().endswith("supported: every check passed") and "compiled: equals" in out
    Cohere2Config().save_pretrained(tmp_path / "cohere2")
    code, out, _ = run(capsys, "check-family", "--model", tmp_path / "cohere2" / "config.json", "--no-compile")
    assert code == 0 and out.startswith("cohere2 (Cohere2ForCausalLM)") and "compiled" not in out
    # The feed-forward block's norm taken for one after the attention: a skipped attention would silence it.
    wrong = adapter.LayerNorms(adapter.SublayerNorms(after=("post_attention_layernorm", "post_feedforward_layernorm")),
                               adapter.SublayerNorms(after=("post_feedforward_layernorm",)))
    monkeypatch.setitem(adapter.SUBLAYER_NORMS, "Olmo2DecoderLayer", wrong)
    code, out, _ = run(capsys, "check-family", "--model", tmp_path / "olmo2", "--no-compile")
    assert code == 1 and re.search(r"NOT supported: the draft's logits differ from the zeroed sublayers' by", out)
