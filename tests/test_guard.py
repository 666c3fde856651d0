"""The draft controller (controller.py) and its economics (economics.py): its decisions with made-up prices and
acceptance, and through the loop timed by a virtual clock (conftest's `VirtualTimer`) so that what pays is known. Each
loop test runs the CPU path (a round cut at an unsure draft) and the CUDA path (`host_reads_stall`: no cut, one host
read a round) and names the same decision for both."""

import json

import pytest
import torch
from conftest import VirtualTimer, tiny_model

from skipsearch.decode import loop as decoding
from skipsearch.decode.controller import (FIRST_BACKOFF_TOKENS, KEEP_ABOVE, PLAIN_SAMPLE_TOKENS, ROUNDS_PER_CHECK,
                                          DraftController, DraftMemory)
from skipsearch.decode.economics import (Acceptance, ConfidenceBins, Cut, PriceFit, RoundCosts, best_draft_length,
                                         committed_tokens)
from skipsearch.decode.loop import generate
from skipsearch.decode.policy import DraftPolicy
from skipsearch.decode.skipset import SkipSet
from test_engine import HostReads

pytestmark = pytest.mark.guarded  # conftest turns the guard off in every other test

LAYERS = 8
SET = SkipSet.of([1], [2])


def controller(acceptance: float, shape=RoundCosts(draft=0.1), memory=None, **policy) -> DraftController:
    made = DraftController(DraftPolicy(**{"max_draft_tokens": 8, **policy}), memory)
    made.use(SET, shape, acceptance)
    return made


def rounds(made: DraftController, count: int, accept_all: bool, seconds) -> list[int]:
    """`count` drafted rounds, each keeping every draft or none, taking `seconds(drafts)`; the lengths planned."""
    planned = []
    for _ in range(count):
        drafts = made.plan(room=100)
        assert drafts > 0
        planned.append(drafts)
        accepted = drafts if accept_all else 0
        made.observe(drafts, accepted, accepted + 1, seconds(drafts))
    return planned


def plain_steps(made: DraftController, seconds_per_token: float) -> int:
    """Plain steps until the controller drafts again; how many."""
    count = 0
    while made.plan(room=100) == 0:
        made.observe(0, 0, 1, seconds_per_token)
        count += 1
    return count


def test_where_drafts_pay_it_measures_plain_speed_once_then_drafts_the_longest_and_never_falls_back():
    made = controller(acceptance=0.95)
    planned = rounds(made, ROUNDS_PER_CHECK, True, lambda drafts: 1.0 + 0.1 * drafts)
    assert planned == [8] * ROUNDS_PER_CHECK
    assert plain_steps(made, 1.0) == PLAIN_SAMPLE_TOKENS  # no plain speed known yet: measured first
    assert made.memory.plain_s["eager"] == pytest.approx(1.0)
    planned = rounds(made, 10 * ROUNDS_PER_CHECK, True, lambda drafts: 1.0 + 0.1 * drafts)
    assert set(planned) == {8} and made.stats.last_ratio > 4
    assert (made.stats.fallbacks, made.stats.plain_tokens, made.stats.sample_tokens) == (0, 0, PLAIN_SAMPLE_TOKENS)
    assert made.stats.reason() is None


def test_where_drafts_do_not_pay_it_drafts_nothing_with_back_off_kept_in_the_callers_memory():
    memory = DraftMemory(plain_s={"eager": 1.0})
    made = controller(acceptance=0.5, shape=RoundCosts(draft=0.9), memory=memory)
    stretches = []
    for _ in range(3):
        rounds(made, ROUNDS_PER_CHECK, False, lambda drafts: 1.0 + 0.9 * drafts)
        stretches.append(plain_steps(made, 1.0))
    assert stretches == [FIRST_BACKOFF_TOKENS, 2 * FIRST_BACKOFF_TOKENS, 4 * FIRST_BACKOFF_TOKENS]
    assert made.stats.fallbacks == 3 and made.stats.plain_tokens == 7 * FIRST_BACKOFF_TOKENS
    assert made.stats.last_ratio < KEEP_ABOVE and "plainly" in made.stats.reason()
    rounds(made, ROUNDS_PER_CHECK, False, lambda drafts: 1.0 + 0.9 * drafts)
    assert made.plan(room=100) == 0
    # A later call with the same memory starts where the back-off left the set; a fresh memory knows nothing.
    assert controller(0.5, memory=memory).plan(room=100) == 0
    assert controller(0.5, memory=DraftMemory.from_dict(memory.as_dict())).plan(room=100) == 0
    memory.reset()
    assert controller(0.5, memory=memory).plan(room=100) > 0 and memory.plain_s == {}


def test_a_call_starts_from_the_acceptance_earlier_calls_with_the_memory_learned():
    """A first call starts from the prior and drafts short; one with the memory of calls whose drafts were all accepted
    drafts long from its first round; a file without acceptance (an earlier release's) reads as knowing none."""
    memory = DraftMemory()

    def fresh() -> DraftController:
        made = DraftController(DraftPolicy(max_draft_tokens=8, guard=False), memory)
        made.use(SET, RoundCosts(draft=0.1))
        return made

    first = fresh()
    first_plan = first.plan(room=100)
    for _ in range(12):
        first.observe(8, 8, 9, 1.8)
    assert memory.acceptance["eager " + str(SET)] > 0.95
    assert first_plan < 8 == fresh().plan(room=100)
    assert DraftMemory.from_dict(memory.as_dict()) == memory
    assert DraftMemory.from_dict({"plain_s": {}, "backoffs": {}}).acceptance == {}
    for rate in (1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="acceptance must map skip sets to rates from 0 to 1"):
            DraftMemory.from_dict({"acceptance": {"eager attn=[1] mlp=[]": rate}})
    memory.reset()
    assert memory.acceptance == {} and fresh().plan(room=100) == first_plan


def test_a_probe_that_pays_again_resets_the_back_off():
    made = controller(acceptance=0.5, shape=RoundCosts(draft=0.9), memory=DraftMemory(plain_s={"eager": 1.0}))
    rounds(made, ROUNDS_PER_CHECK, False, lambda drafts: 1.0 + 0.9 * drafts)
    assert plain_steps(made, 1.0) == FIRST_BACKOFF_TOKENS and made.backoff.stretch == 2 * FIRST_BACKOFF_TOKENS
    rounds(made, 3 * ROUNDS_PER_CHECK, True, lambda drafts: 0.5)  # the probe pays: every draft kept, cheap
    assert made.backoff.stretch == FIRST_BACKOFF_TOKENS and made.stats.fallbacks == 1


def test_without_the_guard_or_adaptivity_the_plan_is_the_price_or_the_largest_draft():
    unguarded = controller(acceptance=0.0, shape=RoundCosts(draft=0.9), guard=False)
    assert rounds(unguarded, 3 * ROUNDS_PER_CHECK, False, lambda drafts: 1.0 + 0.9 * drafts) == [1] * 12
    fixed = controller(acceptance=0.0, shape=RoundCosts(draft=0.9), guard=False, adaptive=False)
    assert rounds(fixed, 12, False, lambda drafts: 1.0) == [8] * 12 and fixed.cut() is None
    assert fixed.plan(room=3) == 2 and fixed.plan(room=1) == 0  # no room past the tokens left
    plain = DraftController(DraftPolicy())
    plain.use(None)
    assert plain.plan(room=100) == 0 and plain.cut() is None


def test_untimed_iterations_count_tokens_but_no_time():
    made = controller(acceptance=0.5, memory=DraftMemory(plain_s={"eager": 1.0}))
    made.observe(3, 2, 3, None)  # a compiled step's first call
    assert made.timed_rounds == 0 and made.fit.units() is None and made.rate != 0.5
    made.backoff.plain_left = 4
    assert made.plan(room=100) == 0
    made.observe(0, 0, 2, None)
    assert made.memory.plain_s["eager"] == 1.0 and made.backoff.plain_left == 2 and made.stats.plain_tokens == 2


def test_what_is_learned_of_two_heads_of_one_size_is_kept_apart():
    from skipsearch.decode.skipset import DraftHead

    controller = DraftController(DraftPolicy(), DraftMemory())
    even, odd = (SkipSet((1,), (), DraftHead(tuple(range(start, 64, 2)))) for start in (0, 1))
    assert even.head.rows == odd.head.rows and str(even) == str(odd)  # what a key made of the set alone would hold
    assert len({controller.key(even), controller.key(odd), controller.key(SkipSet((1,)))}) == 3


def test_a_memory_saved_after_any_call_loads_back(tmp_path):
    """A batch of plain steps may overrun the stretch left: the back-off stops at 0, and `save` writes what `load`
    reads; a file learned by another model or altered by hand is refused in one line."""
    made = controller(acceptance=0.5, memory=DraftMemory(plain_s={"eager": 1.0}))
    made.backoff.plain_left = 3
    assert made.plan(room=100) == 0
    made.observe(0, 0, 8, 8.0)  # eight plain steps read back at once
    assert made.backoff.plain_left == 0 and made.plan(room=100) > 0
    made.memory.save(tmp_path / "memory.json", "model on cpu")
    assert DraftMemory.load(tmp_path / "memory.json", "model on cpu") == made.memory
    with pytest.raises(ValueError, match="was learned by 'model on cpu', not 'other on cpu'"):
        DraftMemory.load(tmp_path / "memory.json", "other on cpu")
    for plain_s, backoff in [({"eager": 0.0}, {}), ({"eager": True}, {}),
                             ({}, {"plain_left": -1, "sampling": False, "stretch": 32}),
                             ({}, {"plain_left": True, "sampling": False, "stretch": True}),
                             ({}, {"plain_left": 10**12, "sampling": False, "stretch": 32}),
                             ({}, {"plain_left": 1, "sampling": 1, "stretch": 32}), ({}, {"plain_left": 1})]:
        with pytest.raises(ValueError, match="plain_s must|the back-off of 'eager attn=.1. mlp=..'"):
            backoffs = {"eager attn=[1] mlp=[]": backoff} if backoff else {}
            DraftMemory.from_dict({"plain_s": plain_s, "backoffs": backoffs})
    with pytest.raises(ValueError, match="a JSON object"):
        DraftMemory.from_dict([])
    stored = json.loads((tmp_path / "memory.json").read_text())
    (tmp_path / "memory.json").write_text(json.dumps({**stored, "version": 7}))
    with pytest.raises(ValueError, match="is of version 7; this skipsearch reads version 1"):
        DraftMemory.read(tmp_path / "memory.json")


def test_the_cut_weighs_the_acceptance_estimate_against_the_price_of_a_draft():
    made = controller(acceptance=0.8, shape=RoundCosts(draft=0.25), guard=False)
    first = made.cut()  # the shape's price until rounds are timed; every confidence at the set's rate until judged
    assert (first.acceptance, first.price, first.chances) == (pytest.approx(0.8), pytest.approx(0.25), (0.8,) * 4)
    for drafts in [1, 3, 2, 5, 4, 1, 2, 6] * 3:
        # A draft costs an eighth of a verification; every draft is accepted.
        made.observe(drafts, drafts, drafts + 1, 2.0 + 0.25 * drafts, confidences=[0.6] * drafts)
    cut = made.cut()
    assert cut.price == pytest.approx(0.125, rel=0.05) and cut.acceptance > 0.95
    assert cut.chance(0.6) > 0.95 and cut.chance(0.99) == pytest.approx(cut.acceptance)  # only 0.5-0.8 was judged

    class Confident:  # a draft step whose top-1 probabilities are given
        def __init__(self, confidences):
            self.confidences = iter(confidences)

        def __call__(self, ids):
            p = next(self.confidences)
            return torch.log(torch.tensor([[p] + [(1 - p) / 9] * 9]))

    def drafted(confidences, cut):
        return decoding.draft_round(Confident(confidences), torch.tensor([0]), 4, cut, decoding.Sampling(), None).count

    assert drafted([0.9] * 4, Cut(0.8, 0.3, (0.8,) * 4)) == 4  # 0.8^k * 0.8 stays above 0.3 for three drafts
    assert drafted([0.9] * 4, Cut(0.8, 0.6, (0.8,) * 4)) == 2  # 0.8^2 * 0.8 < 0.6: no third
    unsure_rejected = Cut(0.8, 0.3, (0.2, 0.8, 0.8, 0.8))  # drafts under 0.5 were seldom accepted
    assert drafted([0.9, 0.2, 0.9, 0.9], unsure_rejected) == 2  # an unsure second draft: 0.8 * 0.2 * 0.8 < 0.3
    assert drafted([0.9, 0.2, 0.9, 0.9], Cut(0.95, 0.3, (0.95,) * 4)) == 4  # unsure, but such drafts were accepted
    assert drafted([0.9, 0.2, 0.9, 0.9], None) == 4  # no cut: the planned length
    draft = decoding.draft_round(Confident([0.9, 0.5]), torch.tensor([0]), 2, Cut(1.0, 0.0, (1.0,) * 4),
                                 decoding.Sampling(), None)
    assert draft.confidences == [pytest.approx(0.9), pytest.approx(0.5)]
    ticks = iter([10.0, 10.5])
    timed = decoding.draft_round(Confident([0.9, 0.5]), torch.tensor([0]), 2, Cut(1.0, 0.0, (1.0,) * 4),
                                 decoding.Sampling(), None, clock=lambda: next(ticks))
    assert timed.seconds == pytest.approx(0.5)
    assert decoding.draft_round(Confident([0.9]), torch.tensor([0]), 1, None, decoding.Sampling(), None).seconds is None


def test_confidence_bins_learn_which_confidences_are_accepted():
    """Drafts under 0.5 rejected, drafts over 0.95 accepted: the bins learn it, drafts after a rejection are not
    judged, and a bin never seen keeps the set's rate."""
    bins = ConfidenceBins()
    for _ in range(20):
        bins.observe([0.99, 0.99, 0.3, 0.99], accepted=2)  # the unsure third rejected; the fourth never judged
    low, middle, high, top = bins.chances(rate=0.7)
    assert low < 0.2 and top > 0.9 and middle == high == pytest.approx(0.7)
    bins.observe([0.6, 0.6], accepted=2)
    assert bins.chances(rate=0.7)[1] > 0.7


def test_the_price_fit_scales_the_shape_to_seconds_and_separates_its_parts_once_rounds_vary():
    fit = PriceFit(RoundCosts(draft=0.25))
    assert fit.round_s(3) is None and fit.draft_price() == 0.25
    for _ in range(20):
        fit.observe(4, 6.0)  # rounds of one length: the shape's ratio stands, scaled to their seconds
    assert fit.round_s(4) == pytest.approx(6.0, rel=1e-3) and fit.draft_price() == pytest.approx(0.25, rel=0.02)
    for drafts in [1, 3, 2, 5, 4, 1, 2, 6] * 8:
        fit.observe(drafts, 2.0 + 0.5 * drafts)  # truly: a verification 2 s, a draft 0.5 s; the old rounds fade
    assert fit.round_s(0) == pytest.approx(2.0, rel=0.05) and fit.draft_price() == pytest.approx(0.25, rel=0.05)
    timed_apart = PriceFit(RoundCosts(draft=0.25))
    for drafts in (4, 1, 4, 1):  # truly: a verification 2 s, a draft 0.75 s; the drafts' seconds read apart
        timed_apart.observe(drafts, 2.0 + 0.75 * drafts + (0.3 if drafts == 1 else -0.3), draft_seconds=0.75 * drafts)
    # Noise on the totals lands on the verification alone: the draft's price is what its own seconds say.
    assert timed_apart.draft_price() == pytest.approx(0.375, rel=0.05)
    joint = PriceFit(RoundCosts(draft=0.25))
    for drafts in (4, 1, 4, 1):
        joint.observe(drafts, 2.0 + 0.75 * drafts + (0.3 if drafts == 1 else -0.3))
    assert joint.draft_price() < 0.3  # the totals alone mistook the noise for a cheaper draft
    widths = PriceFit(RoundCosts(draft=0.1, verify=(1.0, 1.6, 1.9, 1.5)))
    for drafts in (1, 2, 3) * 8:
        widths.observe(drafts, 10.0 * widths.shape.round(drafts))
    assert widths.round_s(2) == pytest.approx(10.0 * (0.2 + 1.5), rel=1e-3)  # verifying 3 is padded to 4


def test_widths_are_priced_as_measured_and_padded_to_the_cheapest():
    costs = RoundCosts(draft=0.1, verify=(1.0, 1.58, 1.94, 1.52, 1.54, 1.69, 2.07, 1.61, 1.84))  # the AMD EPYC's
    assert [costs.width(n) for n in range(1, 10)] == [1, 4, 4, 4, 5, 8, 8, 8, 9]
    assert [costs.verification(n) for n in (3, 6, 7, 12)] == [1.52, 1.61, 1.61, 1.84]
    assert costs.width(3, widest=3) == 3 and costs.width(12) == 12
    envelope = [costs.verification(n) for n in range(1, 10)]
    assert envelope == sorted(envelope)  # the prices a round sees never fall with its width
    assert RoundCosts(draft=0.5).verification(9) == 1.0 and RoundCosts(draft=0.5).width(9) == 9


def test_a_verification_near_a_bound_runs_at_the_cheapest_width_that_fits():
    """Where a bound ahead (the context's end, longrope's switch) allows no wider, the width is the cheapest of those
    that fit, not the cheapest overall cut down to the bound."""
    costs = RoundCosts(draft=0.1, verify=(1.0, 1.58, 1.94, 1.52, 1.54, 1.69, 2.07, 1.61, 1.84))
    made = controller(0.8, costs)
    assert made.width(2) == 4 and made.width(2, widest=6) == 4
    assert made.width(2, widest=3) == 2 and made.width(6, widest=7) == 6  # not 3 (1.94) and 7 (2.07)


def test_the_acceptance_estimate_counts_a_rejection_only_where_a_round_kept_fewer_drafts_than_it_ran():
    rate = Acceptance(prior=0.7)
    assert rate.rate == pytest.approx(0.7)
    for _ in range(60):
        rate.observe(1, 4)  # one accepted, then one rejected
    assert rate.rate == pytest.approx(0.5, abs=1e-3)
    for _ in range(60):
        rate.observe(2, 2)  # all kept: no rejection seen, only that both were accepted
    assert rate.rate > 0.99
    rate.seed(0.3)
    assert rate.rate == pytest.approx(0.3)


def test_the_best_draft_length_weighs_acceptance_against_the_price_of_a_draft():
    assert committed_tokens(0.5, 2) == pytest.approx(1.75) and committed_tokens(1.0, 3) == 4.0
    assert committed_tokens(0.0, 5) == 1.0
    half = lambda drafts: 1.0 + 0.5 * drafts  # noqa: E731
    # 1.9 / 1.5, 2.71 / 2, 3.439 / 2.5, 4.0951 / 3: three drafts commit the most tokens per step
    assert best_draft_length(0.9, half, 8) == 3
    assert best_draft_length(0.7, half, 8) == 1
    assert best_draft_length(0.4, half, 8, least=0) == 0  # a plain step on the menu: 1 / 1 beats 1.4 / 1.5
    assert best_draft_length(0.99, lambda drafts: 1.0 + 0.05 * drafts, 8) == 8
    assert best_draft_length(0.99, lambda drafts: 1.0 + 0.05 * drafts, 5) == 5
    assert best_draft_length(0.0, half, 8) == 1 and best_draft_length(0.9, half, 0) == 0
    lengths = [best_draft_length(a / 20, lambda drafts: 1.0 + 0.3 * drafts, 8) for a in range(21)]
    assert lengths == sorted(lengths) and lengths[0] == 1 and lengths[-1] == 8


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
PATHS = ["cpu", "cuda"]


def on_path(path: str, monkeypatch) -> None:
    monkeypatch.setattr(decoding, "host_reads_stall", lambda device: path == "cuda")


def virtual_time(model, monkeypatch) -> VirtualTimer:
    timer = VirtualTimer(model)
    monkeypatch.setattr(decoding, "ROUND_CLOCK", timer)
    return timer


def timed(timer: VirtualTimer, **run) -> tuple[decoding.GenerationOutput, float]:
    start = timer.now
    out = generate(eos_token_id=None, **run)
    return out, timer.now - start


@pytest.mark.parametrize("path", PATHS)
def test_where_drafts_pay_the_controller_drafts_long_and_never_falls_back(monkeypatch, path):
    """The same decision on both paths: rounds near the largest draft, no fallback, and (CUDA) no extra host read."""
    on_path(path, monkeypatch)
    model = damped_model()
    timer = virtual_time(model, monkeypatch)
    memory = DraftMemory()
    run = dict(model=model, input_ids=PROMPT, skip=MIDDLE, max_new_tokens=120)
    first, _ = timed(timer, memory=memory, **run)
    assert first.stats.guard.sample_tokens == PLAIN_SAMPLE_TOKENS and memory.plain_s["eager"] > 0  # once per memory
    outs, reads = {}, {}
    for guard in (True, False):
        reads[guard] = HostReads()  # the whole call: the guard adds no read and no upload anywhere
        with reads[guard]:
            outs[guard], _ = timed(timer, policy=DraftPolicy(guard=guard), memory=memory, **run)
    guarded = outs[True].stats
    assert (guarded.guard.fallbacks, guarded.guard.plain_tokens, guarded.guard.sample_tokens) == (0, 0, 0)
    assert guarded.guard.last_ratio > 1.5 and guarded.acceptance_rate > 0.9
    assert guarded.drafted / guarded.rounds > 5  # of 8 at most
    assert outs[True].tokens == outs[False].tokens == first.tokens
    assert (guarded.rounds, guarded.drafted, guarded.accepted) == (
        outs[False].stats.rounds, outs[False].stats.drafted, outs[False].stats.accepted)
    if path == "cuda":
        assert (reads[True].count, reads[True].uploads) == (reads[False].count, reads[False].uploads)


@pytest.mark.parametrize("path", PATHS)
def test_where_drafts_do_not_pay_the_controller_drafts_nothing(monkeypatch, path):
    """The same decision on both paths: after a few rounds, plain steps, near plain speed; a later call with the
    caller's memory starts where the back-off left the set."""
    on_path(path, monkeypatch)
    model = tiny_model("llama", seed=3, dtype=torch.float64, num_layers=4)
    timer = virtual_time(model, monkeypatch)
    memory, lossy = DraftMemory(), SkipSet.of([1], [], 4)
    run = dict(model=model, input_ids=PROMPT, skip=lossy, max_new_tokens=200)
    plain, plain_s = timed(timer, model=model, input_ids=PROMPT, max_new_tokens=200)
    unguarded, unguarded_s = timed(timer, policy=DraftPolicy(guard=False), **run)
    guarded, guarded_s = timed(timer, memory=memory, **run)
    assert plain.tokens == unguarded.tokens == guarded.tokens
    assert plain_s / unguarded_s < 0.9  # the set loses, unguarded
    assert plain_s / guarded_s > 0.95
    stats = guarded.stats.guard
    assert stats.fallbacks >= 2 and stats.plain_tokens > 100 and stats.last_ratio < KEEP_ABOVE
    assert guarded.stats.as_dict()["guard_plain_tokens"] == stats.plain_tokens
    again, again_s = timed(timer, memory=memory, **run)
    assert again.tokens == plain.tokens and plain_s / again_s > 0.97 and again.stats.guard.plain_tokens > 150
    assert memory.backoffs[f"eager {lossy}"].stretch > FIRST_BACKOFF_TOKENS


def test_plain_stretches_run_through_hooks_and_compiled_steps(monkeypatch):
    """Fallback through the hooks' path (custom_generate) and through compiled steps (the width-1 plain step), with
    a controller that plans every third iteration plain: the tokens stay plain greedy decoding's."""

    class EveryThirdPlain(DraftController):
        calls = 0

        def plan(self, room: int) -> int:
            self.calls += 1
            return 0 if self.calls % 3 == 0 else super().plan(room)

    monkeypatch.setattr(decoding, "DraftController", EveryThirdPlain)
    model = tiny_model("llama", seed=3, dtype=torch.float64, num_layers=4)
    run = dict(skip=SkipSet.of([1], [], 4), max_new_tokens=40, eos_token_id=None, policy=DraftPolicy(guard=False))
    expected = generate(model, PROMPT, max_new_tokens=40, eos_token_id=None).tokens
    for extra in ({"compile": True, "compile_backend": "aot_eager", "compile_mode": "regional"},
                  {"hooks": decoding.DecodeHooks(process=lambda ids, logits: logits, stop=lambda ids, m: None)}):
        out = generate(model, PROMPT, **run, **extra)
        assert out.tokens == expected and out.stats.drafted > 5
        assert out.stats.rounds > out.stats.verify_sizes[1] > 5  # plain steps among the rounds


def test_a_profile_pads_eager_verifications_to_the_cheapest_width(monkeypatch):
    """With a profile whose verification of 4 tokens is the cheapest of 2 to 4, every round verifies 4 tokens, its
    drafts followed by padding, and the output is plain greedy decoding's."""
    from skipsearch.decode.cost_profile import ContextCosts, CostProfile

    model = damped_model()
    virtual_time(model, monkeypatch)
    profile = CostProfile(device="cpu", dtype="float64", architecture="LlamaForCausalLM", num_hidden_layers=LAYERS,
                          contexts=(ContextCosts(6, attn_s=1e-3, mlp_s=1e-3, rest_s=1e-3,
                                                 verify_s=[17e-3, 30e-3, 40e-3, 26e-3]),))
    prompt, widths = [5, 9, 14, 3, 8, 2], []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        out = generate(model, prompt, skip=MIDDLE, max_new_tokens=31, eos_token_id=None, cost_profile=profile,
                       policy=DraftPolicy(max_draft_tokens=3, adaptive=False, guard=False))
    finally:
        hook.remove()
    assert out.tokens == generate(model, prompt, max_new_tokens=31, eos_token_id=None).tokens
    assert set(widths) <= {6, 4, 1} and widths.count(4) == out.stats.rounds - out.stats.verify_sizes[1]
    assert out.stats.verify_sizes[2] + out.stats.verify_sizes[3] > 0  # rounds of fewer drafts were padded


def test_an_untimed_call_takes_the_same_rounds_on_a_quiet_and_a_busy_clock(monkeypatch):
    """Modeled studies and projections price the rounds decoding takes. A timed call's adaptive rounds follow this
    machine's clock (a busy machine makes drafts look dear); an untimed call's follow its prices and acceptance alone."""
    import itertools
    import random

    model = damped_model()

    def rounds(clock, timed: bool):
        monkeypatch.setattr(decoding, "ROUND_CLOCK", clock)
        out = generate(model, PROMPT, skip=MIDDLE, max_new_tokens=60, eos_token_id=None, timed=timed,
                       policy=DraftPolicy(guard=False))
        return out.tokens, dict(out.stats.verify_sizes), out.stats.accepted

    def busy_clock():
        noise, now = random.Random(7), itertools.count()
        return lambda: next(now) * 1e-3 + noise.expovariate(20.0)

    quiet = lambda ticks=itertools.count(): next(ticks) * 1e-3
    assert rounds(quiet, timed=True)[1:] != rounds(busy_clock(), timed=True)[1:]  # the clock shapes timed rounds
    untimed = rounds(quiet, timed=False)
    assert untimed == rounds(busy_clock(), timed=False)
    assert untimed[0] == rounds(quiet, timed=True)[0]  # the same greedy tokens either way
