"""`generate`: decode one prompt, drafting with a skip config's sets, with sets given by layer ids, or plainly."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..decode.checks import check_room
from ..decode.choice import Choice
from ..decode.config import combine_skip_configs, load_skip_config
from ..decode.controller import DraftMemory, check_learned_by
from ..decode.cost_profile import CostProfile
from ..decode.loop import generate
from ..decode.policy import DraftPolicy, drafting_sets
from ..decode.sampling import Sampling
from ..decode.skipset import SkipSet
from ..decode.stats import GenerationOutput
from ..io import models
from ..io.files import check_output_file
from .options import DraftOptions, ModelOptions


@dataclass(frozen=True)
class GenerateSettings(ModelOptions, DraftOptions):
    prompt: str = ""
    raw: bool = False
    config: list[Path] | None = None  # skip configs: with several sets, the prefill chooses among them
    cost_profile: Path | None = None
    skip_attn: list[int] | None = None
    skip_mlp: list[int] | None = None
    autoregressive: bool = False
    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float | None = None  # None: 1.0 when sampling
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: 0 when sampling
    compile: bool = False
    memory: Path | None = None  # what the guard learned in earlier runs: read where the file exists, written after


@dataclass(frozen=True)
class Generation:
    text: str
    output: GenerationOutput
    skip: SkipSet | None  # what it drafted with: the one set, the prefill's choice among several, or None
    choice: str  # how the prefill chose among several sets, for the summary line ("" when it made no choice)


def generate_text(settings: GenerateSettings) -> Generation:
    """Decode `settings.prompt` as `python -m skipsearch generate` does."""
    s = settings
    if s.config and (s.skip_attn or s.skip_mlp):
        raise ValueError("give either --config or --skip-attn/--skip-mlp, not both")
    if s.autoregressive and (s.config or s.skip_attn or s.skip_mlp):
        raise ValueError("--autoregressive decodes plainly: it takes no --config, --skip-attn or --skip-mlp")
    if not s.prompt.strip():
        raise ValueError("--prompt is empty: give the text to answer")
    _check_sampling(s)
    if s.max_draft_tokens == 0 and (s.config or s.skip_attn or s.skip_mlp):
        raise ValueError("--max-draft-tokens 0 drafts nothing, so the skip set would never be used: give it >= 1, "
                         "or decode plainly with --autoregressive")
    profile = CostProfile.load(s.cost_profile) if s.cost_profile is not None else None
    stored = _stored_memory(s.memory)  # before the model loads, which can take minutes
    for path in s.config or ():  # a broken file too; whether it fits the model is checked once that is loaded
        load_skip_config(path)
    sampling = Sampling(do_sample=s.do_sample, temperature=1.0 if s.temperature is None else s.temperature,
                        top_k=s.top_k, top_p=s.top_p)
    loaded = s.load()
    learned_by = f"{_model_name(s.model, loaded)} on {loaded.device} ({loaded.model.dtype})"
    if stored is not None:
        check_learned_by(s.memory, stored[1], learned_by)
    memory = stored[0] if stored is not None else DraftMemory()
    skip, base_policy, labels = _skips(s, loaded.model, loaded.tokenizer)
    policy = s.policy(base_policy)
    prompt_ids = models.encode_prompt(loaded.tokenizer, s.prompt, raw=s.raw)
    check_room(loaded.model, len(prompt_ids), s.max_new_tokens, skip, policy, flag="--max-new-tokens")
    generator = torch.Generator(loaded.device).manual_seed(s.seed or 0) if s.do_sample else None
    output = generate(
        loaded.model, prompt_ids, skip=skip, max_new_tokens=s.max_new_tokens, policy=policy,
        sampling=sampling, eos_token_id=loaded.model.generation_config.eos_token_id, generator=generator,
        compile=s.compile, cost_profile=profile, memory=memory,
        timed=not s.do_sample,  # rounds planned by the clock would give one --seed other tokens run to run
    )
    if s.memory is not None:  # writable, and with room, as checked before decoding
        memory.save(s.memory, learned_by)
    choice = output.stats.choices[0] if output.stats.choices else None
    # Sets that do not draft are no candidates: of several configs, one drafting set is decoded without a choice.
    drafting = drafting_sets(skip, policy)
    used = choice.skip if choice else drafting[0] if drafting else None
    text = loaded.tokenizer.decode(output.tokens, skip_special_tokens=True)
    return Generation(text, output, used, _choice_text(choice, labels))


def _check_sampling(s: GenerateSettings) -> None:
    """Sampling's flags without --do-sample would be ignored, and --memory would be too with it: say so."""
    given = [flag for flag, value in (("--temperature", s.temperature), ("--top-k", s.top_k), ("--top-p", s.top_p),
                                      ("--seed", s.seed)) if value is not None]
    if given and not s.do_sample:
        raise ValueError(f"{', '.join(given)} {'shapes' if len(given) == 1 else 'shape'} sampling: add --do-sample "
                         "(without it decoding is greedy)")
    if s.do_sample and s.memory is not None:
        raise ValueError("--memory keeps what this machine's timings taught the guard, and --do-sample plans its "
                         "rounds without them so that --seed gives the same text every run: give one or the other")


def _stored_memory(path: Path | None) -> tuple[DraftMemory, str] | None:
    """The draft memory at `path` and what it was learned by (None: no file yet, or no --memory), once `path` is
    known to be a file that can be read and written back."""
    if path is None:
        return None
    check_output_file(path, "--memory")
    if not path.exists():
        return None
    if not path.is_file():  # read, then written back: a stream would be neither
        raise ValueError(f"--memory {str(path)!r} is not a regular file: name a file")
    return DraftMemory.read(path)


def _model_name(given: str | None, loaded: models.LoadedModel) -> str:
    """The model as a memory names it: a local path resolved (./m and /abs/m are one model), else its name."""
    return str(Path(given).resolve()) if given is not None and Path(given).exists() else loaded.name_or_path


def _skips(s: GenerateSettings, model: torch.nn.Module, tokenizer: Any = None
           ) -> tuple[SkipSet | tuple[SkipSet, ...] | None, DraftPolicy, dict[SkipSet, str]]:
    """What `generate` drafts with (one skip set, several to choose among, or None), the draft policy it
    starts from, and each set's label (its --config file, or the label that file gives it)."""
    if s.autoregressive:
        return None, DraftPolicy(), {}
    if not s.config:
        return SkipSet.of(s.skip_attn or (), s.skip_mlp or (), model.config.num_hidden_layers), DraftPolicy(), {}
    config = combine_skip_configs([load_skip_config(path, model, tokenizer) for path in s.config], s.config)
    labels = {entry.skip: entry.label for entry in config.entries}
    return config.skip_sets if config.others else config.skip, config.draft, labels


def _choice_text(choice: Choice | None, labels: dict[SkipSet, str]) -> str:
    """How the prefill chose among several skip sets, for the summary line ("" when it made no choice)."""
    if choice is None:
        return ""
    agreements = ", ".join(f"{labels.get(skip, str(skip))} {agreement:.2f}"
                           for skip, agreement in zip(choice.candidates, choice.agreements))
    chosen = "plain decoding" if choice.skip is None else labels.get(choice.skip, str(choice.skip))
    return (f"; {chosen} chosen among {len(choice.candidates)} sets and plain decoding by their agreement with the "
            f"full model over the prompt's last {choice.window} tokens: {agreements}")
