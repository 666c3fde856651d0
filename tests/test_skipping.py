import copy

import pytest
import torch

from conftest import tiny_model
from skipsearch.decode import adapter
from skipsearch.decode.adapter import decoder_layers
from skipsearch.decode.kvcache import SpeculativeCache
from skipsearch.decode.skipping import (SkippedLayer, ZeroAttention, ZeroFeedForward, draft_layers, draft_mode,
                                        draft_model)
from skipsearch.decode.skipset import SkipSet


def test_skip_set_sorts_and_validates():
    assert SkipSet.of([5, 1], [2], num_layers=6) == SkipSet(attn=(1, 5), mlp=(2,))
    assert SkipSet.of([1], [], 4).skipped_fraction(4) == 1 / 8


@pytest.mark.parametrize(
    "attn, mlp, message",
    [([4], [], "out of range"), ([-1], [], "out of range"), ([1, 1], [], "duplicates"),
     (["1"], [], "integers"), ([], [1.0], "integers"), ([True], [], "integers")],
)
def test_skip_set_rejects_bad_ids(attn, mlp, message):
    with pytest.raises(ValueError, match=message):
        SkipSet.of(attn, mlp, num_layers=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_draft_mode_changes_output_and_restores_model(arch):
    model = tiny_model(arch)
    ids = torch.tensor([[3, 7, 11, 5]])
    modules_before = [(layer.self_attn, layer.mlp) for layer in decoder_layers(model)]
    keys_before = list(model.state_dict())
    full = model(ids).logits
    with draft_mode(model, SkipSet.of([1], [2], 4)):
        assert isinstance(model.get_decoder().layers[1].self_attn, ZeroAttention)
        assert model.get_decoder().layers[1].mlp is decoder_layers(model)[1].mlp
        drafted = model(ids).logits
    assert not torch.allclose(full, drafted)
    assert [(layer.self_attn, layer.mlp) for layer in decoder_layers(model)] == modules_before
    assert list(model.state_dict()) == keys_before
    assert torch.equal(model(ids).logits, full)


def test_draft_mode_restores_model_on_exception():
    model = tiny_model()
    before = [(layer.self_attn, layer.mlp) for layer in decoder_layers(model)]
    with pytest.raises(RuntimeError, match="boom"), draft_mode(model, SkipSet.of([0, 3], [1], 4)):
        raise RuntimeError("boom")
    assert [(layer.self_attn, layer.mlp) for layer in decoder_layers(model)] == before


def test_skipping_everything_leaves_only_embeddings_norm_and_head():
    model = tiny_model()
    ids = torch.tensor([[3, 7, 11]])
    with draft_mode(model, SkipSet.of(range(4), range(4), 4)):
        drafted = model(ids).logits
    expected = model.lm_head(model.model.norm(model.model.embed_tokens(ids)))
    torch.testing.assert_close(drafted, expected)


def test_draft_path_is_built_once_per_skip_set_and_shares_the_weights():
    model = tiny_model()
    skip = SkipSet.of([0, 2], [2, 3], 4)
    layers = draft_layers(model, skip)
    originals = decoder_layers(model)
    assert draft_layers(model, SkipSet.of([2, 0], [3, 2], 4)) is layers
    # Each layer is the model's own (a copy of it where a sublayer is skipped), or the identity where both are.
    assert [type(layer) for layer in layers] == [type(originals[0]), type(originals[1]), SkippedLayer,
                                                 type(originals[3])]
    assert layers[1] is originals[1] and layers[0] is not originals[0] and layers[3] is not originals[3]
    assert isinstance(layers[0].self_attn, ZeroAttention) and layers[0].mlp is originals[0].mlp
    assert isinstance(layers[3].mlp, ZeroFeedForward) and layers[3].self_attn is originals[3].self_attn
    # The norm feeding only a skipped sublayer is skipped with it; the other stays the model's.
    assert isinstance(layers[0].input_layernorm, torch.nn.Identity)
    assert layers[0].post_attention_layernorm is originals[0].post_attention_layernorm
    assert isinstance(layers[3].post_attention_layernorm, torch.nn.Identity)
    assert layers[3].input_layernorm is originals[3].input_layernorm
    assert originals[0].self_attn is not layers[0].self_attn and isinstance(originals[0].input_layernorm,
                                                                            type(originals[0].post_attention_layernorm))
    view = draft_model(model, skip)
    assert view is draft_model(model, skip) and view.get_decoder().layers is layers
    assert model.get_decoder().layers is not layers  # the model itself is untouched
    assert {id(p) for p in view.parameters()} <= {id(p) for p in model.parameters()}
    ids = torch.tensor([[3, 7, 11]])
    with draft_mode(model, skip):
        expected = model(ids).logits
    torch.testing.assert_close(view(ids).logits, expected)


def test_a_skipped_attention_writes_no_cache():
    model = tiny_model(dtype=torch.float64)
    cache = SpeculativeCache(model.config, 8, "cpu", torch.float64)
    ids = torch.tensor([[3, 7, 11]])
    adapter.model_forward(draft_model(model, SkipSet.of([1], [2], 4)), ids, cache.positions(3),
                          cache.attention_mask(3), cache)
    written = [bool(layer.keys.abs().sum() > 0) for layer in cache.layers]
    assert written == [True, False, True, True]


def test_a_layer_class_without_known_norms_keeps_them_and_still_skips_exactly(monkeypatch):
    """An untested layer class runs the same path with every norm kept and no identity shortcut: only slower."""
    model = tiny_model(dtype=torch.float64)
    skip = SkipSet.of([0, 3], [1, 3], 4)
    with draft_mode(model, skip):
        known = model(torch.tensor([[3, 7, 11, 5]])).logits
    monkeypatch.delitem(adapter.SUBLAYER_NORMS, "LlamaDecoderLayer")
    layers = draft_layers(tiny_model(dtype=torch.float64), skip)
    assert not any(isinstance(layer, SkippedLayer) for layer in layers)
    assert isinstance(layers[3].self_attn, ZeroAttention) and isinstance(layers[3].mlp, ZeroFeedForward)
    assert not any(isinstance(module, torch.nn.Identity) for layer in layers for module in layer.children())
    model = tiny_model(dtype=torch.float64)
    with draft_mode(model, skip):
        torch.testing.assert_close(model(torch.tensor([[3, 7, 11, 5]])).logits, known)


def test_a_norm_after_a_skipped_sublayer_that_adds_a_bias_is_refused(monkeypatch):
    """OLMo 2 normalizes a sublayer's output: a norm with a bias there would add it even when the sublayer is skipped,
    so such a layer cannot skip it (an RMSNorm maps zeros to zeros, a LayerNorm to its bias)."""
    from conftest import family_model

    model = family_model("olmo2")
    layer = decoder_layers(model)[1]
    norm = torch.nn.LayerNorm(model.config.hidden_size)
    torch.nn.init.normal_(norm.bias)
    monkeypatch.setattr(layer, "post_attention_layernorm", norm)
    with pytest.raises(ValueError, match=r"Olmo2DecoderLayer.post_attention_layernorm maps zeros to non-zeros"):
        draft_layers(model, SkipSet.of([1], [], 4))
    draft_layers(model, SkipSet.of([], [1], 4))  # its feed-forward block still can be skipped


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_wrappers_equal_zeroed_sublayers(arch):
    """A skipped sublayer adds nothing to the residual stream: the same as zeroing its output projection."""
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.tensor([[3, 7, 11, 5]])
    skip = SkipSet.of([0, 3], [1, 3], 4)
    with draft_mode(model, skip):
        drafted = model(ids).logits
    with torch.no_grad():
        for i in skip.attn:
            decoder_layers(model)[i].self_attn.o_proj.weight.zero_()
        for i in skip.mlp:
            decoder_layers(model)[i].mlp.down_proj.weight.zero_()
    torch.testing.assert_close(drafted, model(ids).logits)


def test_skip_set_must_fit_the_model():
    with pytest.raises(ValueError, match="out of range"), draft_mode(tiny_model(), SkipSet(attn=(9,))):
        pass


def test_unsupported_model_is_a_clear_error():
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return self

    with pytest.raises(ValueError, match="not a supported decoder"):
        decoder_layers(NoLayers())


@pytest.mark.parametrize("change", ["layer", "norm", "sublayer"])
def test_a_draft_path_is_made_again_when_a_module_it_copied_is_replaced(change):
    """The draft path copies references to the model's layers, its decoder's children and their sublayers: after the
    user replaces one, the draft runs the new one (zeroed-sublayer logits of the model as it now is)."""
    from skipsearch.decode.families import zeroed_logits

    model, ids, skip = tiny_model("llama", seed=2), torch.tensor([[3, 7, 11, 5]]), SkipSet.of([1], [2], 4)
    draft_model(model, skip)(ids)
    with torch.no_grad():
        if change == "layer":
            model.model.layers[3] = copy.deepcopy(model.model.layers[3])
            model.model.layers[3].mlp.down_proj.weight.mul_(-3)
        elif change == "norm":
            model.model.norm = type(model.model.norm)(32)
            model.model.norm.weight.copy_(torch.linspace(-2, 2, 32))
        else:
            model.model.layers[1].mlp = copy.deepcopy(model.model.layers[1].mlp)
            model.model.layers[1].mlp.up_proj.weight.mul_(-3)
        torch.testing.assert_close(draft_model(model, skip)(ids).logits, zeroed_logits(model, ids, skip))
        with draft_mode(model, skip):
            torch.testing.assert_close(model(ids).logits, zeroed_logits(model, ids, skip))


def test_the_eager_draft_paths_keep_the_latest_sets_and_the_current_calls():
    """Eager calls over many skip sets keep the draft paths of the engine's bound of latest sets (and their trimmed
    heads) and free older ones; a call choosing among more sets keeps all of them."""
    import gc

    from skipsearch.decode.engine import DRAFT_STEPS_KEPT, engine_for
    from skipsearch.decode.loop import generate
    from skipsearch.decode.policy import DraftPolicy
    from skipsearch.decode.skipset import DraftHead

    model = tiny_model("llama", seed=9, num_layers=6)
    kwargs = dict(max_new_tokens=4, policy=DraftPolicy(max_draft_tokens=2, adaptive=False, guard=False),
                  eos_token_id=None)
    sets = [SkipSet.of([a], [m], 6, head=DraftHead(tuple(range(0, 90 - 6 * a - m)))) for a in range(6)
            for m in range(6)]
    for skip in sets:
        generate(model, [5, 9, 14], skip=skip, **kwargs)
    gc.collect()
    memo = model.__dict__["_skipsearch_drafts"]
    kept = [key[1] for key in memo if isinstance(key, tuple) and key[0] == "model"]
    assert kept == sets[-DRAFT_STEPS_KEPT:]
    assert len([key for key in memo if isinstance(key, tuple)]) == 2 * DRAFT_STEPS_KEPT
    assert set(memo["heads"].keys()) == {skip.head for skip in sets[-DRAFT_STEPS_KEPT:]}  # older heads freed
    engine_for(model).kept_skip_sets = 2  # the same bound as the compiled steps': lowering it frees at once
    assert [key[1] for key in memo if isinstance(key, tuple) and key[0] == "model"] == sets[-2:]
    generate(model, [5, 9, 14], skip=sets[:3], **kwargs)  # a choice among 3 sets, over a bound of 2
    assert {key[1] for key in memo if isinstance(key, tuple) and key[0] == "layers"} == {s.sublayers for s in sets[:3]}
