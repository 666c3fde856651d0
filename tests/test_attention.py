"""The engine's attention (decode/attention.py): transformers' SDPA's output without repeating keys and values."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from skipsearch.decode import adapter, attention
from skipsearch.decode.attention import grouped_sdpa
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet

from conftest import tiny_model


class Heads(torch.nn.Module):
    """What an attention function reads from its module: the query heads per key/value head."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def inputs(width: int, heads: int = 9, kv_heads: int = 3, slots: int = 40, dim: int = 16, seed: int = 0):
    """A query (1, heads, width, dim) after transformers' transpose, a cache's keys and values, and the engine's
    boolean mask: causal over the slots from position 20, stale slots after it hidden."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, width, heads, dim, generator=generator, dtype=torch.float64).transpose(1, 2)
    key, value = (torch.randn(1, kv_heads, slots, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    positions = 20 + torch.arange(width)
    mask = (torch.arange(slots) <= positions[:, None]).view(1, 1, width, slots)
    return query, key, value, mask


@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("device_path", ["cpu", "folded", "cpu, fold=True", "folded, fold=False"])
def test_grouped_attention_gives_transformers_sdpa_output_without_repeating_keys(width, device_path, monkeypatch):
    """On a CPU SDPA's own grouped query, elsewhere the query heads folded, unless `fold` chooses the other way."""
    query, key, value, mask = inputs(width)
    module = Heads(groups=3)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, **kwargs):
        seen.append((q.shape, k.shape, kwargs.get("enable_gqa", False), kwargs["attn_mask"].shape))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    if device_path.startswith("folded"):  # the path of devices other than a CPU, run here on the CPU
        monkeypatch.setattr(attention, "_native_grouped_query", lambda device, dtype, head_dim: False)
    fold = {"cpu, fold=True": True, "folded, fold=False": False}.get(device_path)
    out, weights = grouped_sdpa(module, query, key, value, mask, scaling=0.25, fold=fold)
    assert weights is None and out.shape == (1, width, 9, 16)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    (q_shape, k_shape, native, mask_shape), = seen
    assert k_shape == (1, 3, 40, 16)  # the cache's own keys: 3 heads, not repeated to 9
    if device_path in ("cpu", "folded, fold=False"):
        assert native and q_shape == (1, 9, width, 16) and mask_shape == (1, 1, width, 40)
    else:  # three query heads share a key head: folded into 3 x width query rows, each fold with the mask's rows
        assert not native and q_shape == (1, 3, 3 * width, 16) and mask_shape == (1, 1, 3 * width, 40)


@pytest.mark.parametrize("device, dtype, head_dim, cudnn, native", [
    ("cpu", torch.float32, 64, False, True), ("cpu", torch.bfloat16, 256, False, True),
    ("cuda", torch.bfloat16, 128, True, True), ("cuda:1", torch.float16, 64, True, True),
    ("cuda", torch.bfloat16, 256, True, False), ("cuda", torch.bfloat16, 64, False, False),
    ("cuda", torch.float32, 64, True, False), ("mps", torch.bfloat16, 64, True, False)])
def test_the_grouped_query_goes_to_sdpa_where_a_kernel_takes_it_with_a_mask(device, dtype, head_dim, cudnn, native,
                                                                            monkeypatch):
    """A CPU's SDPA and, on CUDA, cuDNN's kernel in fp16 and bf16 with heads of up to 128 (where the device's answer
    says it runs) take the grouped query as it is; any other device, dtype or head size folds it (module doc)."""
    asked = []
    monkeypatch.setattr(attention, "_cudnn_attention_enabled", lambda index: asked.append(index) or cudnn)
    assert attention._native_grouped_query(torch.device(device), dtype, head_dim) is native
    cuda_asked = device.startswith("cuda") and dtype != torch.float32 and head_dim <= 128
    assert asked == ([torch.device(device).index] if cuda_asked else [])


@pytest.mark.parametrize("change, enabled", [(None, True), ("capability (8, 9)", False), ("capability (10, 0)", False),
                                             ("cuDNN's attention off", False), ("no cuDNN", False),
                                             ("ROCm", False), ("deterministic", False)])
def test_cuda_answers_for_cudnn_only_where_torch_tries_it_first(change, enabled, monkeypatch):
    """CUDA's answer, its queries faked: yes on a capability 9.0 GPU with cuDNN and its attention on, no on other
    capabilities (torch tries its math kernel, which copies the keys, before cuDNN's there), without cuDNN, on ROCm
    and where deterministic algorithms are asked for (cuDNN's attention refuses them)."""
    capability = {"capability (8, 9)": (8, 9), "capability (10, 0)": (10, 0)}.get(change, (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: change != "cuDNN's attention off")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: change != "no cuDNN")
    monkeypatch.setattr(torch.version, "hip", "6.4" if change == "ROCm" else None)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: change == "deterministic")
    assert attention._cudnn_attention_enabled(0) is enabled


def test_cudnn_is_asked_once_while_a_step_compiles_and_its_answer_kept(monkeypatch):
    """Under torch.compile the device's answer is a constant of the graph (no CUDA query traced into a step, no
    graph break): CUDA's queries, faked here, run while the step compiles, and not when it runs again."""
    asked = []
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: asked.append("enabled") or True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    step = torch.compile(lambda x: x * 2 if attention._native_grouped_query(torch.device("cuda", 1), torch.bfloat16,
                                                                            64) else x, fullgraph=True, backend="eager")
    for _ in range(3):
        torch.testing.assert_close(step(torch.ones(2)), torch.full((2,), 2.0))
    assert asked == ["enabled", 1]


def test_attention_way_says_how_the_steps_attend_on_the_models_device(monkeypatch):
    """A profile's provenance names the way its steps attended: grouped on a CPU, folded where the device's kernels
    need it, plain SDPA without grouped heads, and a model loaded with eager attention its own."""
    assert attention.attention_way(tiny_model()) == "SDPA's own grouped query"
    ungrouped = tiny_model()
    ungrouped.config.num_key_value_heads = 4
    assert attention.attention_way(ungrouped) == "SDPA, no grouped query"
    eager = tiny_model()
    eager.config._attn_implementation = "eager"
    assert attention.attention_way(eager) == "the model's own (eager)"
    monkeypatch.setattr(attention, "_native_grouped_query", lambda device, dtype, head_dim: False)
    assert attention.attention_way(tiny_model()) == "query heads folded into the query's rows, then SDPA"


@pytest.mark.parametrize("case", ["no mask", "one group", "soft cap", "per-head mask"])
def test_what_grouping_does_not_cover_runs_transformers_sdpa(case, monkeypatch):
    query, key, value, mask = inputs(3)
    module, kwargs = Heads(groups=3), {}
    if case == "no mask":
        mask = None
    elif case == "one group":
        module, key, value = Heads(groups=1), key.repeat_interleave(3, 1), value.repeat_interleave(3, 1)
    elif case == "soft cap":
        kwargs["softcap"] = 30.0
    else:
        mask = mask.expand(1, 9, 3, 40)
    calls = []
    monkeypatch.setattr(adapter, "sdpa_attention", lambda *a, **k: calls.append(k) or ("sdpa", None))
    assert grouped_sdpa(module, query, key, value, mask, scaling=0.25, **kwargs) == ("sdpa", None)
    assert calls == [dict(dropout=0.0, scaling=0.25, is_causal=None, **kwargs)]


def test_the_switch_holds_only_inside_and_only_from_sdpa():
    model = tiny_model()
    config = model.config
    switch = attention.engine_attention(model)
    with switch():
        assert config._attn_implementation == adapter.ENGINE_ATTENTION
        with switch():  # nested: left as it is, and the outer exit restores
            assert config._attn_implementation == adapter.ENGINE_ATTENTION
        assert config._attn_implementation == adapter.ENGINE_ATTENTION
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), switch():
        raise RuntimeError("a forward failed")
    assert config._attn_implementation == "sdpa"
    config._attn_implementation = "eager"
    with switch():
        assert config._attn_implementation == "eager"  # a model loaded with eager attention keeps it
    assert config._attn_implementation == "eager"


def test_threads_inside_the_switch_at_once_share_it():
    """The first caller in switches, the last one out switches back: a thread leaving never switches another's
    forward back mid-step (threads decoding on one model: test_custom_generate's concurrent calls)."""
    import threading

    model = tiny_model()
    switch = attention.engine_attention(model)
    inside, leave = threading.Barrier(2), threading.Event()
    seen = []

    def hold():
        with switch():
            inside.wait()
            leave.wait()
            seen.append(model.config._attn_implementation)

    thread = threading.Thread(target=hold)
    thread.start()
    with switch():
        inside.wait()  # both inside
    assert model.config._attn_implementation == adapter.ENGINE_ATTENTION  # this one left, the other is inside
    leave.set()
    thread.join()
    assert seen == [adapter.ENGINE_ATTENTION] and model.config._attn_implementation == "sdpa"
    assert not adapter._SWITCHED  # nothing held once every caller is out


def test_every_eager_step_attends_through_the_grouped_function(monkeypatch):
    model = tiny_model(dtype=torch.float64)
    prompt = list(range(3, 12))
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    widths = []
    real = grouped_sdpa

    def spy(module, query, *args, **kwargs):
        widths.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setitem(adapter.AttentionInterface._global_mapping, adapter.ENGINE_ATTENTION, spy)
    out = generate(model, prompt, skip=SkipSet.of([1], [], 4), max_new_tokens=12,
                   policy=DraftPolicy(max_draft_tokens=3, adaptive=False))
    assert out.tokens == expected
    assert model.config._attn_implementation == "sdpa"  # switched back after the call
    # The prefill (9 tokens), drafts and plain steps (1) and verifications (4), at every layer attending.
    assert {1, 4, len(prompt)} <= set(widths)
    assert widths.count(len(prompt)) == 4  # the prefill: once per layer


def test_choosing_among_skip_sets_attends_through_the_grouped_function(monkeypatch):
    """With several skip sets the prefill's last 16 tokens are drafted by each and verified (choice.py): those
    forwards attend as the steps do, and the model is left on SDPA."""
    model = tiny_model(dtype=torch.float64)
    prompt = list(range(3, 24))  # 21 tokens: 5 prefilled, then the 16-token window
    widths = []
    real = grouped_sdpa
    monkeypatch.setitem(adapter.AttentionInterface._global_mapping, adapter.ENGINE_ATTENTION,
                        lambda module, query, *args, **kwargs: widths.append(query.shape[2])
                        or real(module, query, *args, **kwargs))
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    out = generate(model, prompt, skip=[SkipSet.of([1], [], 4), SkipSet.of([2], [], 4)], max_new_tokens=6,
                   policy=DraftPolicy(max_draft_tokens=3, adaptive=False))
    assert out.tokens == expected and model.config._attn_implementation == "sdpa"
    assert widths.count(5) == 4  # the prompt's head, every layer
    assert widths.count(16) == 3 + 3 + 4  # each set's draft of the window (3 layers attend), then the full model's


def test_compiled_steps_attend_with_the_cache_unrepeated():
    """Regional compiled steps trace the grouped function: their graphs call SDPA with the cache's 2 key/value heads
    (grouped in the kernel), and no graph expands the keys to the 4 query heads."""
    model = tiny_model(dtype=torch.float64)
    prompt = list(range(3, 12))
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    out = generate(model, prompt, skip=SkipSet.of([1], [], 4), max_new_tokens=12,
                   policy=DraftPolicy(max_draft_tokens=3, adaptive=False), compile=True, compile_mode="regional",
                   compile_backend=recording)
    assert out.tokens == expected and model.config._attn_implementation == "sdpa"
    calls = [node for graph in graphs for node in graph.graph.nodes
             if node.target is torch.nn.functional.scaled_dot_product_attention]
    assert calls and all(node.kwargs.get("enable_gqa") for node in calls)
    assert all(node.args[1].meta["example_value"].shape[1] == 2 for node in calls)  # keys: the cache's 2 heads
