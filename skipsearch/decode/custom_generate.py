"""Self-speculative decoding inside transformers' own `model.generate(..., custom_generate=...)`.

transformers prepares the inputs, logits processors and stopping criteria and calls the callable
as its decoding method; the callable runs `loop.generate` with `DecodeHooks` made from them:
- each row of every forward (prefill, draft, verify) is processed with that position's own prefix,
  so history-dependent processors (repetition penalty, no-repeat n-grams, min length) see exactly
  what plain decoding shows them;
- the criteria are checked on each newly committed token's prefix, and the round is cut at the
  first one that fires;
- the streamer gets each round's committed tokens, then `end()`.
Greedy output equals `model.generate` without it; sampling is speculative rejection sampling on
the processed distributions of draft and full model, so it keeps the full model's distribution.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..constants import MIN_TEMPERATURE
from . import adapter
from .adapter import GenerateDecoderOnlyOutput, GenerationMode
from .checks import check_room
from .config import SkipConfig, combine_skip_configs, load_skip_config
from .controller import DraftMemory
from .cost_profile import CostProfile
from .loop import generate
from .policy import DraftPolicy
from .rounds import DecodeHooks
from .sampling import Sampling
from .skipset import SkipSet
from .stats import DecodeStats

Configs = SkipConfig | SkipSet | str | Path

# Generation options this loop does not implement, with the values that mean "off".
_UNSUPPORTED = {
    "num_beams": (1,), "num_return_sequences": (1,), "guidance_scale": (None, 1), "watermarking_config": (None,),
    "output_scores": (False, None), "output_logits": (False, None), "output_attentions": (False, None),
    "output_hidden_states": (False, None), "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,),
    "token_healing": (False, None), "max_time": (None,),
}
# The options that ask for a decoding mode of generate's own, for messages.
_MODE_OPTIONS = {GenerationMode.DOLA_GENERATION: "dola_layers", GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha"}


class SelfSpeculative:
    """A `custom_generate` callable for transformers' `generate`; `stats` sums the decode statistics of its calls, and
    `memory` is what the draft controller learned across them (plain speed, back-offs: controller.py), which the
    caller may reset or persist. Threads may share one: its statistics add up every call, and what it learns is
    learned from all of them. `reproducible`: each call plans its rounds without the clock and without `memory`, so
    that a seed (`torch.manual_seed`) samples the same tokens every call."""

    def __init__(self, skip: SkipSet | tuple[SkipSet, ...], policy: DraftPolicy, config: SkipConfig | None = None,
                 tokenizer: Any = None, compile: bool = False, compile_backend: str = "inductor",
                 cost_profile: CostProfile | None = None, reproducible: bool = False):
        self.skip, self.policy, self.config, self.tokenizer = skip, policy, config, tokenizer
        self.compile, self.compile_backend, self.cost_profile = compile, compile_backend, cost_profile
        self.reproducible = reproducible
        self.stats = DecodeStats()
        self.memory = DraftMemory()

    # The parameters mirror transformers' `_sample`, which `generate` calls with them; `stop_strings` is extra on
    # purpose: generate hands an extra parameter to the callable instead of building criteria that need a tokenizer.
    def __call__(
        self, model: torch.nn.Module, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig, synced_gpus: bool = False,
        streamer: Any = None, stop_strings: str | list[str] | None = None, **model_kwargs: Any,
    ) -> torch.LongTensor | GenerateDecoderOnlyOutput:
        # The caller of this call is generate (depth 1), which hands a callable no streamer of its own.
        streamer = streamer if streamer is not None else adapter.generate_argument("streamer", depth=1)
        assistant = adapter.generate_argument("assistant_model", depth=1)
        synced_gpus = synced_gpus or bool(adapter.generate_argument("synced_gpus", depth=1))  # never handed either
        prompt_length = input_ids.shape[1]
        try:  # every refusal inside: a consumer thread of TextIteratorStreamer waits for `end()` either way
            if assistant is not None:
                raise ValueError("self_speculative drafts with the model itself: do not give generate an "
                                 "assistant_model")
            stopping_criteria = self._checked(model, input_ids, generation_config, synced_gpus, model_kwargs,
                                              stopping_criteria, stop_strings)
            output = generate(
                model, input_ids, skip=self.skip, policy=self.policy,
                max_new_tokens=max(1, generation_config.max_length - prompt_length),
                # The prepared processors already hold temperature, top-k and top-p: no warpers of our own.
                sampling=Sampling(do_sample=bool(generation_config.do_sample)), eos_token_id=None,
                hooks=DecodeHooks(process=_processing(logits_processor), stop=_stopping(stopping_criteria),
                                  commit=(lambda tokens: streamer.put(torch.tensor(tokens))) if streamer else None),
                compile=self.compile, compile_backend=self.compile_backend, cost_profile=self.cost_profile,
                # Sampling draws random numbers per draft, so rounds planned by the clock or by what earlier calls
                # learned would give a seed other tokens each call.
                memory=DraftMemory() if self.reproducible else self.memory, timed=not self.reproducible,
            )
        finally:
            if streamer is not None:
                streamer.end()
        self._count(output.stats)
        sequences = torch.cat([input_ids, torch.tensor([output.tokens], dtype=input_ids.dtype,
                                                       device=input_ids.device)], dim=1)
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _checked(self, model: torch.nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig,
                 synced_gpus: bool, model_kwargs: dict[str, Any], stopping_criteria: StoppingCriteriaList,
                 stop_strings: str | list[str] | None) -> StoppingCriteriaList:
        """Refuse what this call cannot decode as plain generate would (ValueError); the stopping criteria, with
        `stop_strings`' own."""
        _check_supported(model, input_ids, generation_config, synced_gpus, model_kwargs)
        if self.config is not None:
            self.config.check_model(model)
            if self.tokenizer is not None:
                self.config.check_tokenizer(self.tokenizer)
        # Named as both: the length may come from max_length, which a model's generation_config may set to its
        # whole context, and the caller may have set neither.
        check_room(model, input_ids.shape[1], max(1, generation_config.max_length - input_ids.shape[1]), self.skip,
                   self.policy, flag="max_new_tokens (or max_length, which counts the prompt)")
        if stop_strings is None:
            return stopping_criteria
        if self.tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass it as self_speculative(config, tokenizer=...) "
                             "(transformers does not hand a custom_generate callable the one given to generate)")
        return StoppingCriteriaList([*stopping_criteria, adapter.stop_string_criteria(self.tokenizer, stop_strings)])

    def _count(self, stats: DecodeStats) -> None:
        with _COUNTING:  # `add` reads and writes each field: threads sharing this callable would lose a call's
            self.stats.add(stats)


# One lock for every callable (a lock of its own would keep a callable from being pickled or deep-copied).
_COUNTING = threading.Lock()


def self_speculative(
    config: Configs | Sequence[Configs], policy: DraftPolicy | None = None, *, tokenizer: Any = None,
    compile: bool = False, cost_profile: CostProfile | None = None, reproducible: bool = False,
) -> SelfSpeculative:
    """A `custom_generate` callable: `model.generate(**inputs, custom_generate=self_speculative(config))`.

    `config` is a skip config (or the path of its JSON, as `export` writes it), or a `SkipSet`
    with `policy` (default `DraftPolicy()`), or a list of them: with several skip sets (a list, or a
    config that carries several), each call chooses one of them or plain decoding for its prompt
    (choice.py; `stats.choices` says which), pricing drafts with `cost_profile` when given. A skip
    config's own draft policy is used unless `policy` is given. `tokenizer` is needed only for
    `stop_strings`. `compile` runs the draft and verify steps compiled, as `generate(..., compile=True)`
    does: the first call per skip set compiles. `reproducible=True`: sampling after `torch.manual_seed(n)` gives the
    same tokens every call (rounds planned without the clock or what earlier calls learned, so the run-time guard
    never falls back to plain decoding); by default a seed fixes the distribution's draws but not the rounds.
    """
    skips, configs = _skip_sets(config)
    combined = combine_skip_configs(configs, same_draft=policy is None) if configs else None
    if combined is not None:
        for skip in skips:
            skip.check_fits(combined.model.num_hidden_layers)
    policy = policy or (combined.draft if combined is not None else DraftPolicy())
    return SelfSpeculative(skips[0] if len(skips) == 1 else skips, policy, combined, tokenizer, compile,
                           cost_profile=cost_profile, reproducible=reproducible)


def _skip_sets(given: Configs | Sequence[Configs]) -> tuple[tuple[SkipSet, ...], list[SkipConfig]]:
    """Every skip set given, in order, and the configs among them (read from their paths)."""
    items = list(given) if isinstance(given, (list, tuple)) else [given]
    if not items:
        raise ValueError("self_speculative needs a skip set or config, got an empty list")
    skips, configs = [], []
    for item in items:
        if isinstance(item, (str, Path)):
            item = load_skip_config(item)
        if isinstance(item, SkipConfig):
            configs.append(item)
            skips.extend(item.skip_sets)
        elif isinstance(item, SkipSet):
            skips.append(item)
        else:
            raise TypeError(f"self_speculative needs a SkipConfig, a skip-config path or a SkipSet (or a list of "
                            f"them), got {'a list holding ' if isinstance(given, (list, tuple)) else ''}"
                            f"{type(item).__name__}")
    return tuple(skips), configs


def _processing(processors: LogitsProcessorList) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def process(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # As transformers' own loop: processors see float32 logits.
        logits = logits.float()
        if not processors:
            return logits
        first = ids.shape[1] - logits.shape[0] + 1
        return torch.cat([processors(ids[:, : first + i], logits[i : i + 1]) for i in range(logits.shape[0])])

    return process


def _stopping(criteria: StoppingCriteriaList) -> Callable[[torch.Tensor, int], int | None]:
    def stop(ids: torch.Tensor, new: int) -> int | None:
        first = ids.shape[1] - new + 1
        # Every new token's prefix is checked on the device, then one host transfer for the round.
        fired = torch.cat([criteria(ids[:, : first + i], None) for i in range(new)]).tolist()
        return fired.index(True) + 1 if True in fired else None

    return stop


def _check_supported(model: torch.nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig,
                     synced_gpus: bool, model_kwargs: dict[str, Any]) -> None:
    # Options first: generate has already expanded the batch for beams and return sequences.
    for name, off in _UNSUPPORTED.items():
        value = getattr(generation_config, name, off[0])
        if value not in off:
            raise ValueError(f"self_speculative does not support {name}={value!r}")
    # What plain generate would hand to a decoding method of its own (DoLa, contrastive search, ...), which
    # it refuses without trust_remote_code: this loop is greedy or sampling, and must not quietly be that instead.
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        option = _MODE_OPTIONS.get(mode)
        given = f" ({option}={getattr(generation_config, option)!r})" if option else ""
        raise ValueError(f"self_speculative decodes greedily or by sampling, not by "
                         f"{mode.name.replace('_', ' ').lower()}{given}")
    temperature = generation_config.temperature
    if mode == GenerationMode.SAMPLE and temperature is not None and not temperature >= MIN_TEMPERATURE:
        # Plain generate fails inside torch there (logits / temperature overflow): say so before any work.
        raise ValueError(f"self_speculative samples with temperature >= {MIN_TEMPERATURE:g}, got {temperature!r}: "
                         "lower samples as greedy decoding does (do_sample=False)")
    if input_ids.shape[0] != 1:
        raise ValueError(f"self_speculative decodes one sequence at a time: got a batch of {input_ids.shape[0]}")
    if model.config.is_encoder_decoder:
        raise ValueError("self_speculative supports decoder-only models")
    if synced_gpus:
        raise ValueError("self_speculative does not support synced_gpus")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("self_speculative does not support padding: the attention mask must be all ones")
    cache = adapter.generate_cache_input(model_kwargs)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("self_speculative starts from an empty cache: do not pass a filled cache")
    extra = sorted(set(model_kwargs) - adapter.PREPARED_GENERATE_INPUTS)
    if extra:
        raise ValueError(f"self_speculative does not support these model inputs: {extra}")
