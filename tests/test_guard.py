"""The run-time guard (guard.py) and the price of a drafted token (economics.py): unit tests of their rules, and the
loop with them, timed by a virtual clock (conftest's `VirtualTimer`) so that what pays is known."""

import pytest
import torch
from conftest import VirtualTimer, tiny_model

from skipsearch import decoding
from skipsearch.decoding import DraftPolicy, generate
from skipsearch.economics import AcceptanceRate, MarginalCost, best_draft_length, committed_tokens
from skipsearch.engine import engine_for
from skipsearch.guard import FIRST_BACKOFF_TOKENS, KEEP_ABOVE, PLAIN_SAMPLE_TOKENS, ROUNDS_PER_CHECK, Guard, PlainSpeed
from skipsearch.skipping import SkipSet
from test_engine import HostReads

pytestmark = pytest.mark.guarded  # conftest turns the guard off in every other test

LAYERS = 8


def drafted_rounds(guard: Guard, rounds: int, tokens: int, seconds: float) -> None:
    for _ in range(rounds):
        assert guard.drafting()
        guard.observe(tokens, seconds, drafted=True)


def test_the_guard_samples_plain_speed_first_then_keeps_a_set_that_pays():
    guard = Guard()
    drafted_rounds(guard, ROUNDS_PER_CHECK, tokens=3, seconds=2.0)  # 1.5 tokens/s
    assert not guard.drafting() and guard.schedule.plain_left == PLAIN_SAMPLE_TOKENS  # no plain speed known yet
    for _ in range(PLAIN_SAMPLE_TOKENS):
        guard.observe(1, 1.0, drafted=False)  # 1 token/s
    assert guard.drafting() and guard.plain.seconds_per_token == pytest.approx(1.0)
    drafted_rounds(guard, 1, tokens=3, seconds=2.0)  # the verdict, with the rounds before the sample
    assert guard.stats.last_ratio == pytest.approx(1.5)
    drafted_rounds(guard, 10 * ROUNDS_PER_CHECK, tokens=3, seconds=2.0)
    assert (guard.stats.fallbacks, guard.stats.plain_tokens, guard.stats.sample_tokens) == (0, 0, PLAIN_SAMPLE_TOKENS)
    assert guard.stats.reason() is None


def test_the_guard_falls_back_with_back_off_and_comes_back_when_drafting_pays_again():
    guard = Guard(PlainSpeed(1.0))
    stretches = []
    for _ in range(3):
        drafted_rounds(guard, ROUNDS_PER_CHECK, tokens=1, seconds=2.0)  # half of plain speed
        stretches.append(guard.schedule.plain_left)
        while not guard.drafting():
            guard.observe(1, 1.0, drafted=False)
    assert stretches == [FIRST_BACKOFF_TOKENS, 2 * FIRST_BACKOFF_TOKENS, 4 * FIRST_BACKOFF_TOKENS]
    assert guard.stats.fallbacks == 3 and guard.stats.plain_tokens == 7 * FIRST_BACKOFF_TOKENS
    assert guard.stats.last_ratio == pytest.approx(0.5) and "0.50x" in guard.stats.reason()
    drafted_rounds(guard, ROUNDS_PER_CHECK, tokens=4, seconds=2.0)  # the probe now pays: the back-off resets
    assert guard.drafting() and guard.schedule.backoff == FIRST_BACKOFF_TOKENS


def test_one_slow_round_among_good_ones_is_no_verdict():
    guard = Guard(PlainSpeed(1.0))
    drafted_rounds(guard, 3 * ROUNDS_PER_CHECK, tokens=3, seconds=2.0)
    drafted_rounds(guard, ROUNDS_PER_CHECK - 1, tokens=3, seconds=2.0)
    guard.observe(1, 6.0, drafted=True)  # a stretch of rejections, at the verdict
    assert guard.drafting() and guard.stats.fallbacks == 0 and guard.stats.last_ratio > KEEP_ABOVE


def test_untimed_iterations_count_tokens_but_no_time():
    guard = Guard(PlainSpeed(1.0))
    guard.observe(3, None, drafted=True)  # a compiled step's first call
    guard.schedule.plain_left = 4
    guard.observe(2, None, drafted=False)
    assert guard.drafted_rounds == 0 and guard.plain.seconds_per_token == 1.0 and guard.schedule.plain_left == 2


def test_the_price_of_a_draft_is_fit_from_round_times():
    cost = MarginalCost(prior=0.9)
    for drafts in (1, 1, 2):
        cost.observe(drafts, 2.0 + 0.5 * drafts)
    assert cost.price == 0.9  # too few rounds
    for drafts in [1, 3, 2, 5, 4, 1, 2, 6] * 3:
        cost.observe(drafts, 2.0 + 0.5 * drafts)
    assert cost.price == pytest.approx(0.25)
    flat = MarginalCost(prior=0.7)
    for _ in range(20):
        flat.observe(4, 3.0)  # rounds of one length: base and per-draft cost cannot be told apart
    assert flat.price == 0.7


def damped_model() -> torch.nn.Module:
    """A random model whose middle layers barely write to the residual stream: skipping them keeps nearly every
    draft, and under the virtual clock saves most of a forward. A set that pays, by construction."""
    model = tiny_model("llama", seed=3, dtype=torch.float64, num_layers=LAYERS)
    with torch.no_grad():
        for layer in model.model.layers[1:-1]:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
    return model


MIDDLE = SkipSet.of(range(1, LAYERS - 1), range(1, LAYERS - 1), LAYERS)
PROMPT = [5, 9, 14, 3]


def virtual_time(model, monkeypatch) -> VirtualTimer:
    timer = VirtualTimer(model)
    monkeypatch.setattr(decoding, "ROUND_CLOCK", timer)
    return timer


def timed(timer: VirtualTimer, **run) -> tuple[decoding.GenerationOutput, float]:
    start = timer.now
    out = generate(eos_token_id=None, **run)
    return out, timer.now - start


def test_where_drafting_pays_the_guard_never_falls_back_and_reads_nothing_more(monkeypatch):
    model = damped_model()
    timer = virtual_time(model, monkeypatch)
    run = dict(model=model, input_ids=PROMPT, skip=MIDDLE, max_new_tokens=120)
    first, _ = timed(timer, **run)
    assert first.stats.guard.sample_tokens == PLAIN_SAMPLE_TOKENS  # once per model: then kept on its engine
    assert engine_for(model).plain_speeds[None].seconds_per_token > 0
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    outs, reads = {}, {}
    for guard in (True, False):
        reads[guard] = HostReads()  # the whole call: the guard adds no read and no upload anywhere
        with reads[guard]:
            outs[guard], _ = timed(timer, policy=DraftPolicy(max_draft_tokens=4, adaptive=False, guard=guard), **run)
    guarded = outs[True].stats
    assert (guarded.guard.fallbacks, guarded.guard.plain_tokens, guarded.guard.sample_tokens) == (0, 0, 0)
    assert guarded.guard.last_ratio > 1.5
    assert outs[True].tokens == outs[False].tokens == first.tokens
    assert (guarded.rounds, guarded.drafted, guarded.accepted) == (
        outs[False].stats.rounds, outs[False].stats.drafted, outs[False].stats.accepted)
    assert (reads[True].count, reads[True].uploads) == (reads[False].count, reads[False].uploads)


def test_where_drafting_loses_the_guard_decodes_near_plain_speed(monkeypatch):
    model = tiny_model("llama", seed=3, dtype=torch.float64, num_layers=4)
    timer = virtual_time(model, monkeypatch)
    run = dict(model=model, input_ids=PROMPT, skip=SkipSet.of([1], [], 4), max_new_tokens=200)
    plain, plain_s = timed(timer, model=model, input_ids=PROMPT, max_new_tokens=200)
    unguarded, unguarded_s = timed(timer, policy=DraftPolicy(guard=False), **run)
    guarded, guarded_s = timed(timer, **run)
    assert plain.tokens == unguarded.tokens == guarded.tokens
    assert plain_s / unguarded_s < 0.85  # the set loses, unguarded
    assert plain_s / guarded_s > 0.95
    stats = guarded.stats.guard
    assert stats.fallbacks >= 2 and stats.plain_tokens > 100 and stats.last_ratio < KEEP_ABOVE
    assert guarded.stats.as_dict()["guard_plain_tokens"] == stats.plain_tokens
    # The next call starts where the back-off left the set: no new verdict's drafted rounds to pay for.
    again, again_s = timed(timer, **run)
    assert again.tokens == plain.tokens and plain_s / again_s > 0.97 and again.stats.guard.plain_tokens > 150
    schedule = engine_for(model).guard_schedules[SkipSet.of([1], [], 4), None]
    assert schedule.backoff > FIRST_BACKOFF_TOKENS


def test_the_guard_switches_to_plain_steps_with_hooks_and_when_compiled(monkeypatch):
    """Fallback through the hooks' path (custom_generate) and through compiled steps (the width-1 plain step), with
    a guard that decodes every third iteration plainly: the tokens stay plain greedy decoding's."""

    class EveryThirdPlain(Guard):
        calls = 0

        def drafting(self) -> bool:
            self.calls += 1
            return self.calls % 3 != 0

    monkeypatch.setattr(decoding, "Guard", EveryThirdPlain)
    model = tiny_model("llama", seed=3, dtype=torch.float64, num_layers=4)
    run = dict(skip=SkipSet.of([1], [], 4), max_new_tokens=40, eos_token_id=None)
    expected = generate(model, PROMPT, max_new_tokens=40, eos_token_id=None).tokens
    for extra in ({"compile": True, "compile_backend": "aot_eager", "compile_mode": "regional"},
                  {"hooks": decoding.DecodeHooks(process=lambda ids, logits: logits, stop=lambda ids, m: None)}):
        out = generate(model, PROMPT, **run, **extra)
        assert out.tokens == expected and out.stats.guard.plain_tokens > 5 and out.stats.drafted > 5


def test_the_cost_rule_drafts_longer_where_drafts_are_cheap(monkeypatch):
    model = damped_model()
    virtual_time(model, monkeypatch)
    policy = DraftPolicy(stop_rule="cost", guard=False)
    cheap = generate(model, PROMPT, skip=MIDDLE, max_new_tokens=100, policy=policy, eos_token_id=None)
    dear = generate(model, PROMPT, skip=SkipSet.of([], [3], LAYERS), max_new_tokens=100, policy=policy,
                    eos_token_id=None)
    assert cheap.tokens == dear.tokens == generate(model, PROMPT, max_new_tokens=100, eos_token_id=None).tokens
    assert cheap.stats.drafted / cheap.stats.rounds > 2 * dear.stats.drafted / dear.stats.rounds
    assert cheap.final_threshold is None  # no confidence threshold moves under the cost rule


def test_cudas_path_drafts_long_rounds_where_they_pay_and_one_draft_where_they_barely_do(monkeypatch):
    """Where reads stall the device, each round's length is chosen ahead from the acceptance seen and the price of a
    draft fit from the rounds' (virtual) times: near the most where drafts are cheap and nearly always accepted,
    one where a draft costs nearly a forward and is often rejected. Greedy output is plain greedy output."""
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: True)
    policy = DraftPolicy(guard=False)
    cheap_model, dear_model = damped_model(), tiny_model("llama", seed=3, dtype=torch.float64, num_layers=4)
    virtual_time(cheap_model, monkeypatch)
    cheap = generate(cheap_model, PROMPT, skip=MIDDLE, max_new_tokens=100, policy=policy, eos_token_id=None)
    virtual_time(dear_model, monkeypatch)
    dear = generate(dear_model, PROMPT, skip=SkipSet.of([1], [], 4), max_new_tokens=100, policy=policy,
                    eos_token_id=None)
    assert cheap.tokens == generate(cheap_model, PROMPT, max_new_tokens=100, eos_token_id=None).tokens
    assert dear.tokens == generate(dear_model, PROMPT, max_new_tokens=100, eos_token_id=None).tokens
    assert cheap.stats.acceptance_rate > 0.9 and cheap.stats.drafted / cheap.stats.rounds > 6
    assert dear.stats.acceptance_rate < 0.6 and dear.stats.drafted == dear.stats.rounds - 1  # the last: no room


def test_the_acceptance_rate_counts_a_rejection_only_where_a_round_kept_fewer_drafts_than_it_ran():
    rate = AcceptanceRate(prior=0.7)
    assert rate.rate == pytest.approx(0.7)
    for _ in range(60):
        rate.observe(1, 4)  # one accepted, then one rejected
    assert rate.rate == pytest.approx(0.5, abs=1e-3)
    for _ in range(60):
        rate.observe(2, 2)  # all kept: no rejection seen, only that both were accepted
    assert rate.rate > 0.99


def test_the_best_draft_length_weighs_acceptance_against_the_price_of_a_draft():
    assert committed_tokens(0.5, 2) == pytest.approx(1.75) and committed_tokens(1.0, 3) == 4.0
    assert committed_tokens(0.0, 5) == 1.0
    half = lambda drafts: 1.0 + 0.5 * drafts  # noqa: E731
    # 1.9 / 1.5, 2.71 / 2, 3.439 / 2.5, 4.0951 / 3: three drafts commit the most tokens per step
    assert best_draft_length(0.9, half, 8) == 3
    assert best_draft_length(0.7, half, 8) == 1
    assert best_draft_length(0.99, lambda drafts: 1.0 + 0.05 * drafts, 8) == 8
    assert best_draft_length(0.99, lambda drafts: 1.0 + 0.05 * drafts, 5) == 5
    assert best_draft_length(0.0, half, 8) == 1 and best_draft_length(0.9, half, 0) == 0
    lengths = [best_draft_length(a / 20, lambda drafts: 1.0 + 0.3 * drafts, 8) for a in range(21)]
    assert lengths == sorted(lengths) and lengths[0] == 1 and lengths[-1] == 8
