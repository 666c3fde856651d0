"""Each assumption skipsearch makes about transformers' internals (adapter.TOUCHPOINTS), tested by its name.

`.ci/check-releases` runs this file against other releases (the newest of transformers, torch and Optuna,
the oldest tested transformers and torch): a failure here names the touchpoint that a release broke. The
end-to-end checks at the bottom are what a user would hit first: eager and compiled decoding with two skip
sets in one process, and transformers' own `generate` through `custom_generate`, equal to HF greedy and
without deprecation warnings.
"""

import collections
import logging
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import GenerationConfig, TextStreamer

from conftest import FAMILY_CONFIGS, family_model, tiny_model
from skipsearch.decode import adapter
from skipsearch.decode.adapter import AdapterError
from skipsearch.decode.custom_generate import self_speculative
from skipsearch.decode.kvcache import PositionalLayer, SpeculativeCache
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet

NUM_LAYERS = 4
PROMPT = [5, 9, 14, 3, 22, 7]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3, dtype=torch.float64)


def test_every_touchpoint_has_a_test_named_after_it():
    names = {name.removeprefix("test_touchpoint_") for name in globals() if name.startswith("test_touchpoint_")}
    assert {key.replace(" ", "_").replace("()", "") for key in adapter.TOUCHPOINTS} <= names


def test_an_adapter_error_names_the_touchpoint_and_the_window_in_one_line():
    error = AdapterError("cache keyword", "Foo.forward takes neither")
    text = str(error)
    assert "\n" not in text and "'cache keyword'" in text and error.touchpoint == "cache keyword"
    assert f"{adapter.TESTED_TRANSFORMERS[0]} to {adapter.TESTED_TRANSFORMERS[-1]}" in text


def test_the_tested_window_bounds_versions():
    low, high = adapter.TESTED_TRANSFORMERS
    assert adapter.within_tested_window(f"{low}.0") and adapter.within_tested_window(f"{high}.3")
    assert adapter.within_tested_window(f"{high}.0rc1")  # a pre-release counts as its minor release
    assert not adapter.within_tested_window("4.57.1") and not adapter.within_tested_window("6.0.0")


def test_a_release_outside_the_window_is_named_once_and_runs_on():
    with pytest.warns(UserWarning, match="transformers 6.0.0 is outside skipsearch's tested window") as caught:
        adapter.warn_if_untested("6.0.0")
    command = re.search(r"`bash (\S+) 6\.0\.0`", str(caught[0].message))  # the check it names exists
    assert command and (Path(__file__).parents[1] / command[1]).is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapter.warn_if_untested(f"{adapter.TESTED_TRANSFORMERS[-1]}.0")


def test_a_broken_touchpoint_stops_decoding_before_any_forward_in_one_line():
    """A release whose attention no longer takes the cache as the layer passes it: named, not a TypeError inside."""
    model = tiny_model("llama", seed=2)
    layer = adapter.decoder_layers(model)[0]

    class Renamed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, kv_store=None, **kwargs):
            return self.inner(hidden_states, **kwargs)

    layer.self_attn = Renamed(layer.self_attn)
    with pytest.raises(AdapterError, match="'cache keyword'") as caught:
        generate(model, PROMPT, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=4)
    assert "\n" not in str(caught.value)


def test_touchpoint_cache_keyword(model):
    names = {adapter.cache_keyword(m) for m in (model, adapter.decoder_layers(model)[0],
                                                 adapter.decoder_layers(model)[0].self_attn)}
    assert len(names) == 1 and names <= {"cache", "past_key_values"}

    class NoCache(nn.Module):
        def forward(self, hidden_states):
            return hidden_states

    with pytest.raises(AdapterError, match="'cache keyword'"):
        adapter.cache_keyword(NoCache())


def test_touchpoint_static_cache_layer(model):
    cache = SpeculativeCache(model.config, 16, "cpu", torch.float64)
    layer = cache.layers[0]
    assert isinstance(layer, adapter.static_layer_class()) and isinstance(cache, adapter.cache_class())
    assert adapter.cache_dtype(layer) == torch.float64 and layer.keys.shape[2] == 16
    assert adapter.cache_dtype(PositionalLayer(8, torch.zeros((), dtype=torch.long), False)) is None
    assert cache.matches(16, torch.float64, torch.device("cpu")) and not cache.matches(16, torch.float32,
                                                                                        torch.device("cpu"))
    cache.seek(3)
    keys = torch.ones(1, layer.keys.shape[1], 2, layer.keys.shape[3], dtype=torch.float64)
    layer.update(keys, keys)
    assert layer.keys[0, 0, :, 0].tolist() == [0, 0, 0, 1, 1] + [0] * 11  # written at the shared position


def test_touchpoint_layer_types():
    assert set(adapter.layer_types(tiny_model("llama").config)) == {"full_attention"}
    mistral = tiny_model("mistral", sliding_window=6).config
    assert adapter.layer_types(mistral) == ["sliding_attention"] * NUM_LAYERS
    qwen = tiny_model("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=2).config
    assert set(adapter.layer_types(qwen)) == {"full_attention", "sliding_attention"}


def test_touchpoint_rope_switches():
    """Longrope's switch is read from `rope_parameters`, and a forward whose last position is past it gives every
    position, an early one included, other frequencies than one within it; rope types that do not switch have none."""
    switch, half = 12, 4  # the tiny head's 8 dimensions: a factor per pair
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [4.0] * half, "original_max_position_embeddings": switch}
    model = family_model("phi3", rope_parameters=rope, original_max_position_embeddings=switch)
    assert adapter.rope_switches(model.config) == (switch,)
    rotary, hidden = model.get_decoder().rotary_emb, torch.zeros(1, 1, 8)

    def second_cos(length):  # the second position's (the first's, at 0, has every frequency's cos)
        return rotary(hidden, position_ids=torch.arange(length).view(1, -1))[0][0, 1]

    assert torch.equal(second_cos(2), second_cos(switch)) and not torch.equal(second_cos(2), second_cos(switch + 1))
    assert adapter.rope_switches(tiny_model("llama").config) == ()
    assert adapter.rope_switches(family_model("gemma3").config) == ()  # rope parameters per layer type
    assert adapter.rope_switches(family_model("llama").config) == ()  # llama3 scaling: static


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_touchpoint_prepared_mask(implementation):
    """The forward uses a prepared 4D mask as given: hiding a token's slot gives the logits of the prompt without it
    (at the same positions), which transformers' own mask could not produce."""
    model = tiny_model("llama", seed=4, dtype=torch.float64, attn_implementation=implementation)
    assert adapter.attn_implementation(model.config) == implementation
    ids, positions = torch.tensor([PROMPT]), torch.arange(len(PROMPT)).view(1, -1)
    allowed = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    allowed[:, 2] = False
    allowed[2, 2] = True  # the hidden token still sees itself: no row is all masked
    masked = adapter.model_forward(model, ids, positions, adapter.prepared_mask(allowed, implementation,
                                                                                torch.float64), None)
    keep = [i for i in range(len(PROMPT)) if i != 2]
    without = model(input_ids=ids[:, keep], position_ids=positions[:, keep]).logits
    torch.testing.assert_close(masked[:, -1], without[:, -1])
    assert adapter.masks_by_layer_type({"full_attention": allowed}) is allowed


def test_touchpoint_logits_to_keep(model):
    ids = torch.tensor([PROMPT])
    full = adapter.model_forward(model, ids, None, None, None)
    torch.testing.assert_close(adapter.model_forward(model, ids, None, None, None, logits_to_keep=2), full[:, -2:])
    torch.testing.assert_close(adapter.model_forward(model, ids, None, None, None,
                                                     logits_to_keep=torch.tensor([1])), full[:, 1:2])


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_touchpoint_output_head(family):
    """Every family holds its LM head as a direct submodule and calls it on the final hidden states: a module put in
    its place (as a trimmed draft head is) computes the logits."""
    model = family_model(family, seed=1)
    name, weight, bias = adapter.output_head(model)
    assert getattr(model, name) is model.get_output_embeddings() and weight.shape[0] == model.config.vocab_size
    ids, calls = torch.tensor([PROMPT]), []
    head = getattr(model, name)
    hook = head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    try:
        model(ids)
    finally:
        hook.remove()
    assert calls == [(1, len(PROMPT), model.config.vocab_size)]
    with pytest.raises(AdapterError, match="output head"):
        adapter.output_head(nn.Module())


def test_touchpoint_attention_implementation():
    model = tiny_model("llama", attn_implementation="eager")
    assert adapter.attn_implementation(model.config) == "eager"
    model.config._attn_implementation = "sdpa"
    assert adapter.attn_implementation(model.config) == "sdpa"


def test_touchpoint_decoder_layers(model):
    layers = adapter.decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert getattr(model, adapter.decoder_attribute(model)) is model.get_decoder()
    for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        assert isinstance(getattr(layers[0], name), nn.Module)
    assert adapter.family(model) == "llama (LlamaForCausalLM)" and adapter.family(model.config) == "llama"
    hybrid = family_model("qwen3")
    del adapter.decoder_layers(hybrid)[2].mlp  # as a layer with no separable feed-forward block
    with pytest.raises(ValueError, match=r"^qwen3 \(Qwen3ForCausalLM\) is not a supported decoder: layer 2 "
                                         r"\(Qwen3DecoderLayer\) has no separable `mlp` sublayer to skip$"):
        adapter.decoder_layers(hybrid)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_touchpoint_fusible_projections(family):
    """Where a layer has a group of `adapter.FUSIBLE_PROJECTIONS`, a forward calls each of its linears once, all on the
    same input tensor (what the fused slices compute from; each family's fused layer is compared with its own in
    tests/test_families.py)."""
    model = family_model(family)
    layer, calls = adapter.decoder_layers(model)[0], collections.defaultdict(list)
    groups = [(getattr(layer, name), names) for name, sub_groups in adapter.FUSIBLE_PROJECTIONS.items()
              for names in sub_groups]
    groups = [(sublayer, names) for sublayer, names in groups if all(hasattr(sublayer, n) for n in names)]
    for sublayer, names in groups:
        for name in names:
            getattr(sublayer, name).register_forward_hook(
                lambda module, args, out, name=name, sublayer=sublayer: calls[id(sublayer), name].append(args[0]))
    with torch.no_grad():
        model(torch.tensor([[5, 9, 14]]))
    for sublayer, names in groups:
        inputs = [calls[id(sublayer), name] for name in names]
        assert all(len(each) == 1 for each in inputs) and all(each[0] is inputs[0][0] for each in inputs), names
    assert groups or family == "phi3"  # Phi-3 keeps its projections fused already


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_touchpoint_sublayer_norms(family):
    """Each tested layer class names norms it has; the table's roles are checked against the definition of a skip
    in tests/test_families.py. An untested class, or one of remote code, has none."""
    layer = adapter.decoder_layers(family_model(family))[0]
    norms = adapter.sublayer_norms(layer)
    assert norms is not None
    for name in (*norms.attn.before, *norms.attn.after, *norms.mlp.before, *norms.mlp.after):
        assert "norm" in type(getattr(layer, name)).__name__.lower(), name
    assert adapter.sublayer_norms(nn.Linear(2, 2)) is None
    remote = type(type(layer).__name__, (nn.Module,), {"__module__": "transformers_modules.someone.modeling"})
    assert adapter.sublayer_norms(remote()) is None


@pytest.mark.parametrize("family, extras", [("llama", 0), ("qwen3_moe", 0), ("mixtral", 0), ("gpt_oss", 1)])
def test_touchpoint_feed_forward_output(family, extras):
    """A feed-forward block returns its output alone, or (GPT-OSS) with its router scores; a skipped one returns
    zeros in the same structure."""
    model = family_model(family)
    block, hidden = adapter.decoder_layers(model)[1].mlp, torch.randn(1, 3, model.config.hidden_size)
    assert adapter.feed_forward_extras(block, model.config.hidden_size) == extras
    out = block(hidden)
    assert adapter.feed_forward_output(out).shape == hidden.shape
    skipped = adapter.skipped_feed_forward_output(hidden, extras)
    assert type(skipped) is type(out) and (len(skipped) == len(out) if extras else True)
    assert not adapter.feed_forward_output(skipped).any()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_touchpoint_routed_experts(family):
    """A routed block's experts are stacked by expert; a token reads the router and 2 of the 4 (the tiny config's
    num_experts_per_tok); a dense block is read whole."""
    model = family_model(family)
    block = adapter.decoder_layers(model)[0].mlp
    experts = sum(p.numel() for p in block.experts.parameters())
    assert all(p.shape[0] == 4 for p in block.experts.parameters()) and model.config.num_experts_per_tok == 2
    total = sum(p.numel() for p in block.parameters())
    assert adapter.feed_forward_parameters_read(block, model.config) == total - experts // 2
    dense = adapter.decoder_layers(tiny_model("llama"))[0].mlp
    assert adapter.feed_forward_parameters_read(dense, model.config) == sum(p.numel() for p in dense.parameters())


def test_touchpoint_attention_output(model):
    """An attention run alone returns (output, weights), and a decoder layer run as the engine runs it (with the
    keyword, a prepared mask and the cache) writes the cache and returns the hidden states."""
    layer, width = adapter.decoder_layers(model)[0], 3
    cache = SpeculativeCache(model.config, 8, "cpu", torch.float64)
    hidden = torch.randn(1, width, model.config.hidden_size, dtype=torch.float64)
    positions = cache.positions(width)
    rotary = model.get_decoder().rotary_emb(hidden, positions)
    out = layer.self_attn(hidden, position_embeddings=rotary, attention_mask=cache.attention_mask(width),
                          **{adapter.cache_keyword(layer.self_attn): cache})
    assert isinstance(out, tuple) and len(out) == 2 and adapter.attention_output(out).shape == hidden.shape
    skipped = adapter.skipped_attention_output(hidden)  # what a skipped attention returns: the same structure
    assert len(skipped) == 2 and skipped[1] is None and not skipped[0].any() and skipped[0].shape == hidden.shape
    cache.seek(0)
    result = adapter.run_decoder_layer(layer, hidden, cache.attention_mask(width), rotary, positions, cache.layers[0],
                                       adapter.cache_keyword(layer))
    assert result.shape == hidden.shape and cache.layers[0].keys[0, :, :width].abs().sum() > 0


def test_touchpoint_custom_generate_call(model):
    """generate calls a callable custom_generate with prepared inputs we know, and keeps the streamer in its frame."""
    seen = {}

    class Streamer(TextStreamer):
        def __init__(self):
            self.puts = 0

        def put(self, value):
            self.puts += 1

        def end(self):
            pass

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
               streamer=None, **model_kwargs):
        seen["inputs"], seen["streamer"] = set(model_kwargs), adapter.generate_argument("streamer", depth=1)
        seen["cache"] = adapter.generate_cache_input(model_kwargs)
        return input_ids

    streamer = Streamer()
    model.generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False, custom_generate=decode,
                   streamer=streamer, pad_token_id=0)
    assert seen["inputs"] <= adapter.PREPARED_GENERATE_INPUTS and seen["streamer"] is streamer
    assert seen["cache"] is None or seen["cache"].get_seq_length() == 0


def test_touchpoint_generation_mode():
    assert GenerationConfig(do_sample=False).get_generation_mode() == adapter.GenerationMode.GREEDY_SEARCH
    assert GenerationConfig(do_sample=True).get_generation_mode() == adapter.GenerationMode.SAMPLE
    assert hasattr(adapter.GenerateDecoderOnlyOutput(sequences=torch.zeros(1, 1)), "sequences")


@pytest.fixture
def deprecations(caplog):
    """Deprecation warnings raised, and transformers' logged ones ('... is deprecated ...'), during the test."""
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()  # transformers logs each deprecation once per process: an earlier test may have had it
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="transformers"):
        warnings.simplefilter("always")
        found = []
        yield found
        found += [f"{w.category.__name__}: {w.message}" for w in caught
                  if issubclass(w.category, (DeprecationWarning, FutureWarning))
                  or re.search("deprecat", str(w.message), re.I)]
        found += [r.getMessage() for r in caplog.records if re.search("deprecat", r.getMessage(), re.I)]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_two_skip_sets_in_one_process_equal_hf_greedy_without_deprecations(compile, deprecations):
    """The 5.24 break: compiled steps crashed on the second call; our forwards warned of a deprecated keyword."""
    model = tiny_model("llama", seed=5, dtype=torch.float64)
    expected = hf_greedy(model, PROMPT, 16)
    deprecations.clear()
    options = dict(compile=True, compile_mode="regional", compile_backend="aot_eager") if compile else {}
    for skip in (SkipSet.of([1], [2], NUM_LAYERS), SkipSet.of([0, 3], [], NUM_LAYERS)):
        out = generate(model, PROMPT, skip=skip, max_new_tokens=16, policy=DraftPolicy(max_draft_tokens=3),
                       eos_token_id=None, **options)
        assert out.tokens == expected and out.stats.drafted > 0
    assert not deprecations


def test_custom_generate_equals_hf_greedy_without_deprecations(deprecations):
    model = tiny_model("llama", seed=6, dtype=torch.float64)
    expected = hf_greedy(model, PROMPT, 16)
    deprecations.clear()
    speculative = self_speculative(SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=3))
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                         pad_token_id=0, custom_generate=speculative)
    assert out[0, len(PROMPT):].tolist() == expected and speculative.stats.drafted > 0
    assert not deprecations
