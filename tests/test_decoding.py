from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from skipsearch.decode import adapter
from skipsearch.decode.controller import DraftController
from skipsearch.decode.divergence import Divergence, first_divergence, reference_logits
from skipsearch.decode.kvcache import SpeculativeCache
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.sampling import Sampling, rejection_sample as _rejection_sample
from skipsearch.decode.skipset import SkipSet
from skipsearch.decode.stats import DecodeStats

NUM_LAYERS = 4
MODELS = {arch: tiny_model(arch, seed=i, dtype=torch.float64) for i, arch in enumerate(["llama", "qwen2", "mistral"])}
WINDOW = 8
SLIDING = tiny_model("mistral", seed=7, dtype=torch.float64, sliding_window=WINDOW)


def hf_greedy(model, prompt, max_new_tokens, eos=1):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


layer_ids = st.lists(st.integers(0, NUM_LAYERS - 1), unique=True, max_size=NUM_LAYERS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(sorted(MODELS)),
    attn=layer_ids,
    mlp=layer_ids,
    prompt=st.lists(st.integers(2, 95), min_size=1, max_size=12),
    max_new_tokens=st.integers(1, 24),
    max_draft=st.integers(0, 7),
    adaptive=st.booleans(),
)
def test_greedy_self_speculative_equals_generate(arch, attn, mlp, prompt, max_new_tokens, max_draft, adaptive):
    model = MODELS[arch]
    policy = DraftPolicy(max_draft_tokens=max_draft, adaptive=adaptive)
    out = generate(model, prompt, skip=SkipSet.of(attn, mlp, NUM_LAYERS), max_new_tokens=max_new_tokens,
                   policy=policy, eos_token_id=1)
    assert out.tokens == hf_greedy(model, prompt, max_new_tokens)
    assert out.stats.new_tokens == len(out.tokens)
    assert 0 <= out.stats.accepted <= out.stats.drafted


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    attn=layer_ids,
    mlp=layer_ids,
    prompt=st.lists(st.integers(2, 95), min_size=1, max_size=12),
    max_draft=st.integers(0, 7),
    adaptive=st.booleans(),
)
def test_sliding_window_decoding_past_the_window_equals_generate(attn, mlp, prompt, max_draft, adaptive):
    """Full-length static layers and the model's sliding-window mask: exact far past the window (8 tokens)."""
    policy = DraftPolicy(max_draft_tokens=max_draft, adaptive=adaptive)
    out = generate(SLIDING, prompt, skip=SkipSet.of(attn, mlp, NUM_LAYERS), max_new_tokens=5 * WINDOW,
                   policy=policy, eos_token_id=None)
    assert out.tokens == hf_greedy(SLIDING, prompt, 5 * WINDOW, eos=None)


def test_sliding_window_is_in_effect():
    """The check above has teeth: without the window the same model decodes differently."""
    prompt = list(range(2, 14))
    windowed = generate(SLIDING, prompt, max_new_tokens=4 * WINDOW, eos_token_id=None).tokens
    SLIDING.config.sliding_window = None
    try:
        unwindowed = generate(SLIDING, prompt, max_new_tokens=4 * WINDOW, eos_token_id=None).tokens
    finally:
        SLIDING.config.sliding_window = WINDOW
    assert windowed != unwindowed


def test_autoregressive_path_drafts_nothing_and_matches_generate():
    model = MODELS["llama"]
    out = generate(model, [5, 9, 14], skip=None, max_new_tokens=20, eos_token_id=1)
    assert out.tokens == hf_greedy(model, [5, 9, 14], 20)
    assert out.stats.drafted == 0 and out.stats.rounds == len(out.tokens) - 1


def test_empty_skip_set_decodes_plainly():
    out = generate(MODELS["qwen2"], [5, 9, 14], skip=SkipSet(), max_new_tokens=20,
                   policy=DraftPolicy(max_draft_tokens=4, adaptive=False), eos_token_id=None)
    assert out.stats.drafted == 0 and out.stats.rounds == 19
    assert out.tokens == generate(MODELS["qwen2"], [5, 9, 14], skip=None, max_new_tokens=20, eos_token_id=None).tokens


def test_mean_accepted_tokens_counts_per_round_of_drafts():
    out = generate(MODELS["qwen2"], [5, 9, 14], skip=SkipSet.of([3], [], NUM_LAYERS), max_new_tokens=20,
                   policy=DraftPolicy(max_draft_tokens=4, adaptive=False), eos_token_id=None)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    sizes = out.stats.verify_sizes
    assert out.stats.mean_accepted_tokens == out.stats.accepted / sum(c for n, c in sizes.items() if n > 1)
    assert sum(sizes.values()) == out.stats.rounds and sum(n * c for n, c in sizes.items()) == out.stats.drafted + out.stats.rounds


def test_generation_stops_at_eos_like_generate():
    model = MODELS["llama"]
    plain = generate(model, [5, 9, 14], skip=None, max_new_tokens=20, eos_token_id=None).tokens
    eos = plain[6]
    first = plain.index(eos)
    out = generate(model, [5, 9, 14], skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=20, eos_token_id=[eos, 10_000],
                   policy=DraftPolicy(max_draft_tokens=5, adaptive=False))
    assert out.tokens == plain[: first + 1] == hf_greedy(model, [5, 9, 14], 20, eos=eos)


def test_adaptive_rounds_draft_fewer_where_drafts_are_rejected():
    """A set that skips everything is often wrong: the controller plans short rounds for it (and on a CPU cuts them at
    an unsure draft), where fixed drafting runs every round to the largest draft. The tokens are the same."""
    everything = SkipSet.of(range(NUM_LAYERS), range(NUM_LAYERS), NUM_LAYERS)
    run = dict(skip=everything, max_new_tokens=30, eos_token_id=None)
    adaptive = generate(MODELS["llama"], [5, 9, 14], policy=DraftPolicy(max_draft_tokens=4), **run)
    fixed = generate(MODELS["llama"], [5, 9, 14], policy=DraftPolicy(max_draft_tokens=4, adaptive=False), **run)
    assert adaptive.tokens == fixed.tokens and fixed.stats.acceptance_rate < 0.9
    assert adaptive.stats.drafted / adaptive.stats.rounds < fixed.stats.drafted / fixed.stats.rounds


@pytest.mark.parametrize("max_new_tokens", [5, 12, 13])
def test_every_forward_writes_at_its_first_position(max_new_tokens):
    """Each forward (draft, verify, prefill) writes the cache where its tokens sit, whatever the draft skipped."""
    model = tiny_model("llama", seed=1)
    seen = []

    def check(module, args, kwargs):
        cache, start = kwargs[adapter.cache_keyword(model.model)], int(kwargs["position_ids"][0, 0])
        assert int(cache.position) == start
        seen.append(start)

    handle = model.model.register_forward_pre_hook(check, with_kwargs=True)
    try:
        skip = SkipSet.of([1, 2], [0], NUM_LAYERS)
        for policy in [DraftPolicy(max_draft_tokens=3, adaptive=False), DraftPolicy()]:
            generate(model, [5, 9, 14, 3], skip=skip, max_new_tokens=max_new_tokens, policy=policy, eos_token_id=None)
    finally:
        handle.remove()
    assert len(seen) > max_new_tokens


def test_cache_rolls_back_by_position_and_hides_stale_slots():
    model = MODELS["llama"]
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    cache = SpeculativeCache(model.config, 16, "cpu")
    positions = torch.arange(16).view(1, -1)
    adapter.model_forward(model, ids, positions[:, :5], None, cache)
    # Junk written at positions 3..7 (a rejected draft), then a roll-back to 3 and the true tokens again.
    cache.seek(3)
    adapter.model_forward(model, torch.tensor([[90, 91, 92, 93, 94]]), positions[:, 3:8], None, cache)
    cache.seek(3)
    logits = adapter.model_forward(model, ids[:, 3:], positions[:, 3:5], None, cache)
    torch.testing.assert_close(logits, model(ids).logits[:, 3:])
    assert int(cache.layers[0].get_seq_length()) == 3  # the write position, not a count of writes
    with pytest.raises(ValueError, match="outside"):
        cache.seek(17)


@pytest.mark.parametrize("bad", [dict(max_draft_tokens=-1), dict(max_draft_tokens=2.0), dict(guard="yes"),
                                 dict(adaptive=1)])
def test_draft_policy_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        DraftPolicy(**bad)


def test_the_old_rules_fields_are_accepted_with_a_warning_and_ignored():
    with pytest.warns(FutureWarning, match=r"^DraftPolicy confidence_threshold, stop_rule: no longer used") as seen:
        policy = DraftPolicy(max_draft_tokens=4, confidence_threshold=0.9, stop_rule="cost")
    assert len(seen) == 1 and policy == DraftPolicy(max_draft_tokens=4)
    assert policy.as_dict() == {"max_draft_tokens": 4, "adaptive": True}
    assert DraftPolicy.from_dict({"max_draft_tokens": 4, "threshold_step": 0.05}) == policy  # a stored study's


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        Sampling(do_sample=True, **bad)


def test_generate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(MODELS["llama"], [3], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        generate(MODELS["llama"], [], max_new_tokens=3)


def test_stats_rates_and_sum():
    stats = DecodeStats(new_tokens=10, rounds=4, drafted=8, accepted=6, wall_time_s=2.0, verify_sizes=Counter({3: 4}))
    # A plain step (the guard's, say) verifies no drafts: it is no round of them, so the mean stays 6 / 4.
    stats.add(DecodeStats(new_tokens=2, rounds=1, drafted=0, accepted=0, wall_time_s=1.0, verify_sizes=Counter({1: 1})))
    assert (stats.acceptance_rate, stats.mean_accepted_tokens, stats.tokens_per_second) == (0.75, 1.5, 4.0)
    assert DecodeStats().acceptance_rate is None and DecodeStats().mean_accepted_tokens is None  # nothing drafted
    stats.add(DecodeStats(wall_time_s=2.5, compile_time_s=2.5))
    assert stats.compile_time_s == 2.5 and stats.tokens_per_second == 4.0  # compiling is not decoding


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def test_rejection_sampling_keeps_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1], [0.2] * 5])
    draft = torch.tensor([[0.05, 0.05, 0.1, 0.3, 0.5], [0.2] * 5])  # far from the target on purpose
    firsts, seconds_after_zero = [], []
    for _ in range(12_000):
        drafts = torch.multinomial(draft, 1, generator=generator).view(-1)
        _, tokens, _ = _rejection_sample(drafts, draft, target, generator)
        firsts.append(tokens[0])
        if tokens[0] == 0 and len(tokens) > 1:
            seconds_after_zero.append(tokens[1])
    assert total_variation(torch.tensor(firsts), target[0]) < 0.02
    # The committed second token must follow target row 1 (this toy target does not depend on the first).
    assert total_variation(torch.tensor(seconds_after_zero), target[1]) < 0.05
    # The check has teeth: the draft's own distribution is far from the target.
    assert 0.5 * (draft[0] - target[0]).abs().sum() > 0.5


def test_rejection_sampling_never_accepts_a_draft_the_full_model_gives_no_probability(monkeypatch):
    """torch.rand draws from [0, 1), 0 included (about once in 2^24): even then a token of probability 0 under the
    full model (outside its top-k or top-p, say) is rejected, and one it gives any probability is accepted."""
    target = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    draft = torch.tensor([[0.9, 0.05, 0.05]])
    monkeypatch.setattr(torch, "rand", lambda k, **kwargs: torch.zeros(k))  # the draw that accepted it
    accepted, tokens, _ = _rejection_sample(torch.tensor([0]), draft, target, None)
    assert accepted == 0 and tokens[0] in (1, 2)
    accepted, tokens, _ = _rejection_sample(torch.tensor([1]), draft, target, None)
    assert accepted == 1 and tokens[0] == 1


def second_token_marginal(model, prompt):
    """Exact p(x2 | prompt) = sum over x1 of p(x1 | prompt) p(x2 | prompt, x1)."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        ids = torch.tensor([prompt + [x1] for x1 in range(first.numel())])
        second = torch.softmax(model(ids).logits[:, -1].double(), -1)
    return first @ second


def assert_sampling_follows_the_full_model(model, skip, runs=2000):
    """Sampled self-speculative decoding's second token follows the full model's exact marginal, though the draft's
    own marginal is far from it (the check has teeth). A model of vocabulary 8, so that the marginal is exact."""
    from skipsearch.decode.skipping import draft_mode

    expected = second_token_marginal(model, [2])
    with draft_mode(model, skip):
        draft_marginal = second_token_marginal(model, [2])
    generator = torch.Generator().manual_seed(1)
    seconds, drafted = [], 0
    for _ in range(runs):
        out = generate(model, [2], skip=skip, max_new_tokens=3, sampling=Sampling(do_sample=True, temperature=1.0),
                       eos_token_id=None, policy=DraftPolicy(max_draft_tokens=1, adaptive=False), generator=generator)
        seconds.append(out.tokens[1])
        drafted += out.stats.drafted
    assert drafted == runs  # every 2nd token went through draft + verify
    assert total_variation(torch.tensor(seconds), expected) < 0.05
    assert 0.5 * (draft_marginal - expected).abs().sum() > 0.2


def test_sampled_generation_follows_the_full_model():
    assert_sampling_follows_the_full_model(tiny_model("llama", seed=5, vocab_size=8), SkipSet.of([0, 2], [1, 3], NUM_LAYERS))


SLIDING_WINDOW = 6
WINDOWED = tiny_model("mistral", seed=5, dtype=torch.float64)
WINDOWED.config.sliding_window = SLIDING_WINDOW


def test_the_sliding_window_changes_greedy_output():
    """Guards the next test: with this window, HF greedy past it differs from full attention, so the window is real."""
    full = tiny_model("mistral", seed=5, dtype=torch.float64)
    full.config.sliding_window = None
    prompt = list(range(2, 6))
    assert hf_greedy(WINDOWED, prompt, 30, eos=None) != hf_greedy(full, prompt, 30, eos=None)


@pytest.mark.parametrize("attn, mlp", [([1], []), ([1, 2], [2]), ([0, 1, 2, 3], []), ([3], [0, 1, 2, 3])])
@pytest.mark.parametrize("max_draft, adaptive", [(1, False), (3, False), (7, False), (5, True)])
@pytest.mark.parametrize("prompt", [[5, 9, 2], list(range(10, 24))], ids=["short-prompt", "prompt-past-window"])
def test_sliding_window_model_decodes_past_its_window_like_generate(attn, mlp, max_draft, adaptive, prompt):
    """Roll-back past a sliding window (drafts and rejected verify tokens leave it) must keep exact greedy output."""
    max_new_tokens = 5 * SLIDING_WINDOW
    policy = DraftPolicy(max_draft_tokens=max_draft, adaptive=adaptive)
    out = generate(WINDOWED, prompt, skip=SkipSet.of(attn, mlp, NUM_LAYERS), max_new_tokens=max_new_tokens,
                   policy=policy, eos_token_id=None)
    assert out.tokens == hf_greedy(WINDOWED, prompt, max_new_tokens, eos=None)
    assert out.stats.drafted > out.stats.accepted  # some drafts were rejected, so the cache was rolled back
COMPILED = dict(compile=True, compile_backend="aot_eager")


@pytest.mark.parametrize("arch", ["llama", "sliding"])
def test_compiled_greedy_equals_generate(arch):
    model = SLIDING if arch == "sliding" else tiny_model("llama", seed=3, dtype=torch.float64)
    prompt = [5, 9, 14, 3, 7]
    expected = hf_greedy(model, prompt, 3 * WINDOW, eos=None)
    for skip, policy in [(None, DraftPolicy()), (SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=4, guard=False)),
                         (SkipSet.of([0, 3], [], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False, guard=False))]:
        out = generate(model, prompt, skip=skip, max_new_tokens=3 * WINDOW, policy=policy, eos_token_id=None, **COMPILED)
        assert out.tokens == expected
        eager = generate(model, prompt, skip=skip, max_new_tokens=3 * WINDOW, policy=policy, eos_token_id=None)
        assert eager.tokens == expected
        if not policy.adaptive:  # adaptive rounds follow the rounds' times, and a compiled step's first is untimed
            assert (out.stats.drafted, out.stats.accepted, out.stats.verify_sizes) == (
                eager.stats.drafted, eager.stats.accepted, eager.stats.verify_sizes)


def test_compiled_steps_do_not_recompile_across_prompts_and_rounds():
    from torch._dynamo.utils import counters

    model = tiny_model("llama", seed=4, dtype=torch.float64)
    skip, policy = SkipSet.of([1], [0, 2], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False)
    first = generate(model, [5, 9, 14], skip=skip, max_new_tokens=12, policy=policy, eos_token_id=None, **COMPILED)
    assert first.stats.compile_time_s > 0 and first.stats.rounds > 1
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in ([7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], list(range(2, 40))):
            out = generate(model, prompt, skip=skip, max_new_tokens=20, policy=policy, eos_token_id=None, **COMPILED)
            assert out.tokens == hf_greedy(model, prompt, 20, eos=None)
            assert out.stats.compile_time_s == 0.0
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_sampling_follows_the_same_path_as_eager():
    model = tiny_model("llama", seed=5, dtype=torch.float64)
    skip, sampling = SkipSet.of([0], [3], NUM_LAYERS), Sampling(do_sample=True, temperature=0.8, top_k=20)
    outs = [generate(model, [4, 8], skip=skip, max_new_tokens=16, sampling=sampling, eos_token_id=None,
                     policy=DraftPolicy(max_draft_tokens=3, adaptive=False, guard=False),
                     generator=torch.Generator().manual_seed(11), **extra).tokens for extra in ({}, COMPILED)]
    assert outs[0] == outs[1]  # the same random draws on the same distributions


def test_first_divergence_reports_the_position_and_the_top2_gap():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.5, 0.0], [1.0, 0.0, 0.0]])
    assert first_divergence([1, 1, 0], [1, 1, 0], logits) is None
    assert first_divergence([1, 1, 0], [1, 0, 0], logits) == Divergence(1, 0.5)
    assert first_divergence([1, 1, 0], [1, 1], logits) == Divergence(2, 1.0)
    assert first_divergence([1], [1, 2], logits[:1]).position == 1


def test_reference_logits_predict_each_reference_token():
    model = MODELS["llama"]
    prompt = [5, 9, 14]
    tokens = hf_greedy(model, prompt, 6, eos=None)
    logits = reference_logits(model, prompt, tokens)
    assert logits.shape[0] == len(tokens) and logits.argmax(-1).tolist() == tokens


def test_a_process_compiles_more_skip_sets_than_dynamos_recompile_limit():
    """Each compiled step has its own code object: a study's many skip sets never hit dynamo's per-code limit."""
    from skipsearch.decode.engine import engine_for

    model = tiny_model("llama", seed=6, dtype=torch.float64)
    policy = DraftPolicy(max_draft_tokens=2, adaptive=False)
    skips = [SkipSet.of([layer], [], NUM_LAYERS) for layer in range(NUM_LAYERS)]
    with torch._dynamo.config.patch(recompile_limit=2):
        for skip in skips:
            out = generate(model, [5, 9, 14], skip=skip, max_new_tokens=6, policy=policy, eos_token_id=None, **COMPILED)
            assert out.tokens == hf_greedy(model, [5, 9, 14], 6, eos=None)
            assert out.stats.compile_time_s > 0
    assert [key[1] for key in engine_for(model).steps if key[0] == "draft"] == skips  # one compiled step per set


def test_cpu_inductor_freezes_weights_and_autotunes_gemms_and_decodes_exactly():
    """The CPU default for inductor (what `--compile` runs) is timed in benchmarks/engine_speed.py; here it must take
    effect (weights frozen and prepacked, linears of one input concatenated, GEMMs generated from inductor's C++
    template) and be exact."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", seed=7, num_layers=2)
    prompt = [5, 9, 14, 3]
    expected = hf_greedy(model, prompt, 10, eos=None)
    for skip in (None, SkipSet.of([1], [], 2)):
        counters["inductor"].clear()
        out = generate(model, prompt, skip=skip, max_new_tokens=10, policy=DraftPolicy(max_draft_tokens=3),
                       eos_token_id=None, compile=True)
        assert out.tokens == expected and out.stats.compile_time_s > 0
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0  # frozen, prepacked weights
        assert counters["inductor"]["cpp_templated_kernel_counter"] > 0  # GEMMs from inductor's C++ template
        if skip is None:  # one graph, the plain step: query/key/value and gate/up concatenated, 4 GEMMs a layer
            assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 4 * 2 + 1  # and the head


def test_plain_decoding_reads_tokens_back_once_per_several_steps_and_stops_at_eos(monkeypatch):
    """On CUDA plain decoding runs several steps per host read-back; here the CPU is told to, and must stay exact."""
    from unittest import mock

    from skipsearch.decode import loop as decoding

    assert not decoding.host_reads_stall(torch.device("cpu"))  # a CPU read waits for nothing: no steps past EOS
    assert decoding.host_reads_stall(torch.device("cuda")) and decoding.PLAIN_STEPS_PER_READ == 8
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    model = MODELS["mistral"]
    prompt, n = [5, 9, 14], 20
    with mock.patch.object(decoding, "_plain_steps", wraps=decoding._plain_steps) as batches:
        out = generate(model, prompt, skip=None, max_new_tokens=n, eos_token_id=None)
    assert out.tokens == hf_greedy(model, prompt, n, eos=None)
    assert batches.call_count == 3  # 19 tokens after the prefill's: 8 + 8 + 3
    assert out.stats.rounds == n - 1 and sum(out.stats.verify_contexts.values()) == n - 1
    # An EOS inside a batch of steps ends the output there, as HF's does.
    eos = next(t for t in out.tokens if t != out.tokens[0])  # first met after the prefill's token
    at = out.tokens.index(eos)
    timed, observe = [], DraftController.observe

    def observed(self, drafted, accepted, tokens, seconds, *rest):
        timed.append(seconds is not None)
        return observe(self, drafted, accepted, tokens, seconds, *rest)

    monkeypatch.setattr(DraftController, "observe", observed)
    stopped = generate(model, prompt, skip=None, max_new_tokens=n, eos_token_id=eos)
    assert stopped.tokens == hf_greedy(model, prompt, n, eos=eos) == out.tokens[: at + 1]
    assert stopped.stats.rounds == min(n - 1, 8 * -(-at // 8))  # the steps past the EOS ran, and are counted
    # Their time is not the kept tokens': that batch is not timed (plain speed would read up to 8x too slow).
    assert timed == [True] * (-(-at // 8) - 1) + [at % 8 == 0]


def _forward_spans(model):
    """Every forward's first and last position, as the rotary embedding sees them (a hook on it); its handle."""
    spans = []

    def record(module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        spans.append((int(positions.min()), int(positions.max())))

    return spans, model.get_decoder().rotary_emb.register_forward_pre_hook(record, with_kwargs=True)


def _crossing(spans, bound):
    """The forwards whose first position's length is within `bound` and whose last one's is past it."""
    return [(first, last) for first, last in spans if first + 1 <= bound < last + 1]


# The regional steps compile each layer and leave the model's own forward, and so its rotary embedding, eager.
BOUNDED = {"eager": {}, "compiled": dict(compile=True, compile_backend="aot_eager", compile_mode="regional")}


@pytest.mark.parametrize("how", sorted(BOUNDED))
def test_drafting_ends_before_the_context_and_equals_hf_greedy(how):
    """A prompt plus max_new_tokens that fill the context decode with drafts, and no forward (a verification at its
    padded width included) reaches past the context: near its end the rounds draft fewer, then none."""
    model = MODELS["llama"]  # a context of 256
    prompt = [5, 9, 14, 3, 22]  # rounds that end where an unbounded compiled verification would reach 257
    spans, hook = _forward_spans(model)
    try:
        out = generate(model, prompt, skip=SkipSet.of([1], [2], NUM_LAYERS), max_new_tokens=251,
                       policy=DraftPolicy(max_draft_tokens=6, adaptive=False, guard=False), eos_token_id=None,
                       **BOUNDED[how])
    finally:
        hook.remove()
    assert out.tokens == hf_greedy(model, prompt, 251, eos=None)
    assert out.stats.drafted > 0 and max(last for _, last in spans) <= 255


@pytest.mark.parametrize("how", sorted(BOUNDED))
def test_longrope_verification_never_crosses_its_switch(how):
    """Longrope gives every position of a forward its long factors once the forward's last position is past the
    original context: a verification that crossed it would see the committed tokens otherwise than plain decoding's
    one-token steps. The rounds before it draft fewer, the ones after draft again."""
    from conftest import family_model

    switch = 24
    short, long_ = [1.0] * 4, [4.0] * 4
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long_,
            "original_max_position_embeddings": switch}
    model = family_model("phi3", seed=2, dtype=torch.float64, rope_parameters=rope, max_position_embeddings=256,
                         original_max_position_embeddings=switch)
    assert adapter.rope_switches(model.config) == (switch,)
    prompt = [5, 9, 14, 3, 22, 7]
    spans, hook = _forward_spans(model)
    try:
        out = generate(model, prompt, skip=SkipSet.of([1], [], NUM_LAYERS), max_new_tokens=40,
                       policy=DraftPolicy(max_draft_tokens=5, adaptive=False, guard=False), eos_token_id=None,
                       **BOUNDED[how])
    finally:
        hook.remove()
    assert out.tokens == hf_greedy(model, prompt, 40, eos=None)
    assert not _crossing(spans, switch)
    assert any(first > 0 and last - first > 1 and first + 1 > switch for first, last in spans)  # drafting after it


def test_a_compiled_round_near_a_bound_drafts_all_or_nothing():
    """Compiled verification runs at the widest round's width: a round whose padded verification would cross a bound
    drafts nothing; eager, it drafts as many as fit. Past the bound, nothing limits the rounds."""
    from types import SimpleNamespace

    from skipsearch.decode.loop import _within_bounds

    def bounded(compiled, position):
        return _within_bounds(SimpleNamespace(bounds=(24, 256), compiled=compiled, max_draft_tokens=5), position, 5)

    assert [bounded(True, p) for p in (10, 18, 19, 23, 24, 250, 251)] == [5, 5, 0, 0, 5, 5, 0]
    assert [bounded(False, p) for p in (10, 18, 19, 23, 24, 250, 251, 255)] == [5, 5, 4, 0, 5, 5, 4, 0]
