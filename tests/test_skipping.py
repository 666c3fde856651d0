import pytest
import torch

from conftest import tiny_model
from skipsearch.skipping import AttentionOnly, MLPOnly, SkippedLayer, SkipSet, decoder_layers, draft_layers, draft_mode, draft_model


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
        assert isinstance(model.get_decoder().layers[1], MLPOnly)
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
    assert draft_layers(model, SkipSet.of([2, 0], [3, 2], 4)) is layers
    assert [type(layer) for layer in layers] == [MLPOnly, decoder_layers(model)[1].__class__, SkippedLayer, AttentionOnly]
    # The norm feeding a skipped sublayer is skipped with it.
    assert layers[0].norm is decoder_layers(model)[0].post_attention_layernorm
    assert layers[3].norm is decoder_layers(model)[3].input_layernorm
    view = draft_model(model, skip)
    assert view is draft_model(model, skip) and view.get_decoder().layers is layers
    assert model.get_decoder().layers is not layers  # the model itself is untouched
    assert {id(p) for p in view.parameters()} <= {id(p) for p in model.parameters()}
    ids = torch.tensor([[3, 7, 11]])
    with draft_mode(model, skip):
        expected = model(ids).logits
    torch.testing.assert_close(view(ids).logits, expected)


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
