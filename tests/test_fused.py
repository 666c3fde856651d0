"""The linears of one input fused in inductor's regional steps (decode/fused.py): one GEMM a group, the same tokens.

Each family's fused layer is checked against its own layer in tests/test_families.py; here the graph pass that
makes a group's GEMMs one, and the engine's steps compiled with it.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import tiny_model
from test_decoding import hf_greedy
from skipsearch.decode.engine import CompileSettings, engine_for
from skipsearch.decode.fused import SharedGemms
from skipsearch.decode.loop import generate
from skipsearch.decode.skipset import SkipSet

aten = torch.ops.aten
NUM_LAYERS = 4
INDUCTOR_REGIONAL = dict(compile=True, compile_mode="regional")


def _gemms(graph: torch.fx.Graph) -> int:
    return sum(node.target is aten.mm.default for node in graph.nodes)


def test_shared_gemms_keeps_one_gemm_of_equal_operands_until_a_tensor_is_written():
    """Two GEMMs of one input and one weight (each through views of its own, as a traced graph has them) become
    one; one of equal operands after an in-place write stays, since the write may have changed them; the graph
    computes what it did."""
    graph = torch.fx.Graph()
    x, w, out = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("out")

    def gemm():
        flat = graph.call_function(aten.view.default, (x, [2, 3]))
        return graph.call_function(aten.mm.default, (flat, graph.call_function(aten.permute.default, (w, [1, 0]))))

    first, again = gemm(), gemm()
    total = graph.call_function(aten.add.Tensor, (first, again))
    graph.call_function(aten.copy_.default, (out, total))
    after_write = gemm()
    graph.output((total, after_write))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = (torch.randn(1, 2, 3), torch.randn(4, 3), torch.zeros(2, 4))
    expected = [tensor.clone() for tensor in module(*[t.clone() for t in inputs])]
    assert _gemms(graph) == 3
    SharedGemms()(graph)
    graph.lint()
    module.recompile()
    assert _gemms(graph) == 2
    for got, want in zip(module(*[t.clone() for t in inputs]), expected):
        torch.testing.assert_close(got, want)


def test_shared_gemms_merges_nothing_in_a_graph_that_writes_a_computed_tensor():
    """Were two equal GEMMs merged and one then written in place, the write would reach the other: a graph that writes
    anything but its inputs is left as it is."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    first, again = (graph.call_function(aten.mm.default, (x, w)) for _ in range(2))
    graph.call_function(aten.add_.Tensor, (again, 1.0))
    graph.output(graph.call_function(aten.sub.Tensor, (first, again)))
    SharedGemms()(graph)
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert _gemms(graph) == 2 and torch.equal(module(torch.ones(2, 2), torch.ones(2, 2)), torch.full((2, 2), -1.0))


def _gemms_a_step(model) -> int:
    """GEMMs (matrix products) that one compiled plain step of `model` runs, by the profiler's count of operators."""
    engine, settings = engine_for(model), CompileSettings(mode="regional")
    cache = engine.cache_for(32, settings)
    step = engine.steps_for(cache, None, settings, 1).plain
    ids = torch.ones((1, 1), dtype=torch.long)
    with torch.inference_mode():
        step(ids)  # compiles
        cache.seek(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(ids)
    return sum(event.name in ("aten::mm", "aten::addmm") for event in prof.events())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: projections with biases
def test_inductors_regional_steps_run_four_gemms_a_layer_and_decode_as_transformers(arch):
    """Fused: the query, key and value projections one GEMM, gate and up another; with the down and output projections
    4 a layer, and the head 1 (7 a layer unfused). Greedy decoding through a draft stays transformers' own."""
    prompt, skip = [5, 9, 14, 3, 8], SkipSet.of([1], [2], NUM_LAYERS)
    fused, unfused = tiny_model(arch, seed=13), tiny_model(arch, seed=13)
    engine_for(unfused).fuse_projections = False
    assert (_gemms_a_step(fused), _gemms_a_step(unfused)) == (4 * NUM_LAYERS + 1, 7 * NUM_LAYERS + 1)
    out = generate(fused, prompt, skip=skip, max_new_tokens=10, eos_token_id=None, **INDUCTOR_REGIONAL)
    assert out.tokens == hf_greedy(fused, prompt, 10, eos=None) and out.stats.drafted > 0


def test_a_model_cast_after_decoding_is_fused_again():
    """Casting a model gives its linears weights of their own again: the engine sees the fused ones are no longer
    the model's, drops its steps and fuses anew, and decodes with the cast weights."""
    model, prompt = tiny_model("llama", seed=14), [5, 9, 14, 3, 8]
    generate(model, prompt, max_new_tokens=4, **INDUCTOR_REGIONAL)
    fusion = engine_for(model).layers["inductor"].fused
    assert fusion.intact()
    model.to(torch.float64)
    assert not fusion.intact()
    out = generate(model, prompt, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=8, eos_token_id=None,
                   **INDUCTOR_REGIONAL)
    assert out.tokens == hf_greedy(model, prompt, 8, eos=None)
    refused = engine_for(model).layers["inductor"].fused
    assert refused is not fusion and refused.intact() and refused.groups[0][1].weight.dtype == torch.float64


def test_fused_weights_keep_the_mode_the_model_was_made_in():
    """A model made in inference mode keeps inference tensors (its eager forward then ran into a view of a normal
    tensor and failed); a model made outside it keeps weights that train: a backward pass after fused decoding works."""
    prompt = [5, 9, 14, 3, 8]
    with torch.inference_mode():
        made_in_inference = tiny_model("llama", seed=15)
        generate(made_in_inference, prompt, max_new_tokens=4, **INDUCTOR_REGIONAL)
        assert hf_greedy(made_in_inference, prompt, 4, eos=None)  # the eager forward, on the fused weights
    assert made_in_inference.model.layers[0].self_attn.k_proj.weight.is_inference()
    trained = tiny_model("llama", seed=15)
    generate(trained, prompt, max_new_tokens=4, **INDUCTOR_REGIONAL)
    trained(torch.tensor([prompt])).logits.sum().backward()
    assert trained.model.layers[0].self_attn.k_proj.weight.grad is not None


def test_fused_steps_recompiled_with_the_length_dynamic_decode_as_transformers():
    """A longer prompt replaces the cache, and each layer's function recompiles with the length dynamic: the pass then
    sees symbolic sizes, and the fused steps still decode transformers' tokens."""
    from conftest import family_model

    model, lengths = family_model("llama", seed=3), []
    for length in (5, 300, 600):
        prompt = torch.randint(2, 90, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        out = generate(model, prompt, skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=6, eos_token_id=None,
                       **INDUCTOR_REGIONAL)
        assert out.tokens == hf_greedy(model, prompt, 6, eos=None)
        lengths.append(engine_for(model).cache.capacity)
    assert lengths == [256, 512, 768]


class Negated(torch.nn.Module):
    """A wrapper, as an adapter library puts around a projection."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -4 * self.inner(x)


@pytest.mark.parametrize("change", ["output projection replaced", "value projection wrapped", "key bias replaced"])
def test_a_model_changed_after_decoding_decodes_as_changed(change):
    """The fused copies hold the modules they were made from: a module replaced or wrapped, or a bias given anew, after
    decoding makes them stale, and the engine sees it (`intact`), fuses again and decodes the changed model."""
    model, prompt = tiny_model("qwen2", seed=16), [5, 9, 14, 3, 8]
    generate(model, prompt, max_new_tokens=4, **INDUCTOR_REGIONAL)
    fusion, attention = engine_for(model).layers["inductor"].fused, model.model.layers[1].self_attn
    before = hf_greedy(model, prompt, 10, eos=None)
    with torch.no_grad():
        if change == "output projection replaced":
            replaced = torch.nn.Linear(attention.o_proj.in_features, attention.o_proj.out_features, bias=False)
            replaced.weight.copy_(attention.o_proj.weight.flip(0) * 4)
            attention.o_proj = replaced
        elif change == "value projection wrapped":
            attention.v_proj = Negated(attention.v_proj)
        else:
            attention.k_proj.bias = torch.nn.Parameter(attention.k_proj.bias + 3.0)
    assert not fusion.intact()
    expected = hf_greedy(model, prompt, 10, eos=None)
    assert expected != before  # the change shows in the tokens
    out = generate(model, prompt, skip=SkipSet.of([2], [], NUM_LAYERS), max_new_tokens=10, eos_token_id=None,
                   **INDUCTOR_REGIONAL)
    assert out.tokens == expected and engine_for(model).layers["inductor"].fused.intact()


def test_a_saved_fused_model_fuses_again_in_place_and_a_hooked_linear_is_left_alone():
    """After torch.save and load a fused group's weights are one storage again: fused anew as it lies, no copy. A
    linear with a hook of its own keeps its group unfused (a fused copy would not run the hook)."""
    import io

    from skipsearch.decode.fused import FusedProjections, ProjectionSlice

    model = tiny_model("llama", seed=17)
    FusedProjections().layer(model.model.layers[0])
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    attention = loaded.model.layers[0].self_attn
    pointer = attention.q_proj.weight.data_ptr()
    fusion = FusedProjections()
    view = fusion.layer(loaded.model.layers[0])
    assert isinstance(view.self_attn.q_proj, ProjectionSlice) and fusion.groups[0].fused.weight.data_ptr() == pointer
    assert attention.q_proj.weight.data_ptr() == pointer and fusion.intact()
    loaded.model.layers[1].mlp.up_proj.register_forward_hook(lambda *args: None)
    view = fusion.layer(loaded.model.layers[1])
    assert isinstance(view.self_attn.k_proj, ProjectionSlice) and view.mlp is loaded.model.layers[1].mlp


def test_the_fused_copies_of_evicted_draft_layers_die_with_them():
    """What the fusion remembers of a draft path's layer copy (its children, for `intact`) holds the copy weakly: the
    copies of a skip set the engine evicted die, and the entries with them (they had piled up, 66 for 36 sets)."""
    import gc
    import weakref

    from skipsearch.decode.fused import FusedProjections
    from skipsearch.decode.skipping import draft_layers, forget_draft

    model, fusion, copies = tiny_model("llama", seed=1, num_layers=6), FusedProjections(), []
    for attn in range(6):
        for mlp in range(6):
            skip = SkipSet.of([attn], [mlp], 6)
            for layer in draft_layers(model, skip):  # what regional_view gives the fusion
                fusion.layer(layer)
                if not any(layer is own for own in model.model.layers):
                    copies.append(weakref.ref(layer))
            forget_draft(model, skip)  # what the engine's eviction does
    del layer
    gc.collect()
    assert len(copies) == 66 and not any(ref() is not None for ref in copies)
    assert len(fusion.layers) <= 6 and fusion.intact()
