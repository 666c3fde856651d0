"""`self_speculative` through transformers' own `model.generate(..., custom_generate=...)`."""

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList, TextIteratorStreamer
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper)
from transformers.generation.streamers import BaseStreamer

from conftest import tiny_model
from skipsearch import DraftPolicy, SkipSet, self_speculative
from skipsearch.decode.skipset import DraftHead
from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
from skipsearch.decode.skipping import draft_mode

NUM_LAYERS = 4
MODELS = {arch: tiny_model(arch, seed=10 + i, dtype=torch.float64) for i, arch in enumerate(["llama", "qwen2"])}
PROMPT = torch.tensor([[5, 9, 14, 3]])


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.view(-1).tolist())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("skip, policy", [
    (SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=4, adaptive=False)),
    (SkipSet.of([0, 3], [1], NUM_LAYERS), DraftPolicy(max_draft_tokens=6)),
    # A trimmed draft head: processors see the full vocabulary, every row but the head's at the lowest logit.
    (SkipSet.of([1], [], NUM_LAYERS, DraftHead(tuple(range(0, 96, 2)))), DraftPolicy(max_draft_tokens=4)),
])
@pytest.mark.parametrize("options", [{}, {"repetition_penalty": 1.8},
                                     {"repetition_penalty": 0.7, "no_repeat_ngram_size": 2},
                                     {"bad_words_ids": [[23], [52]], "min_new_tokens": 30, "eos_token_id": 18}])
def test_greedy_equals_plain_generate(arch, skip, policy, options):
    model = MODELS[arch]
    processed, options = bool(options), {"eos_token_id": None, "pad_token_id": 0, **options}
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False, **options)
    speculative = self_speculative(skip, policy)
    out = model.generate(PROMPT, max_new_tokens=40, do_sample=False, custom_generate=speculative, **options)
    assert out.tolist() == plain.tolist()
    assert speculative.stats.drafted > 0
    if processed:  # with processors, drafts were both accepted and rejected: rows were processed past a roll-back
        assert speculative.stats.drafted > speculative.stats.accepted > 0


def test_compiled_steps_through_generate_keep_the_output_and_processing():
    model = MODELS["llama"]
    options = {"eos_token_id": None, "pad_token_id": 0, "repetition_penalty": 1.8}
    plain = model.generate(PROMPT, max_new_tokens=24, do_sample=False, **options)
    speculative = self_speculative(SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False),
                                   compile=True)
    speculative.compile_backend = "aot_eager"  # what CI affords; inductor is timed in benchmarks/
    out = model.generate(PROMPT, max_new_tokens=24, do_sample=False, custom_generate=speculative, **options)
    assert out.tolist() == plain.tolist()
    assert speculative.stats.compile_time_s > 0 and speculative.stats.drafted > speculative.stats.accepted > 0


def test_history_dependent_processors_change_the_output():
    """Guards the test above: repetition penalty and n-gram blocking are not no-ops on these prompts."""
    model = MODELS["llama"]
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=None)
    for options in [{"repetition_penalty": 1.8}, {"repetition_penalty": 0.7, "no_repeat_ngram_size": 2},
                    {"bad_words_ids": [[23], [52]]}]:
        assert model.generate(PROMPT, max_new_tokens=40, do_sample=False, eos_token_id=None, **options).tolist() \
            != plain.tolist()


def test_max_new_tokens_eos_and_streamer():
    model = MODELS["llama"]
    speculative = self_speculative(SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=5, adaptive=False))
    free = model.generate(PROMPT, max_new_tokens=30, do_sample=False, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    eos = free[9]
    for max_new_tokens, eos_token_id in [(7, None), (30, eos), (30, [eos, 95]), (1, None)]:
        streamer = Recorder()
        out = model.generate(PROMPT, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=0, custom_generate=speculative, streamer=streamer)
        plain = model.generate(PROMPT, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                               pad_token_id=0)
        assert out.tolist() == plain.tolist()
        new = out[0, PROMPT.shape[1]:].tolist()
        expected = free[: free.index(eos) + 1] if eos_token_id is not None else free[:max_new_tokens]
        assert new == expected
        # generate puts the prompt, the loop every round's committed tokens, then ends the stream once.
        assert streamer.puts[0] == PROMPT[0].tolist() and sum(streamer.puts[1:], []) == new
        assert len(streamer.puts) > 2 or max_new_tokens == 1
        assert streamer.ends == 1


def second_token_marginal(model, prompt, processors, vocab):
    """Exact p(x2 | prompt) under `processors`, each position processed with its own prefix."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        first = torch.softmax(processors(ids, model(ids).logits[:, -1].double()), -1)[0]
        both = torch.tensor([prompt + [x1] for x1 in range(vocab)])
        second = torch.softmax(processors(both, model(both).logits[:, -1].double()), -1)
    return first @ second


def total_variation(samples, probs):
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def test_sampling_keeps_the_processed_distribution_of_the_full_model():
    vocab, skip = 8, SkipSet.of([0, 2], [1, 3], NUM_LAYERS)
    model = tiny_model("llama", seed=5, vocab_size=vocab)
    options = dict(do_sample=True, temperature=0.8, top_k=6, repetition_penalty=3.0)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0), TemperatureLogitsWarper(0.8),
                                      TopKLogitsWarper(6)])
    expected = second_token_marginal(model, [2], processors, vocab)
    speculative = self_speculative(skip, DraftPolicy(max_draft_tokens=1, adaptive=False))
    torch.manual_seed(0)
    samples = [model.generate(torch.tensor([[2]]), max_new_tokens=3, eos_token_id=None, pad_token_id=0,
                              custom_generate=speculative, **options)[0, 2].item() for _ in range(1000)]
    assert speculative.stats.drafted == 1000  # every 2nd token went through draft + verify
    assert total_variation(samples, expected) < 0.06
    # The check has teeth: the draft's own distribution, and the unprocessed one, are far from it.
    with draft_mode(model, skip):
        drafted = second_token_marginal(model, [2], processors, vocab)
    unprocessed = second_token_marginal(model, [2], LogitsProcessorList(), vocab)
    assert 0.5 * (drafted - expected).abs().sum() > 0.2
    assert 0.5 * (unprocessed - expected).abs().sum() > 0.1


def test_return_dict_and_config_from_a_file(tmp_path):
    model = MODELS["qwen2"]
    config = SkipConfig(ModelInfo.of(model, "tiny"), SkipSet.of([2], [0], NUM_LAYERS), DraftPolicy(max_draft_tokens=3))
    save_skip_config(config, tmp_path / "skip.json")
    out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         custom_generate=self_speculative(tmp_path / "skip.json"))
    plain = model.generate(PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out.sequences.tolist() == plain.tolist()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        MODELS["llama"].generate(PROMPT, max_new_tokens=3, custom_generate=self_speculative(
            SkipConfig(ModelInfo("x", "LlamaForCausalLM", 8, 32), SkipSet.of([1], [], 8))))


@pytest.mark.parametrize("inputs, options, message", [
    (PROMPT.expand(2, -1), {}, "batch of 2"),
    (PROMPT, {"num_beams": 2}, "num_beams"),
    (PROMPT, {"num_return_sequences": 2, "do_sample": True}, "num_return_sequences"),
    (PROMPT, {"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    (PROMPT, {"attention_mask": torch.tensor([[0, 1, 1, 1]])}, "padding"),
    (PROMPT, {"stop_strings": ["."]}, "tokenizer"),
])
def test_unsupported_options_are_clear_errors(inputs, options, message):
    speculative = self_speculative(SkipSet.of([1], [], NUM_LAYERS))
    with pytest.raises(ValueError, match=message):
        MODELS["llama"].generate(inputs, max_new_tokens=4, pad_token_id=0, custom_generate=speculative, **options)


def test_a_refused_call_still_ends_the_streamer_and_an_assistant_model_is_refused():
    """A consumer thread of TextIteratorStreamer waits for end(): a refusal must end the stream too. transformers
    hands a callable no assistant_model: drafting with the model itself must not quietly stand in for it."""
    speculative = self_speculative(SkipSet.of([1], [], NUM_LAYERS))
    for options, message in (({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
                             ({"stop_strings": ["."]}, "tokenizer"),
                             ({"assistant_model": MODELS["qwen2"]}, "do not give generate an assistant_model")):
        streamer = Recorder()
        with pytest.raises(ValueError, match=message):
            MODELS["llama"].generate(PROMPT, max_new_tokens=4, pad_token_id=0, custom_generate=speculative,
                                     streamer=streamer, **options)
        assert streamer.ends == 1, options


def test_configs_of_other_draft_policies_decode_with_the_policy_given():
    model = MODELS["llama"]
    configs = [SkipConfig(ModelInfo.of(model, "tiny"), SkipSet.of([i], [], NUM_LAYERS), DraftPolicy(max_draft_tokens=n))
               for i, n in ((1, 3), (2, 5))]
    with pytest.raises(ValueError, match="draft differently"):
        self_speculative(configs)
    speculative = self_speculative(configs, DraftPolicy(max_draft_tokens=4))
    assert speculative.policy.max_draft_tokens == 4
    out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, eos_token_id=None, custom_generate=speculative)
    assert out.tolist() == model.generate(PROMPT, max_new_tokens=8, do_sample=False, eos_token_id=None).tolist()


def test_sampling_through_a_trimmed_head_whose_every_token_the_processors_ban():
    """Constrained sampling (a grammar's allowed tokens) may ban every token the trimmed head names; a temperature
    below 1 then takes the draft's whole row to -inf. The draft samples uniformly there, and the output keeps to the
    allowed tokens, as the full model samples them (fp32, the dtype where the head's floor is finite until the
    temperature divides it)."""
    model = tiny_model("llama", seed=10)
    skip = SkipSet.of([1], [], NUM_LAYERS, DraftHead(tuple(range(0, 96, 2))))  # even ids only
    speculative = self_speculative(skip, DraftPolicy(max_draft_tokens=3, adaptive=False))
    torch.manual_seed(0)
    out = model.generate(PROMPT, max_new_tokens=12, do_sample=True, temperature=0.5, eos_token_id=None, pad_token_id=0,
                         prefix_allowed_tokens_fn=lambda batch, ids: list(range(1, 96, 2)), custom_generate=speculative)
    assert out.shape[1] == PROMPT.shape[1] + 12 and all(t % 2 == 1 for t in out[0, PROMPT.shape[1]:].tolist())
    assert speculative.stats.drafted > 0


def test_a_length_of_the_whole_context_decodes_and_one_past_names_max_length_too():
    """A model's generation_config may set max_length to its whole context: that decodes, drafting, to plain
    generate's tokens (drafts need no room past it). Past the context, the refusal names max_length beside
    max_new_tokens, as the caller may have set neither."""
    model = MODELS["llama"]  # a context of 256
    speculative = self_speculative(SkipSet.of([1], [], NUM_LAYERS), DraftPolicy(max_draft_tokens=4))
    out = model.generate(PROMPT, max_length=256, do_sample=False, eos_token_id=None, custom_generate=speculative)
    plain = model.generate(PROMPT, max_length=256, do_sample=False, eos_token_id=None)
    assert torch.equal(out, plain) and speculative.stats.drafted > 0
    with pytest.raises(ValueError, match=r"max_new_tokens \(or max_length, which counts the prompt\) \(253\) "
                                         r"exceed the model's context of 256"):
        model.generate(PROMPT, max_length=257, do_sample=False, custom_generate=speculative)


def test_bad_config_type():
    with pytest.raises(TypeError, match="SkipConfig"):
        self_speculative({"attn": [1]})


def test_real_model_streams_the_output_and_stops_at_a_stop_string(default_model):
    model, tokenizer = default_model.model, default_model.tokenizer
    layers = model.config.num_hidden_layers
    speculative = self_speculative(SkipSet.of([layers // 2, layers - 3], [layers // 3], layers),
                                   DraftPolicy(max_draft_tokens=4), tokenizer=tokenizer)
    inputs = tokenizer("The three primary colors are red,", return_tensors="pt")
    options = dict(max_new_tokens=48, do_sample=False, stop_strings=["."], tokenizer=tokenizer)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = model.generate(**inputs, streamer=streamer, custom_generate=speculative, **options)
    plain = model.generate(**inputs, **options)
    assert out.tolist() == plain.tolist()
    text = tokenizer.decode(out[0, inputs.input_ids.shape[1]:])
    assert text.endswith(".") and text.count(".") == 1
    assert out.shape[1] - inputs.input_ids.shape[1] < 48  # it stopped early, at the stop string
    assert "".join(streamer) == text  # the queue is unbounded and ended: read it after generate returns
    assert speculative.stats.drafted > 0


# Each family of generation options, compared with plain `generate` on the same options: a transformers release that
# changes how one reaches a custom_generate callable fails here, by name, instead of changing the output silently.

class StopAt:
    """A stopping criterion of the caller's own: stop once `token` is generated."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _free_tokens(model, n=30):
    return model.generate(PROMPT, max_new_tokens=n, do_sample=False, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()


OPTION_FAMILIES = {
    "processors": lambda free: {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3,
                                "sequence_bias": {(free[3],): -4.0, (free[5], free[6]): -8.0}},
    "constraints": lambda free: {"bad_words_ids": [[free[2]], [free[7], free[8]]], "suppress_tokens": [free[4]],
                                 "begin_suppress_tokens": [free[0]],
                                 "prefix_allowed_tokens_fn": lambda batch, ids: [t for t in range(96) if t % 3]},
    "stopping": lambda free: {"eos_token_id": [free[12], 95],
                              "stopping_criteria": StoppingCriteriaList([StopAt(free[9])])},
    "lengths": lambda free: {"max_length": PROMPT.shape[1] + 17, "min_length": PROMPT.shape[1] + 9,
                             "eos_token_id": free[4], "forced_eos_token_id": free[1]},
}


@pytest.mark.parametrize("family", OPTION_FAMILIES)
def test_each_option_family_equals_plain_generate(family):
    model = MODELS["llama"]
    free = _free_tokens(model)
    options = {"eos_token_id": None, "pad_token_id": 0, **OPTION_FAMILIES[family](free)}
    if "max_length" not in options:
        options["max_new_tokens"] = 30
    plain = model.generate(PROMPT, do_sample=False, **options)
    speculative = self_speculative(SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=4, adaptive=False))
    out = model.generate(PROMPT, do_sample=False, custom_generate=speculative, **options)
    assert out.tolist() == plain.tolist()
    assert speculative.stats.drafted > 0
    assert plain[0, PROMPT.shape[1]:].tolist() != free  # the options did act: other tokens, or fewer


def test_sampling_with_a_seed_is_reproducible_and_one_token_sampling_equals_plain():
    """Sampling with a seed repeats itself; with one token left by top-k, it is plain generate's output exactly
    (temperature and top-p processed on the way). The distribution itself: the test above."""
    model = MODELS["qwen2"]
    speculative = self_speculative(SkipSet.of([2], [0], NUM_LAYERS), DraftPolicy(max_draft_tokens=3, adaptive=False))
    options = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(model.generate(PROMPT, custom_generate=speculative, **options).tolist())
    assert runs[0] == runs[1] and runs[0] != runs[2]
    torch.manual_seed(0)
    plain = model.generate(PROMPT, top_k=1, **options)
    out = model.generate(PROMPT, top_k=1, custom_generate=speculative, **options)
    assert out.tolist() == plain.tolist() and speculative.stats.drafted > speculative.stats.accepted > 0


def test_a_reproducible_callable_samples_the_same_tokens_from_one_seed_on_a_busy_clock(monkeypatch):
    """By default a callable's rounds follow the clock and what its earlier calls learned, and each draft draws random
    numbers: one seed gave other tokens call to call. `reproducible=True` plans rounds from neither."""
    import itertools
    import random

    from skipsearch.decode import loop as decoding

    model = MODELS["qwen2"]
    options = dict(do_sample=True, temperature=0.9, max_new_tokens=40, eos_token_id=None, pad_token_id=0)

    def sampled(speculative, noise: int) -> list[int]:
        draws, now = random.Random(noise), itertools.count()
        monkeypatch.setattr(decoding, "ROUND_CLOCK", lambda: next(now) * 1e-3 + draws.expovariate(20.0))
        torch.manual_seed(3)
        return model.generate(PROMPT, custom_generate=speculative, **options).tolist()

    skip = SkipSet.of([2], [0], NUM_LAYERS)
    reproducible = self_speculative(skip, DraftPolicy(), reproducible=True)
    assert sampled(reproducible, noise=1) == sampled(reproducible, noise=2) == sampled(reproducible, noise=1)
    timed = self_speculative(skip, DraftPolicy())
    assert len({str(sampled(timed, noise)) for noise in (1, 2, 3)}) > 1  # what the option is for


def test_threads_sharing_one_callable_count_every_call(monkeypatch):
    """One callable shared by threads: its statistics add up every call (adding reads and writes each field; a
    thread switch in between lost the other thread's call)."""
    import copy
    import pickle
    import time
    from concurrent.futures import ThreadPoolExecutor

    from skipsearch.decode.stats import DecodeStats

    add = DecodeStats.add

    def slow_add(self, other):  # a thread switch between reading the fields and writing them, every time
        before = self.new_tokens
        time.sleep(0.01)
        add(self, other)
        assert self.new_tokens == before + other.new_tokens

    monkeypatch.setattr(DecodeStats, "add", slow_add)
    shared = self_speculative(SkipSet.of([1], [2], NUM_LAYERS), DraftPolicy(max_draft_tokens=4))
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda _: MODELS["llama"].generate(PROMPT, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                                          pad_token_id=0, custom_generate=shared), range(8)))
    assert shared.stats.new_tokens == 8 * 6
    assert pickle.loads(pickle.dumps(shared)).stats.new_tokens == copy.deepcopy(shared).stats.new_tokens == 8 * 6


def test_concurrent_calls_on_one_model_stay_correct():
    """Threads decoding on one model at once, with different skip sets, options and plain calls among them, each get
    what they get alone: the draft path never leaves the model's own layers swapped."""
    from concurrent.futures import ThreadPoolExecutor

    model = MODELS["llama"]
    jobs = [(SkipSet.of([1], [2], NUM_LAYERS), {}), (SkipSet.of([0, 3], [1], NUM_LAYERS), {"repetition_penalty": 1.8}),
            (None, {}), (SkipSet.of([2], [], NUM_LAYERS), {"no_repeat_ngram_size": 2}), (None, {"min_new_tokens": 30})]

    def run(job):
        skip, options = job
        extra = {} if skip is None else {"custom_generate": self_speculative(skip, DraftPolicy(max_draft_tokens=4))}
        return model.generate(PROMPT, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0,
                              **options, **extra).tolist()

    alone = [model.generate(PROMPT, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0,
                            **options).tolist() for _, options in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for _ in range(3):
            assert list(pool.map(run, jobs)) == alone
