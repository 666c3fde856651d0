import pytest
import torch

from conftest import tiny_model
from skipsearch.skipping import SkippedAttention, SkipSet, decoder_layers, draft_mode


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
        assert isinstance(decoder_layers(model)[1].self_attn, SkippedAttention)
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


def test_skip_set_must_fit_the_model():
    with pytest.raises(ValueError, match="out of range"), draft_mode(tiny_model(), SkipSet(attn=(9,))):
        pass


def test_unsupported_model_is_a_clear_error():
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return self

    with pytest.raises(ValueError, match="not a supported decoder"):
        decoder_layers(NoLayers())
