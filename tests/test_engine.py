"""The engine's economy and the loop's host reads: what a study on a GPU depends on, checked on the CPU.

- regional steps: one compiled function per layer kind, shared by every layer and skip set, so a
  new skip set compiles nothing;
- a long study's memory stays flat (the draft steps of old skip sets are freed);
- the code path CUDA takes (`host_reads_stall`) reads back once per round, adaptive drafting
  included: it drafts the length it chose before the round.
"""

import collections
import copy
import gc
import io
import threading
import time
import weakref
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import tiny_model
from test_decoding import hf_greedy
from skipsearch.decode import engine as engine_module
from skipsearch.decode.adapter import decoder_layers
from skipsearch.decode import loop as decoding
from skipsearch.decode.controller import DraftController
from skipsearch.decode.engine import DRAFT_STEPS_KEPT, CompileSettings, engine_for
from skipsearch.decode.kvcache import SpeculativeCache
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.rounds import DecodeHooks
from skipsearch.decode.sampling import Sampling
from skipsearch.decode.skipset import SkipSet
from skipsearch.decode.steps import Step

NUM_LAYERS = 4
REGIONAL = dict(compile=True, compile_backend="aot_eager", compile_mode="regional")


class HostReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to the host, and the tensors made from host data (uploads):
    each one is a sync on CUDA."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__index__}
    UPLOADS = {torch.tensor, torch.as_tensor}

    def __init__(self):
        super().__init__()
        self.count = self.uploads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.count += 1
        if func in self.UPLOADS and args and not isinstance(args[0], torch.Tensor):
            self.uploads += 1
        return func(*args, **(kwargs or {}))


def test_compile_modes_resolve_per_device():
    assert CompileSettings().resolved(torch.device("cuda")) == "regional"
    assert CompileSettings().resolved(torch.device("cpu")) == "frozen"
    assert CompileSettings(backend="aot_eager").resolved(torch.device("cpu")) == "regional"
    assert CompileSettings(mode="default").resolved(torch.device("cuda")) == "default"


def test_frozen_and_regional_steps_get_the_graph_pool_and_frozen_ones_their_devices_inductor_settings():
    """Which steps `Step` would capture as CUDA graphs (those given the engine's graph pool, which only CUDA has: set
    here by hand), and what frozen steps compile with on each device: CUDA's wiring, read on a CPU (no step runs)."""
    model = tiny_model("llama", seed=8)
    engine = engine_for(model)
    engine.cache_for(16, CompileSettings())
    engine.graph_pool = pool = object()  # what `_fit_cache` makes on CUDA: torch.cuda.graph_pool_handle()
    skip = SkipSet.of([1], [], NUM_LAYERS)
    for mode, captured in [("frozen", True), ("regional", True), ("default", False), ("reduce-overhead", False)]:
        step = engine._compiled_step(skip, CompileSettings(mode=mode))
        assert (step.graph_pool is pool) == captured, mode
    assert engine._compiled_step(None, CompileSettings(mode="frozen")).inductor_config == engine_module.CPU_INDUCTOR_CONFIG
    assert engine_module.frozen_inductor_config(torch.device("cuda")) == {"freezing": True}
    assert engine._compiled_step(None, CompileSettings(mode="regional")).inductor_config == {}


def test_a_frozen_steps_set_up_keeps_inductors_autotuning_chatter_from_the_user():
    """While a frozen step compiles on a CPU, inductor's autotuning would print a line of stats for every GEMM (on by
    default), and torch warns that inductor's own code uses TypedStorage: neither reaches a user of `generate
    --compile` or `bench --compile` (both appeared in a Gemma 3 270M bench). Other warnings still do."""
    import warnings

    import torch._inductor.config

    stats_on = []

    def compiling(ids):  # what the step's first call sees of inductor's settings, and the warnings it raises
        stats_on.append(torch._inductor.config.max_autotune_report_choices_stats)
        warnings.warn("TypedStorage is deprecated. It will be removed in the future", UserWarning)
        warnings.warn("a warning of the model's own", UserWarning)
        return ids

    cache = SpeculativeCache(tiny_model("llama", seed=8).config, 16, "cpu", torch.float32)
    step = Step(compiling, cache, compiled=True,
                inductor_config=engine_module.frozen_inductor_config(torch.device("cpu")))
    assert torch._inductor.config.max_autotune_report_choices_stats  # inductor's default: on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.ones((1, 1), dtype=torch.long))
    assert stats_on == [False] and [str(warning.message) for warning in caught] == ["a warning of the model's own"]


def test_frozen_steps_read_a_static_position_at_every_call(monkeypatch):
    """On CUDA the cache's position has a static address (CUDA graphs read it in place), and freezing folds a static
    tensor that no graph writes into a constant: every frozen step writes the position, so it must stay an input.
    Here on a CPU, with the position marked static and CUDA's frozen settings (freezing alone), prompts of other
    lengths (steps at other positions) decode exactly."""
    monkeypatch.setattr(engine_module, "CPU_INDUCTOR_CONFIG", {"freezing": True})
    model = tiny_model("llama", seed=9)
    engine = engine_for(model)
    engine.cache_for(64, CompileSettings(mode="frozen"))
    torch._dynamo.mark_static_address(engine.cache.position)
    for prompt in ([5, 9, 14], list(range(2, 20)), [7]):
        out = generate(model, prompt, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=10,
                       policy=DraftPolicy(max_draft_tokens=3), eos_token_id=None, compile=True, compile_mode="frozen")
        assert out.tokens == hf_greedy(model, prompt, 10, eos=None) and out.stats.drafted > 0
    assert engine.cache.capacity == 256  # the one cache, whose position was marked: every call above used it


def test_regional_steps_compile_each_layer_kind_once_for_every_skip_set():
    """After the first skip set, new sets (whatever layers they skip, attention, MLP or both) compile nothing."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", seed=8)
    prompt, policy = [5, 9, 14, 3], DraftPolicy(max_draft_tokens=3)
    expected = hf_greedy(model, prompt, 12, eos=None)
    settings = dict(compile=True, compile_mode="regional")  # inductor: what a study runs on a CPU
    first = generate(model, prompt, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=12, policy=policy,
                     eos_token_id=None, **settings)
    assert first.tokens == expected and first.stats.compile_time_s > 0
    graphs = counters["stats"]["unique_graphs"]
    for attn, mlp in [([2], [1]), ([1, 2], [1, 2]), ([], [3]), ([0, 3], [2])]:
        out = generate(model, prompt, skip=SkipSet.of(attn, mlp, NUM_LAYERS), max_new_tokens=12, policy=policy,
                       eos_token_id=None, **settings)
        assert out.tokens == expected and out.stats.drafted > 0
    assert counters["stats"]["unique_graphs"] == graphs


def test_regional_graphs_outlive_the_cache_so_a_third_length_compiles_nothing():
    """A longer call replaces the engine's cache; the layer functions stay: the second length recompiles them once
    with the length dynamic, the third compiles nothing (a profile's contexts, a study's longer prompts), and each
    length decodes as plain greedy decoding does. At every length the first skip set's setup compiles every layer
    kind, so that a set of another kind (MLPs skipped where the first skipped attention) compiles nothing after it."""
    from torch._dynamo.utils import counters

    # Dynamo remembers per source function that a length changed (regional.py): start as a fresh process does.
    torch._dynamo.pgo.reset_code_state()
    model = tiny_model("llama", seed=9)
    model.config.max_position_embeddings = 1024  # default rotary embeddings: any position is computed alike
    first, other = SkipSet.of([1], [], NUM_LAYERS), SkipSet.of([], [2], NUM_LAYERS)
    new_graphs, capacities = [], []
    for length in (4, 300, 560):  # caches of 256, 512 and 768 slots
        prompt = [(7 * i + 3) % 90 + 2 for i in range(length)]
        expected = hf_greedy(model, prompt, 8, eos=None)
        for skip in (first, other):
            graphs = counters["stats"]["unique_graphs"]
            out = generate(model, prompt, skip=skip, max_new_tokens=8, policy=DraftPolicy(max_draft_tokens=3),
                           eos_token_id=None, **REGIONAL)
            assert out.tokens == expected and out.stats.drafted > 0
            new_graphs.append(counters["stats"]["unique_graphs"] - graphs)
        capacities.append(engine_for(model).cache.capacity)
    assert capacities == [256, 512, 768]
    assert new_graphs[0] > 0 and new_graphs[2] > 0 and new_graphs[4] == 0  # the first set: compiled, again, not
    assert new_graphs[1] == new_graphs[3] == new_graphs[5] == 0  # the other set: never


def test_a_long_study_keeps_memory_flat():
    """60 distinct skip sets through one engine: only the latest sets' draft steps and draft paths stay alive."""
    model = tiny_model("llama", seed=9, num_layers=6)
    policy = DraftPolicy(max_draft_tokens=2, adaptive=False)
    sets = [SkipSet.of([a], [m], 6) for a in range(6) for m in range(6)] + [SkipSet.of([a, b], [], 6)
                                                                           for a in range(6) for b in range(a + 1, 6)]
    steps, views = [], []
    for skip in sets[:60]:
        generate(model, [5, 9, 14], skip=skip, max_new_tokens=4, policy=policy, eos_token_id=None, **REGIONAL)
        engine = engine_for(model)
        steps.append(weakref.ref(engine.draft_steps[skip, CompileSettings("aot_eager", "regional")]))
        views.extend(weakref.ref(layer) for layer in model.__dict__["_skipsearch_drafts"]["layers", skip])
    gc.collect()
    assert len(engine.draft_steps) == DRAFT_STEPS_KEPT
    assert sum(ref() is not None for ref in steps) == DRAFT_STEPS_KEPT
    assert len(model.__dict__["_skipsearch_drafts"]) <= 2 * DRAFT_STEPS_KEPT
    # The wrappers of skipped sublayers die with their skip set (the model's own layers live on, shared).
    wrappers = [ref for ref in views if ref() is not None and not any(ref() is layer for layer in model.model.layers)]
    assert len(wrappers) <= DRAFT_STEPS_KEPT * 6


def test_the_bound_on_kept_skip_sets_is_settable_and_least_recently_used():
    model = tiny_model("llama", seed=10)
    engine = engine_for(model)
    with pytest.raises(ValueError, match="kept_skip_sets"):
        engine.kept_skip_sets = 0
    engine.kept_skip_sets = 2
    policy, settings = DraftPolicy(max_draft_tokens=2, adaptive=False), CompileSettings("aot_eager", "regional")
    a, b, c = SkipSet.of([1], [], NUM_LAYERS), SkipSet.of([2], [], NUM_LAYERS), SkipSet.of([], [1], NUM_LAYERS)
    for skip in (a, b, a, c):  # a used again after b: b is the least recently used when c comes
        generate(model, [5, 9, 14], skip=skip, max_new_tokens=4, policy=policy, eos_token_id=None, **REGIONAL)
    assert [key[0] for key in engine.draft_steps] == [a, c]
    assert ("layers", b) not in model.__dict__["_skipsearch_drafts"]
    engine.kept_skip_sets = 1  # lowering the bound frees at once
    assert [key[0] for key in engine.draft_steps] == [c] and (a, settings) not in engine.draft_steps


@pytest.mark.parametrize("policy", [DraftPolicy(max_draft_tokens=4, guard=False),
                                    DraftPolicy(max_draft_tokens=6, adaptive=False, guard=False),
                                    DraftPolicy(max_draft_tokens=5)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "regional"])
def test_the_cuda_path_reads_back_once_per_round(monkeypatch, policy, compiled):
    """With reads stalling the device (CUDA), a round reads back once, adaptive drafting included, and forwards
    of several tokens read nothing (masks and positions are built on the device); plain decoding reads once per
    batch of steps. Counted on the CPU through the same code. Eager steps run transformers' own code, counted too.
    The fixed extra reads of a call: one, the prefill's first token (a choice among several sets adds one more, all
    agreements at once: test_choice). The draft controller reads none: it plans from host numbers, times rounds
    with the host's clock between reads the rounds make anyway, and moves the cache's position by `seek` (a fill on
    the device)."""
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    model = tiny_model("qwen2", seed=10)
    prompt, n = [5, 9, 14, 3, 8], 30
    extra = REGIONAL if compiled else {}
    generate(model, prompt, skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=4, policy=policy, **extra)  # setup
    reads, decode = HostReads(), decoding._decode

    def counted(*args, **kwargs):  # the loop, from the prefill on (the API's checks of the prompt read it once)
        with reads:
            return decode(*args, **kwargs)

    monkeypatch.setattr(decoding, "_decode", counted)
    out = generate(model, prompt, skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=n, policy=policy,
                   eos_token_id=None, **extra)
    assert out.tokens == hf_greedy(model, prompt, n, eos=None)
    assert out.stats.drafted > 0 and reads.count == out.stats.rounds + 1  # and the prefill's first token
    assert reads.uploads == 0
    reads.count = 0
    plain = generate(model, prompt, max_new_tokens=n, eos_token_id=None, **extra)
    assert plain.tokens == out.tokens and reads.count == 1 + -(-(n - 1) // decoding.PLAIN_STEPS_PER_READ)


def test_own_code_copies_the_code_object_and_names_it_as_asked():
    """Each compiled function holds dynamo's graphs for its own code object (at most `recompile_limit`): a copy even
    when not renamed; renamed, dynamo's memory of what changes between calls is the name's own."""
    from skipsearch.decode.regional import own_code

    def step(x, y=2):
        return x * y

    copy, renamed = own_code(step), own_code(step, "_run_layer_7")
    assert copy.__code__ is not step.__code__ and copy.__name__ == "step" and copy(3) == 6
    assert renamed.__code__.co_name == renamed.__code__.co_qualname == renamed.__name__ == "_run_layer_7"
    assert renamed.__code__ is not copy.__code__ and renamed(3, 3) == 9


def test_another_models_regional_steps_leave_this_ones_static(monkeypatch):
    """Two models in one process with another norm epsilon: each engine's compiled layers learn what changes between
    their own calls only. Named alike, the second model's steps took its epsilon as a float input, uploaded at every
    layer's call (torch 2.11 and 2.15; sizes that differ would have turned dynamic alike)."""
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    first = tiny_model("qwen2", seed=11, rms_norm_eps=1e-5)
    generate(first, [5, 9, 14, 3, 8], skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=6, **REGIONAL)
    second, prompt = tiny_model("qwen2", seed=10, rms_norm_eps=1e-6), [5, 9, 14, 3, 8]
    generate(second, prompt, skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=4, **REGIONAL)  # compiles
    reads, decode = HostReads(), decoding._decode

    def counted(*args, **kwargs):  # the loop, from the prefill on (the API makes the prompt a tensor once)
        with reads:
            return decode(*args, **kwargs)

    monkeypatch.setattr(decoding, "_decode", counted)
    out = generate(second, prompt, skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=12, eos_token_id=None,
                   **REGIONAL)
    assert reads.uploads == 0 and out.tokens == hf_greedy(second, prompt, 12, eos=None)


def test_a_second_thread_waits_for_the_first_compiled_decode_of_the_same_model():
    """Compiled steps write the model's one cache: threads decoding one model at once read each other's keys and
    values, wrong tokens every time (four threads on this project's CPU: 20 of 20 calls, BENCHMARKS.md). The first
    thread's decode starts a second and gives it time to run in the middle of its own; the second must wait, and
    both decode what each decodes alone."""
    model, skip = tiny_model("llama", seed=13), SkipSet.of([1], [2], NUM_LAYERS)
    prompts = ([5, 9, 14, 3, 8], [7, 1, 1, 30, 2, 4, 11])
    alone = [generate(model, p, skip=skip, max_new_tokens=12, eos_token_id=None, **REGIONAL).tokens for p in prompts]
    assert alone[0] != alone[1]
    out, order = {}, []

    def decode(which: int, hooks=None):
        out[which] = generate(model, prompts[which], skip=skip, max_new_tokens=12, eos_token_id=None, hooks=hooks,
                              **REGIONAL).tokens
        order.append(which)

    second = threading.Thread(target=decode, args=(1,))

    def first_round(tokens):
        if not second.is_alive() and 1 not in out:
            second.start()
            second.join(timeout=1.0)  # without the engine's lock, the second decodes all of its tokens here

    decode(0, DecodeHooks(process=lambda ids, logits: logits, stop=lambda ids, m: None, commit=first_round))
    second.join()
    assert [out[0], out[1]] == alone and order == [0, 1]


def test_threads_starting_on_a_new_model_at_once_get_one_engine(monkeypatch):
    """Two engines for one model would be two locks over one model: two threads decoding it at once again. The checks
    that come before a new engine take time (here 0.2 s), in which a second thread used to make a second engine."""
    model = tiny_model("llama", seed=15)
    real_checks = engine_module.adapter.check_touchpoints

    def slow_checks(checked):
        time.sleep(0.2)
        return real_checks(checked)

    monkeypatch.setattr(engine_module.adapter, "check_touchpoints", slow_checks)
    engines = []
    threads = [threading.Thread(target=lambda: engines.append(engine_for(model))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(engines) == 2 and engines[0] is engines[1] is engine_for(model)


def test_a_compiled_decode_of_the_same_model_within_one_is_refused_and_an_eager_one_runs():
    """A call nested in a compiled decode of the same model (a hook that decodes) would overwrite its cache, and
    waiting for the lock would wait forever: it is refused in one line. An eager call makes a cache of its own."""
    model, prompt = tiny_model("llama", seed=14), [5, 9, 14, 3, 8]
    nested = []

    def decode_within(tokens):
        if not nested:
            nested.append(generate(model, prompt, max_new_tokens=4, eos_token_id=None).tokens)
            with pytest.raises(RuntimeError, match="compiled steps are in use in this thread already"):
                generate(model, prompt, max_new_tokens=4, eos_token_id=None, **REGIONAL)

    hooks = DecodeHooks(process=lambda ids, logits: logits, stop=lambda ids, m: None, commit=decode_within)
    outer = generate(model, prompt, max_new_tokens=6, eos_token_id=None, hooks=hooks, **REGIONAL).tokens
    assert outer == hf_greedy(model, prompt, 6, eos=None) and nested == [outer[:4]]
    assert generate(model, prompt, max_new_tokens=6, eos_token_id=None, **REGIONAL).tokens == outer  # released


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # inductor's: with the linears fused (fused.py)
def test_a_copy_of_a_model_decodes_with_steps_of_its_own_and_a_used_model_saves(backend):
    """The engine and the draft paths live on the model, and neither goes with a copy or a save: a deep copy of a
    model that had decoded ran the copy through the original's graphs and cache and decoded wrong tokens, and
    torch.save of it failed on the engine's steps. A copy's weights changed after the copy show which model ran."""
    model, prompt, skip = tiny_model("llama", seed=12), [5, 9, 14, 3, 8], SkipSet.of([1], [2], NUM_LAYERS)
    regional = {**REGIONAL, "compile_backend": backend}
    generate(model, prompt, skip=skip, max_new_tokens=8, eos_token_id=None, **regional)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.copy_(torch.roll(twin.lm_head.weight, 1, dims=0))
    expected = hf_greedy(twin, prompt, 8, eos=None)
    assert expected != hf_greedy(model, prompt, 8, eos=None)  # the test can tell the two models apart
    out = generate(twin, prompt, skip=skip, max_new_tokens=8, eos_token_id=None, **regional)
    assert out.tokens == expected and out.stats.drafted > 0
    assert engine_for(twin) is not engine_for(model) and engine_for(twin).model is twin
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert generate(loaded, prompt, skip=skip, max_new_tokens=8, eos_token_id=None,
                    **regional).tokens == hf_greedy(model, prompt, 8, eos=None)

@pytest.mark.parametrize("sampling", [Sampling(), Sampling(do_sample=True, top_k=20)], ids=["greedy", "sampling"])
def test_the_cuda_path_drafts_the_length_it_chose_before_each_round(monkeypatch, sampling):
    """Where reads stall the device, adaptive drafting reads no confidence: each round drafts the length the controller
    planned before it (`DraftController.plan`), all of it verified, one host read a round, sampling included; greedy
    output stays plain greedy decoding's."""
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    chosen, plan = [], DraftController.plan

    def recorded(self, room):
        chosen.append(plan(self, room))
        return chosen[-1]

    monkeypatch.setattr(DraftController, "plan", recorded)
    model = tiny_model("llama", seed=11, dtype=torch.float64)
    prompt, n = [5, 9, 14, 3], 60
    run = dict(skip=SkipSet.of([2], [1], NUM_LAYERS), max_new_tokens=n, eos_token_id=None, sampling=sampling,
               policy=DraftPolicy(max_draft_tokens=5, guard=False), generator=torch.Generator().manual_seed(0))
    generate(model, prompt, **run)  # setup
    chosen.clear()
    reads, decode = HostReads(), decoding._decode

    def counted(*args):
        with reads:
            return decode(*args)

    monkeypatch.setattr(decoding, "_decode", counted)
    out = generate(model, prompt, **run)
    assert collections.Counter(k + 1 for k in chosen) == out.stats.verify_sizes  # every draft planned was verified
    assert out.stats.verify_sizes[1] <= 1  # only the last round may have had no room for a draft
    assert len(set(chosen)) > 1  # the length follows the acceptance seen
    assert reads.count == out.stats.rounds + 1 and reads.uploads == 0
    if not sampling.do_sample:
        assert out.tokens == hf_greedy(model, prompt, n, eos=None)


def test_eager_attention_takes_the_additive_mask(compiled_prefill_on_cpu):
    """Models on transformers' eager attention get a float mask (added to the scores), SDPA ones a boolean one."""
    model = tiny_model("mistral", seed=12, dtype=torch.float64, sliding_window=6)
    model.config._attn_implementation = "eager"
    prompt = [5, 9, 14, 3]
    for extra in ({}, REGIONAL):
        out = generate(model, prompt, skip=SkipSet.of([1], [0], NUM_LAYERS), max_new_tokens=20,
                       policy=DraftPolicy(max_draft_tokens=3), eos_token_id=None, **extra)
        assert out.tokens == hf_greedy(model, prompt, 20, eos=None)
    assert engine_for(model).prefill_steps  # the regional run prefilled through its compiled widths


def test_models_with_full_and_sliding_layers_get_a_mask_per_layer_type(compiled_prefill_on_cpu):
    """Qwen2 with sliding windows on its upper layers only: the device-built masks come as a mapping by layer type,
    and decoding far past the window equals transformers' greedy output, eager and regional."""
    model = tiny_model("qwen2", seed=13, dtype=torch.float64, use_sliding_window=True, sliding_window=5,
                       max_window_layers=2)
    assert len(set(model.config.layer_types)) == 2
    prompt = [5, 9, 14, 3, 8, 2]
    for extra in ({}, REGIONAL):
        out = generate(model, prompt, skip=SkipSet.of([2], [1], NUM_LAYERS), max_new_tokens=24,
                       policy=DraftPolicy(max_draft_tokens=3), eos_token_id=None, **extra)
        assert out.tokens == hf_greedy(model, prompt, 24, eos=None)
    assert engine_for(model).prefill_steps  # the regional run prefilled through its compiled widths


def test_a_cpu_prefills_eagerly_in_the_regional_mode():
    model = tiny_model("llama", seed=11)
    engine, settings = engine_for(model), CompileSettings("aot_eager", "regional")
    steps = engine.steps_for(engine.cache_for(64, settings), None, settings, 1)
    assert steps.prefill.steps is None and not engine.prefill_steps
    assert engine_module.COMPILED_PREFILL_DEVICES == {"cuda"}
    out = generate(model, [5, 9, 14], skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=6, eos_token_id=None,
                   **REGIONAL)
    assert out.tokens == hf_greedy(model, [5, 9, 14], 6, eos=None) and not engine.prefill_steps


def test_a_compiled_prefill_whose_chunks_would_cross_longropes_switch_runs_as_one_forward(compiled_prefill_on_cpu):
    """Longrope decides a forward's frequencies by its last position: chunks (their padding counted) on the other
    side of the switch from the whole prompt would cache other keys than HF's one forward. Such a prompt is
    prefilled in one forward; the others in chunks, and every output is HF greedy's."""
    from conftest import family_model
    from test_decoding import _forward_spans

    switch = 24
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
            "original_max_position_embeddings": switch}
    model = family_model("phi3", seed=2, dtype=torch.float64, rope_parameters=rope, max_position_embeddings=512,
                         original_max_position_embeddings=switch)
    # 12: one chunk of 16, within the switch as the prompt is; 20: padded to 32, past it; 30 and 40: chunks of 16,
    # the first within it; 64: one chunk of 64 (the prompt's own forward), past it as the prompt is.
    for length, one_forward in ((12, False), (20, True), (30, True), (40, True), (64, True)):
        prompt = [(7 * i + length) % 90 + 2 for i in range(length)]
        spans, hook = _forward_spans(model)
        try:
            out = generate(model, prompt, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=6, eos_token_id=None,
                           **REGIONAL)
        finally:
            hook.remove()
        assert out.tokens == hf_greedy(model, prompt, 6, eos=None) and ((0, length - 1) in spans) == one_forward


def test_the_compiled_prefill_runs_any_prompt_length_at_its_fixed_widths(compiled_prefill_on_cpu):
    """Prompts of lengths around each width and over the widest (in chunks) decode as HF greedy does; after the
    widths are compiled, a prompt of a new length compiles nothing."""
    from torch._dynamo.utils import counters

    from skipsearch.decode.steps import PREFILL_WIDTHS

    model = tiny_model("llama", seed=11, dtype=torch.float64)
    model.config.max_position_embeddings = 1024  # room for a prompt over the widest width (rotary takes any length)
    skip, policy = SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=3)
    # The longest first: its cache (two blocks) then serves every call, and the steps compiled for it stay.
    lengths = [PREFILL_WIDTHS[-1] + 3, 1, PREFILL_WIDTHS[0], PREFILL_WIDTHS[0] + 1, PREFILL_WIDTHS[1] + 21]
    for n, length in enumerate(lengths):
        prompt = [(7 * i + n) % 90 + 2 for i in range(length)]
        out = generate(model, prompt, skip=skip, max_new_tokens=8, policy=policy, eos_token_id=None, **REGIONAL)
        assert out.tokens == hf_greedy(model, prompt, 8, eos=None), length
    widths = {key[0] for key, step in engine_for(model).prefill_steps.items() if step.setup_time_s is not None}
    assert widths == set(PREFILL_WIDTHS)  # every width ran, and nothing else
    graphs = counters["stats"]["unique_graphs"]
    out = generate(model, list(range(2, 42)), skip=skip, max_new_tokens=8, policy=policy, eos_token_id=None,
                   **REGIONAL)
    assert out.tokens == hf_greedy(model, list(range(2, 42)), 8, eos=None) and out.stats.compile_time_s == 0.0
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_prompt_is_prefilled_in_full_chunks_and_one_padded_under_the_narrowest_width():
    from skipsearch.decode.steps import PREFILL_WIDTHS, prefill_chunks

    assert prefill_chunks(109, (16, 64, 256)) == [(64, 64), (16, 16), (16, 16), (13, 16)]
    assert prefill_chunks(256, (16, 64, 256)) == [(256, 256)] and prefill_chunks(3, (16, 64, 256)) == [(3, 16)]
    for length in range(1, 3 * PREFILL_WIDTHS[-1]):
        chunks = prefill_chunks(length)
        assert sum(real for real, _ in chunks) == length and all(width in PREFILL_WIDTHS for _, width in chunks)
        assert all(real == width for real, width in chunks[:-1])  # only the last is padded
        assert chunks[-1][1] - chunks[-1][0] < PREFILL_WIDTHS[0]
        assert [width for _, width in chunks] == sorted((width for _, width in chunks), reverse=True)
    assert max(PREFILL_WIDTHS) <= engine_module.CACHE_BLOCK  # a padded chunk stays inside the cache's capacity


def test_the_prefill_writes_no_slot_it_keeps_past_the_prompt(compiled_prefill_on_cpu):
    """The padding's slots are stale once the prefill returns: the position is the prompt's length."""
    model = tiny_model("llama", seed=11)
    engine = engine_for(model)
    settings = CompileSettings("aot_eager", "regional")
    steps = engine.steps_for(engine.cache_for(64, settings), None, settings, 1)
    steps.cache.seek(0)
    assert steps.prefill.steps is not None  # compiled, at its widths
    logits = steps.prefill(torch.tensor([[5, 9, 14]]))
    assert int(steps.cache.position) == 3 and logits.shape == (1, model.config.vocab_size)
    torch.testing.assert_close(logits, model(torch.tensor([[5, 9, 14]])).logits[0, -1:])


def test_a_whole_compiled_step_traces_no_cache_wrapper(monkeypatch):
    """Dynamo warns once per process for each cached function it traces through: the model's forward looks up its
    cache keyword inside the trace, which must be a plain lookup (adapter.cache_keyword), not a functools cache."""
    import warnings

    import torch._dynamo.utils

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # warnings already given count again
    model = tiny_model("llama", seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, [5, 9, 14], skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=6, eos_token_id=None,
                       compile=True, compile_backend="aot_eager", compile_mode="default")
    assert out.tokens == hf_greedy(model, [5, 9, 14], 6, eos=None)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def test_a_compiled_step_does_not_recompile_when_another_family_is_used():
    """The cache keyword is a constant to compiled code: looking it up for another model class later (a second family
    in the process) must not invalidate the first model's compiled steps."""
    from torch._dynamo.utils import counters

    from skipsearch.decode import adapter

    model, other = tiny_model("llama", seed=4), tiny_model("qwen2", seed=4)
    decode = dict(skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=6, eos_token_id=None, compile=True,
                  compile_backend="aot_eager", compile_mode="default")
    generate(model, [5, 9, 14], **decode)
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    adapter.cache_keyword(other)
    adapter.cache_keyword(decoder_layers(other)[0])
    out = generate(model, [5, 9, 14], **decode)
    assert out.tokens == hf_greedy(model, [5, 9, 14], 6, eos=None) and out.stats.compile_time_s == 0.0
    assert counters["stats"]["unique_graphs"] == graphs and sum(counters["recompiles"].values()) == recompiles


def test_the_packed_head_computes_the_heads_logits_for_any_number_of_rows():
    """The verification's head on a CPU (packed.py): the same logits as the model's linear head, to fp32 rounding, for
    one row and for a round's worth, with and without a bias; None where it does not apply."""
    from skipsearch.decode.packed import PACKED_FROM_ROWS, PackedHead, packed_head

    torch.manual_seed(0)
    weight, bias = torch.randn(300, 48), torch.randn(300)
    for given in (None, bias):
        head = packed_head(weight, given)
        assert isinstance(head, PackedHead)  # a CPU build of torch with oneDNN (CI's) packs: a newer one must too
        for rows in (1, 3, 9):
            hidden = torch.randn(1, rows, 48)
            expected = torch.nn.functional.linear(hidden, weight, given)
            assert head(hidden).shape == (1, rows, 300)
            torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5)
    assert packed_head(weight.double(), None) is None  # measured and tested for float32 only
    for rows, kernel in ((PACKED_FROM_ROWS - 1, "aten::linear"), (PACKED_FROM_ROWS, "mkldnn::_linear_pointwise")):
        with torch.profiler.profile() as profile:
            head(torch.randn(1, rows, 48))
        assert kernel in {event.name for event in profile.events()}  # oneDNN from PACKED_FROM_ROWS rows on


def test_eager_verification_runs_the_packed_head_and_plain_steps_the_models_own(monkeypatch):
    from skipsearch.decode.packed import PackedHead

    model = tiny_model("llama", seed=3)  # float32: the packed path
    engine = engine_for(model)
    steps = engine.prepare(40, SkipSet.of([1], [], 4), None, 5)
    assert isinstance(engine.verifier.lm_head, PackedHead) and steps.verify is not steps.plain
    assert isinstance(model.lm_head, torch.nn.Linear)  # the model itself, which plain steps run, is untouched
    with mock.patch.object(PackedHead, "forward", autospec=True, side_effect=PackedHead.forward) as packed:
        steps.verify(torch.tensor([[5, 9, 14]]))
        steps.plain(torch.tensor([[3]]))
    assert packed.call_count == 1
    prompt = [5, 9, 14, 3, 7]
    out = generate(model, prompt, skip=SkipSet.of([1], [], 4), max_new_tokens=24, eos_token_id=None,
                   policy=DraftPolicy(max_draft_tokens=4, adaptive=False, guard=False))
    assert out.tokens == hf_greedy(model, prompt, 24, eos=None) and max(out.stats.verify_sizes) == 5
    unpacked = tiny_model("llama", seed=3)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    engine_for(unpacked).prepare(40, None, None, 5)
    assert engine_for(unpacked).verifier is unpacked


def test_the_head_copies_follow_the_models_head_when_it_changes():
    """The packed verification head and a trimmed draft head copy the LM head: a head loaded or trained in place, or a
    model cast, decodes as transformers does with the new head, and the draft reads the new head's rows."""
    from skipsearch.decode.skipping import draft_model
    from skipsearch.decode.skipset import DraftHead

    model, prompt = tiny_model("llama", seed=3), [5, 9, 14, 3, 7]  # float32: the verification's head packed
    skip = SkipSet((1,), (), DraftHead(tuple(range(0, 96, 2))))
    ids, rows = torch.tensor([prompt]), torch.tensor(skip.head.ids)
    policy = DraftPolicy(max_draft_tokens=4, adaptive=False, guard=False)
    # Written in place as load_state_dict or an optimizer step writes it (new tokens), then cast (the packed copy
    # raised a dtype error); each after a decode that made the copies.
    for change, new_tokens in ((lambda: model.lm_head.weight.mul_(-1), True), (lambda: model.double(), False)):
        before = generate(model, prompt, skip=skip, max_new_tokens=16, eos_token_id=None, policy=policy).tokens
        with torch.no_grad():
            change()
        out = generate(model, prompt, skip=skip, max_new_tokens=16, eos_token_id=None, policy=policy)
        assert out.tokens == hf_greedy(model, prompt, 16, eos=None) and out.stats.drafted > 0
        assert (out.tokens != before) == new_tokens
        with torch.no_grad():
            untrimmed = draft_model(model, SkipSet((1,)))(ids).logits
            torch.testing.assert_close(draft_model(model, skip)(ids).logits[..., rows], untrimmed[..., rows])


def test_a_regional_draft_step_is_made_again_when_its_trimmed_head_is_stale():
    """Compiled regional steps read the model's own weights, but a draft step's trimmed head is a copy: after the
    head changes in place, the draft step is made again from the new head (its drafts would only get worse: the
    verification reads the live weights)."""
    from skipsearch.decode.skipset import DraftHead

    model, prompt = tiny_model("llama", seed=4), [5, 9, 14, 3, 7]
    skip = SkipSet((1,), (), DraftHead(tuple(range(0, 96, 2))))
    policy = DraftPolicy(max_draft_tokens=4, adaptive=False, guard=False)
    engine = engine_for(model)
    for rounds in range(2):
        out = generate(model, prompt, skip=skip, max_new_tokens=12, eos_token_id=None, policy=policy, **REGIONAL)
        assert out.tokens == hf_greedy(model, prompt, 12, eos=None)
        [step] = [step for (drafted, _), step in engine.draft_steps.items() if drafted == skip]
        head = model._skipsearch_drafts["heads"][skip.head]  # what the draft step reads its rows from
        torch.testing.assert_close(head.weight, model.lm_head.weight.detach()[list(skip.head.ids)])
        if rounds == 0:
            first = step
            with torch.no_grad():
                model.lm_head.weight.mul_(-1)
    assert step is not first  # made again from the new head


@pytest.mark.parametrize("change", ["head", "norm", "layer", "hook", "assigned"])
def test_compiled_steps_follow_modules_hooks_and_weights_replaced_since_they_were_made(change):
    """A new LM head, final norm or decoder layer, a hook added to one layer's linear, or weights loaded into new
    memory (`load_state_dict(assign=True)`) after a compiled call: the next compiled call decodes with them, as
    transformers does (the steps had kept the old modules, skipped the hook, or on CUDA read freed memory), and the
    draft paths are made again."""
    from skipsearch.decode.skipping import draft_layers

    model, prompt = tiny_model("llama", seed=3), [5, 9, 14, 3, 7]
    skip, policy = SkipSet.of([1], [], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False, guard=False)
    kwargs = dict(skip=skip, max_new_tokens=12, eos_token_id=None, policy=policy)
    before = generate(model, prompt, **kwargs, **REGIONAL).tokens
    old_draft = draft_layers(model, skip)
    engine, old_step = engine_for(model), engine_for(model).draft_steps[skip, CompileSettings("aot_eager", "regional")]
    with torch.no_grad():
        if change == "head":
            new = torch.nn.Linear(32, 96, bias=False)
            new.weight.copy_(model.lm_head.weight.flip(0))
            model.set_output_embeddings(new)
        elif change == "norm":
            model.model.norm = type(model.model.norm)(32)
            model.model.norm.weight.copy_(torch.linspace(-2, 2, 32))
        elif change == "layer":
            model.model.layers[2] = copy.deepcopy(model.model.layers[2])
            model.model.layers[2].mlp.down_proj.weight.mul_(-3)
        elif change == "hook":
            model.model.layers[2].self_attn.v_proj.register_forward_hook(lambda module, args, out: -4 * out)
        else:
            model.load_state_dict({name: -tensor for name, tensor in model.state_dict().items()}, assign=True)
    expected = hf_greedy(model, prompt, 12, eos=None)
    assert expected != before
    assert generate(model, prompt, **kwargs, **REGIONAL).tokens == expected
    assert engine.draft_steps[skip, CompileSettings("aot_eager", "regional")] is not old_step
    assert draft_layers(model, skip) is not old_draft
    assert generate(model, prompt, **kwargs).tokens == expected


def test_an_unchanged_model_keeps_its_compiled_steps_across_calls():
    """The check costs a walk over the modules once a call: an unchanged model keeps every step (and a hook added and
    removed again between calls changes nothing)."""
    model, prompt = tiny_model("llama", seed=3), [5, 9, 14, 3, 7]
    kwargs = dict(skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=6, eos_token_id=None,
                  policy=DraftPolicy(max_draft_tokens=3, adaptive=False, guard=False))
    generate(model, prompt, **kwargs, **REGIONAL)
    steps = dict(engine_for(model).steps)
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out).remove()
    assert generate(model, prompt, **kwargs, **REGIONAL).stats.compile_time_s == 0
    assert all(engine_for(model).steps[key] is step for key, step in steps.items())


def test_a_calls_own_candidates_are_never_evicted_by_each_other():
    """A call choosing among more sets than the engine keeps keeps the steps of all of them: its later calls compile
    nothing (each candidate's step had evicted another's, and every call compiled again); a later call of fewer
    sets brings the engine back to its bound."""
    model, prompt = tiny_model("llama", seed=5, num_layers=6), [5, 9, 14, 3, 7, 11]
    candidates = [SkipSet.of([a], [], 6) for a in range(6)] + [SkipSet.of([], [m], 6) for m in range(3)]
    assert len(candidates) > DRAFT_STEPS_KEPT
    kwargs = dict(max_new_tokens=8, policy=DraftPolicy(max_draft_tokens=2, adaptive=False, guard=False),
                  eos_token_id=None, compile=True, compile_backend="aot_eager", compile_mode="default")
    expected = hf_greedy(model, prompt, 8, eos=None)
    assert generate(model, prompt, skip=candidates, **kwargs).tokens == expected
    engine = engine_for(model)
    steps = dict(engine.draft_steps)
    assert len(steps) == len(candidates)
    for _ in range(2):
        out = generate(model, prompt, skip=candidates, **kwargs)
        assert out.tokens == expected and out.stats.compile_time_s == 0
    assert all(engine.draft_steps[key] is step for key, step in steps.items())
    generate(model, prompt, skip=SkipSet.of([1], [1], 6), **kwargs)
    assert len(engine.draft_steps) == DRAFT_STEPS_KEPT
