"""The CUDA paths: the eager loop, the compiled steps as hand-captured CUDA graphs (regional mode, and the frozen
whole steps on request) and bf16.

Skipped where no GPU is visible (CI has none); `bash benchmarks/gpu.sh cuda-tests` runs them on a GPU machine.
"""

import functools

import pytest
import torch

from conftest import tiny_model
from test_decoding import hf_greedy
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import DraftHead, SkipSet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
NUM_LAYERS = 4
CASES = [(None, DraftPolicy()), (SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=4)),
         (SkipSet.of([0, 3], [], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False)),
         # A trimmed draft head (every other token of the 96), inside the captured draft graph.
         (SkipSet.of([1], [], NUM_LAYERS, DraftHead(tuple(range(0, 96, 2)))), DraftPolicy(max_draft_tokens=3))]


def cuda_model(seed, dtype=torch.float32):
    return tiny_model("llama", seed=seed, dtype=dtype).to("cuda")


@pytest.mark.parametrize("compiled,mode", [(False, None), (True, None), (True, "frozen")],
                         ids=["eager", "graphs", "frozen-graphs"])
def test_cuda_greedy_equals_hf_greedy(compiled, mode):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here: TF32 would round the two paths apart
    model = cuda_model(seed=3)
    prompt = [5, 9, 14, 3, 7]
    expected = hf_greedy(model, prompt, 24, eos=None)
    for skip, policy in CASES:
        out = generate(model, prompt, skip=skip, max_new_tokens=24, policy=policy, eos_token_id=None, compile=compiled,
                       compile_mode=mode)
        assert out.tokens == expected, (skip, policy)
        assert out.stats.rounds > 0 and (skip is None or out.stats.drafted > 0)
    # Plain decoding runs several steps per read-back on CUDA: an EOS inside them still ends the output there.
    eos = next(t for t in expected if t != expected[0])  # first met inside the steps after the prefill
    out = generate(model, prompt, max_new_tokens=24, eos_token_id=eos, compile=compiled, compile_mode=mode)
    assert out.tokens == hf_greedy(model, prompt, 24, eos=eos) == expected[: expected.index(eos) + 1]


def test_cuda_graphs_are_not_recompiled_across_prompts_and_rounds():
    from torch._dynamo.utils import counters

    model = cuda_model(seed=4)
    skip, policy = SkipSet.of([1], [0, 2], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False)
    first = generate(model, [5, 9, 14], skip=skip, max_new_tokens=12, policy=policy, eos_token_id=None, compile=True)
    assert first.stats.compile_time_s > 0
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in ([7], list(range(2, 40))):
            out = generate(model, prompt, skip=skip, max_new_tokens=20, policy=policy, eos_token_id=None, compile=True)
            assert out.tokens == hf_greedy(model, prompt, 20, eos=None) and out.stats.compile_time_s == 0.0
    assert counters["stats"]["unique_graphs"] == graphs


def test_cuda_bf16_decodes_and_times_with_synchronisation():
    model = cuda_model(seed=5, dtype=torch.bfloat16)
    skip, policy = SkipSet.of([1], [], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False)
    for compiled in (False, True):
        out = generate(model, [5, 9, 14], skip=skip, max_new_tokens=16, policy=policy, eos_token_id=None,
                       compile=compiled)
        assert len(out.tokens) == 16 and all(0 <= t < model.config.vocab_size for t in out.tokens)
        assert out.stats.wall_time_s > 0 and out.stats.accepted <= out.stats.drafted


def test_cuda_rounds_read_back_once_and_new_skip_sets_cost_no_compile():
    """After the first skip set, a new set's setup is a capture (well under a second) and its rounds sync once each,
    adaptive drafting included (torch.cuda's sync debug mode warns at every implicit sync)."""
    import warnings

    model = cuda_model(seed=6)
    prompt, policy = [5, 9, 14, 3], DraftPolicy(max_draft_tokens=4)
    generate(model, prompt, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=8, policy=policy, compile=True)
    for skip in (SkipSet.of([2], [1], NUM_LAYERS), SkipSet.of([], [0, 3], NUM_LAYERS)):
        out = generate(model, prompt, skip=skip, max_new_tokens=24, policy=policy, eos_token_id=None, compile=True)
        assert out.stats.compile_time_s < 1.0 and out.tokens == hf_greedy(model, prompt, 24, eos=None)
        on_device = torch.tensor(prompt, device="cuda")  # uploading a list would be one sync more
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = generate(model, on_device, skip=skip, max_new_tokens=24, policy=policy, eos_token_id=None,
                               compile=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # The first warning is torch's note that the debug mode is a prototype, not a synchronization.
        syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        # One read a round, the prefill's, and at most the two synchronizations that time the call.
        assert out.stats.drafted > 0 and len(syncs) <= out.stats.rounds + 3, [str(w.message) for w in syncs[:3]]


def test_cuda_memory_stays_flat_over_many_skip_sets():
    """Evicted skip sets free their graphs: memory after 30 distinct sets is what it was once the engine's bound
    (8 sets) had filled. What one set costs against the model's size is measured on real shapes by
    benchmarks/skip_set_setup.py (a tiny model's graphs round up to the allocator's blocks)."""
    import itertools

    model = cuda_model(seed=7)
    policy = DraftPolicy(max_draft_tokens=3, adaptive=False)
    subsets = [list(c) for n in (0, 1, 2) for c in itertools.combinations(range(NUM_LAYERS), n)]
    sets = [SkipSet.of(a, m, NUM_LAYERS) for a, m in itertools.product(subsets, subsets) if a or m][:30]
    assert len(set(sets)) == 30
    allocated = []
    for skip in sets:
        generate(model, [5, 9, 14], skip=skip, max_new_tokens=6, policy=policy, eos_token_id=None, compile=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[29] <= allocated[9] + 2**20, allocated


@pytest.mark.parametrize("fold", [None, False, True])
@pytest.mark.parametrize("width", [1, 5])
def test_cuda_grouped_attention_without_repeating_keys(width, fold):
    """On CUDA the engine's attention gives the grouped query heads to SDPA's own grouped query where cuDNN's kernel
    takes it (fp16 and bf16 on a capability 9.0 GPU, the leases' H100 and H200), and elsewhere (fp32 here) folds them
    into the query length; `fold`
    forces either way: transformers' SDPA's output every way, and the CPU's in float64 (CUDA's kernels are checked
    against no CUDA kernel alone), in float32 and in bfloat16 (where cuDNN's kernel may run); compiled in bf16 as
    the engine's steps are, with no graph break, the same output."""
    from test_attention import inputs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from skipsearch.decode import attention

    module = torch.nn.Module()
    module.num_key_value_groups = 3
    hopper = torch.cuda.get_device_capability() == (9, 0)
    exact, _ = sdpa_attention_forward(module, *inputs(width), scaling=0.25)  # on the CPU, in float64
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        query, key, value, mask = (t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda")
                                   for t in inputs(width))
        assert attention._native_grouped_query(query.device, dtype, 16) is (hopper and dtype == torch.bfloat16)
        out, _ = attention.grouped_sdpa(module, query, key, value, mask, scaling=0.25, fold=fold)
        expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(out.cpu().double(), exact, rtol=tolerance, atol=tolerance)
    step = torch.compile(functools.partial(attention.grouped_sdpa, module, scaling=0.25, fold=fold), fullgraph=True)
    torch.testing.assert_close(step(query, key, value, mask)[0], out, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 5])
def test_cuda_grouped_query_runs_as_cudnn_where_the_engine_gives_it_so(width, dtype):
    """Where the engine gives SDPA the grouped query as it is, cuDNN's kernel takes it: forced alone here, so that a
    fall back to the math kernel (which copies the keys, silently, at a fraction of the speed) raises; a layer like
    the engine's (9 query heads over 3 key/value heads of 64, 256 slots, its boolean mask), transformers' output."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from test_attention import inputs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from skipsearch.decode import attention

    query, key, value, mask = (t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda")
                               for t in inputs(width, dim=64, slots=256))
    if not attention._native_grouped_query(query.device, dtype, 64):
        pytest.skip(f"this GPU ({torch.cuda.get_device_name()}) folds the grouped query")
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out, _ = attention.grouped_sdpa(module, query, key, value, mask, scaling=0.125)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_cuda_attention_kernels_time_a_captured_graph_of_the_calls():
    """gpu.sh's attention stage times each way of attending as one CUDA graph of its calls: the first 3 run to warm,
    the graph is captured (capturing runs nothing) and replayed once before any timing, and each replay runs every
    call once."""
    from test_benchmarks import load_benchmark

    attention_kernels = load_benchmark("attention_kernels")
    counter = torch.zeros(1, device="cuda")
    replay = attention_kernels.runner([lambda: counter.add_(1)] * 5, torch.device("cuda"))
    assert float(counter) == 3 + 5  # warmed by the first 3 calls, captured, replayed once untimed
    replay()
    replay()
    assert float(counter) == 8 + 2 * 5


def test_cuda_attention_kernels_measure_every_way_on_a_gpu(capsys):
    """The stage's row on CUDA in bf16 (tiny shape): the engine's folded attention timed through captured graphs, and
    the unfolded, math and gqa ways agreeing with it to bf16's rounding."""
    import re
    import types

    from test_benchmarks import load_benchmark

    attention_kernels = load_benchmark("attention_kernels")
    args = types.SimpleNamespace(device="cuda", dtype="bfloat16", calls=3, repeats=2, ring_mb=1.0)
    config = attention_kernels.load_config(str(attention_kernels.CONFIGS / "tiny-llama.json"))
    attention_kernels.measure("tiny-llama", config, 256, 5, args)
    row = capsys.readouterr().out
    assert row.startswith("tiny-llama 256 slots 5 token(s): folded ")
    for method in ("unfolded", "math", "gqa"):
        difference = re.search(rf"(?<![-\w]){method} [\d.]+ ms \d+ GB/s .*? \(max diff ([\d.e+-]+)\)", row)
        assert difference and float(difference[1]) < 0.05, row


@torch.inference_mode()  # as decoding runs the steps
def test_cuda_fused_projections_launch_three_gemms_fewer_a_layer():
    """decode/fused.py on CUDA: inductor's pass makes a layer's query, key and value projections one GEMM and its gate
    and up projections another (counted on a CPU in tests/test_fused.py), so a captured plain step launches at least 3
    kernels fewer a layer than the unfused one; both decode as transformers."""
    from torch.profiler import ProfilerActivity, profile

    from skipsearch.decode.engine import CompileSettings, engine_for

    launches, settings, ids = {}, CompileSettings(mode="regional"), torch.ones((1, 1), dtype=torch.long, device="cuda")
    for fuse in (True, False):
        model = cuda_model(seed=5)
        engine = engine_for(model)
        engine.fuse_projections = fuse
        cache = engine.cache_for(32, settings)
        step = engine.steps_for(cache, None, settings, 1).plain
        step(ids)  # compiles and captures
        cache.seek(0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(ids)
            torch.cuda.synchronize()
        launches[fuse] = sum(event.device_type == torch.autograd.DeviceType.CUDA for event in prof.events())
        out = generate(model, [5, 9, 14], skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=8, eos_token_id=None,
                       compile=True)
        assert out.tokens == hf_greedy(model, [5, 9, 14], 8, eos=None)
    assert launches[False] - launches[True] >= 3 * NUM_LAYERS, launches
