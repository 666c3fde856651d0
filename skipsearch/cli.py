"""`python -m skipsearch <command>`: generate, optimize, export, plot, bench, profile, check-family."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# Nothing heavy at module level: `--help` must answer without importing torch, transformers or optuna.
from .constants import DEFAULT_MODEL, DTYPE_NAMES, MIN_TEMPERATURE
from .policy import DEPRECATED_FIELDS, DraftPolicy, deprecation

if TYPE_CHECKING:
    import optuna

    from . import models
    from .choice import Choice
    from .config import ModelInfo, SkipConfig
    from .costs import CostProfile
    from .decoding import GenerationOutput
    from .skipping import SkipSet
    from .space import SearchSpace
    from .storage import Heartbeat
    from .warmstart import NamedSkipSet


class UsageError(ValueError):
    """Bad input from the command line: reported as one line, exit code 2."""


INTERRUPTED = 130  # the exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it) or SIGTERM


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help once: not when the help already states its default, and not for
    flags whose default is None or False (their help says what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        silent = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not silent and "(default" not in text and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids such as 3,7,12, got {text!r}") from None


def _number(kind: type, is_valid: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: `kind(text)` that satisfies `is_valid`, else a one-line error saying what was expected."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not is_valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_SEED_LIMIT = 2**32  # numpy's seeds, which Optuna's samplers use

_seed = _number(int, lambda v: 0 <= v < _SEED_LIMIT, f"an integer in [0, {_SEED_LIMIT - 1}]")
_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")


def _contexts(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated context lengths such as 128,1024, got {text!r}")
    return values
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_unit_float = _number(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
_positive_float = _number(float, lambda v: 0 < v < math.inf, "a finite number > 0")
_temperature = _number(float, lambda v: MIN_TEMPERATURE <= v < math.inf,
                       f"a finite number >= {MIN_TEMPERATURE:g} (lower samples as greedy decoding does: leave out "
                       "--do-sample)")


def _text(text: str) -> str:
    """An argparse type for free text: it must be UTF-8 (undecodable bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text (byte {error.start} of {text[:20]!r})") from None
    return text


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default=None,
        help=f"Hugging Face name or local folder (default: the embedded {DEFAULT_MODEL})",
    )
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    group.add_argument(
        "--dtype", default=None, choices=DTYPE_NAMES, help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)"
    )


def _add_draft_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("drafting (defaults: the config's values, else the ones shown)")
    d = DraftPolicy()
    group.add_argument("--max-draft-tokens", type=_non_negative_int, default=None,
                       help=f"most tokens drafted per round (default: {d.max_draft_tokens})")
    group.add_argument("--fixed-draft", action="store_true",
                       help="always draft --max-draft-tokens tokens (default: each round's length planned by the draft "
                            "controller from the acceptance seen and the price of a round)")
    for flag in ("--confidence-threshold", "--target-acceptance", "--threshold-step", "--stop-rule"):
        group.add_argument(flag, default=None, help=argparse.SUPPRESS)  # deprecated: the old rules' (issue 27)
    group.add_argument("--no-guard", action="store_true",
                       help="draft even when drafting measures slower than plain decoding (default: the controller's "
                            "guard decodes plainly then, and probes drafting again later)")


def _draft_policy(args: argparse.Namespace, base: DraftPolicy) -> DraftPolicy:
    old = [f"--{name.replace('_', '-')}" for name in DEPRECATED_FIELDS if getattr(args, name, None) is not None]
    if old:
        print(f"warning: {deprecation(old, 'the flags')}", file=sys.stderr)
    return DraftPolicy(
        max_draft_tokens=base.max_draft_tokens if args.max_draft_tokens is None else args.max_draft_tokens,
        adaptive=base.adaptive and not args.fixed_draft,
        guard=base.guard and not args.no_guard,
    )


def _load(args: argparse.Namespace) -> models.LoadedModel:
    from . import models

    return models.load_model(args.model, device=args.device, dtype=args.dtype)


def _encoded_prompts(loaded: models.LoadedModel, texts: list[str], args: argparse.Namespace,
                     max_draft_tokens: int) -> list[list[int]]:
    """The prompts as token ids, each checked to leave the model room for its new and drafted tokens, in its context
    and in the device's memory."""
    from . import models

    from .kvcache import check_cache_memory

    encoded = [models.encode_prompt(loaded.tokenizer, text, raw=args.raw) for text in texts]
    for ids in encoded:
        models.check_context(loaded.model, len(ids), args.max_new_tokens, max_draft_tokens)
    # Before the study or the benchmark starts: the longest prompt's cache must fit the device as well as the context.
    check_cache_memory(loaded.model, max(map(len, encoded)) + args.max_new_tokens + max_draft_tokens)
    return encoded


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from . import models
    from .costs import CostProfile
    from .decoding import Sampling, generate
    from .inputs import check_room

    if args.config and (args.skip_attn or args.skip_mlp):
        raise UsageError("give either --config or --skip-attn/--skip-mlp, not both")
    if args.autoregressive and (args.config or args.skip_attn or args.skip_mlp):
        raise UsageError("--autoregressive decodes plainly: it takes no --config, --skip-attn or --skip-mlp")
    if not args.prompt.strip():
        raise UsageError("--prompt is empty: give the text to answer")
    profile = CostProfile.load(args.cost_profile) if args.cost_profile is not None else None
    loaded = _load(args)
    skip, base_policy, labels = _generate_skips(args, loaded.model)
    policy = _draft_policy(args, base_policy)
    sampling = Sampling(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompt_ids = models.encode_prompt(loaded.tokenizer, args.prompt, raw=args.raw)
    check_room(loaded.model, len(prompt_ids), args.max_new_tokens, skip, policy, flag="--max-new-tokens")
    generator = torch.Generator(loaded.device).manual_seed(args.seed) if args.do_sample else None
    output = generate(
        loaded.model, prompt_ids, skip=skip, max_new_tokens=args.max_new_tokens, policy=policy,
        sampling=sampling, eos_token_id=loaded.model.generation_config.eos_token_id, generator=generator,
        compile=args.compile, cost_profile=profile,
    )
    choice = output.stats.choices[0] if output.stats.choices else None
    text = loaded.tokenizer.decode(output.tokens, skip_special_tokens=True)
    _print_generation(args, text, output, choice.skip if choice else skip, _choice_text(choice, labels))
    return 0


def _generate_skips(args: argparse.Namespace, model: object
                    ) -> tuple[SkipSet | tuple[SkipSet, ...] | None, DraftPolicy, dict[SkipSet, str]]:
    """What `generate` drafts with (one skip set, several to choose among, or None), the draft policy it
    starts from, and each set's label (its --config file, or the label that file gives it)."""
    from .config import combine_skip_configs, load_skip_config
    from .skipping import SkipSet

    if args.autoregressive:
        return None, DraftPolicy(), {}
    if not args.config:
        return SkipSet.of(args.skip_attn or (), args.skip_mlp or (), model.config.num_hidden_layers), DraftPolicy(), {}
    config = combine_skip_configs([load_skip_config(path, model) for path in args.config], args.config)
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


def _print_generation(args: argparse.Namespace, text: str, output: GenerationOutput, skip: SkipSet | None,
                      choice: str = "") -> None:
    """The text (on stdout) and what decoding it took (on stderr), or both as one JSON line with --json."""
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": output.tokens,
            "skip": skip.as_dict() if skip is not None else None,
            "stats": output.stats.as_dict(),
        }))
    else:
        print(text)
        s = output.stats
        print(
            f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.rounds} rounds, "
            f"acceptance {'-' if s.acceptance_rate is None else format(s.acceptance_rate, '.2f')} "
            f"({s.accepted}/{s.drafted}), skip {skip if skip is not None and skip.size else 'none (plain decoding)'}"
            + choice + (f", compile {s.compile_time_s:.1f} s]" if args.compile else "]"),
            file=sys.stderr,
        )
        if s.guard.reason() is not None:
            print(f"[{s.guard.reason()}; --no-guard drafts regardless]", file=sys.stderr)


def _study_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", text):
        raise argparse.ArgumentTypeError(
            f"study names are 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit; got {text!r}"
        )
    return text


def _add_studies_dir(group: argparse._ActionsContainer) -> None:
    group.add_argument("--studies-dir", type=Path, default=Path("studies"),
                       help="where studies, exported configs, plots, benchmarks and cost profiles live")


def _add_study_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("study")
    group.add_argument("--study-name", type=_study_name, default="default", help="name of the Optuna study")
    _add_studies_dir(group)
    group.add_argument("--storage", default=None,
                       help="an Optuna storage: a SQLAlchemy URL such as postgresql+psycopg2://user:pw@host/db "
                            "(many machines) or journal:<file> (many processes, one machine) "
                            "(default: sqlite:///<studies-dir>/<study-name>.db)")


def _storage(args: argparse.Namespace, must_exist: bool) -> str:
    from .storage import default_storage

    if args.storage:
        return args.storage
    database = args.studies_dir / f"{args.study_name}.db"
    if must_exist and not database.is_file():
        raise UsageError(f"no study database at {database}: run `python -m skipsearch optimize` first, "
                         "or give --storage / --studies-dir")
    return default_storage(args.study_name, args.studies_dir)


def _check_output_file(path: Path, flag: str) -> None:
    """Before any work: `path` can be written as a file (it is not a folder; its folder can be made and written), or
    it is a stream this process may write (files.py's `output_target`: a character device or a FIFO)."""
    import os

    from .files import output_target
    from .models import unwritable_folder

    if path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder: name a file")
    try:
        target, stream = output_target(path)
    except ValueError as error:
        raise UsageError(f"{flag} {error}") from None
    problem = (None if os.access(target, os.W_OK) else "not writable") if stream else unwritable_folder(target.parent)
    if problem:
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {problem}")


def _check_output_folder(path: Path, flag: str) -> None:
    """Before any work: files can be written in folder `path` (made if missing)."""
    from .models import unwritable_folder

    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a file: name a folder")
    problem = unwritable_folder(path)
    if problem:
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {problem}")


def _not_made_by_skipsearch(name: str) -> UsageError:
    from .records import STUDY_ATTR

    return UsageError(f"study {name!r} was not made by skipsearch (it has no {STUDY_ATTR!r} attribute): "
                      "give another --study-name")


@dataclass
class _Optimization:
    """What `optimize` checked and loaded before it opens the study's storage."""

    loaded: models.LoadedModel
    model_info: ModelInfo
    space: SearchSpace
    policy: DraftPolicy
    prompts: list[list[int]]
    datasets: list[str]  # --dataset, each once
    prompt_datasets: list[str] | None  # each prompt's dataset, with several
    first_trials: tuple[tuple[str, SkipSet], ...]
    profile: CostProfile | None
    projections: list[tuple[str, CostProfile]]
    folder: Path  # the study's exports and plots


def cmd_optimize(args: argparse.Namespace) -> int:
    from .export import dataset_verdicts, export_trial, verdict
    from .plots import write_plots
    from .search import StudySettings, run_study, study_summary
    from .storage import redact_url
    from .worker import StopRequest

    run = _prepare_optimization(args)
    storage, heartbeat = _open_storage(args)
    datasets = run.datasets
    settings = StudySettings(
        study_name=args.study_name, storage=storage, objective=args.objective,
        sampler=args.sampler, seed=args.seed, n_trials=args.n_trials, timeout=args.timeout, min_match=args.min_match,
        dataset=datasets if len(datasets) > 1 else datasets[0], num_prompts=len(run.prompts),
        max_new_tokens=args.max_new_tokens,
        show_progress_bar=not args.no_progress, warm_starts=not args.no_warm_starts, pruning=not args.no_pruning,
        repeats=args.repeats, confirm_top=args.confirm_top, confirm_repeats=args.confirm_repeats,
        first_trials=run.first_trials, heartbeat=heartbeat, compile=args.compile or None,
    )
    model, stop = run.loaded.model, StopRequest()
    study = run_study(model, run.model_info, run.loaded.dtype_name, run.prompts, settings, run.space, run.policy,
                      model.generation_config.eos_token_id, profile=run.profile, stop=stop,
                      prompt_datasets=run.prompt_datasets)
    config = export_trial(study, run.folder / "best.json")
    exported = f"exported {run.folder / 'best.json'}: {_exported(config)}"
    print(f"study {args.study_name} in {redact_url(_storage(args, must_exist=False))}: {study_summary(study)}")
    print("\n".join([verdict(study)[1], *dataset_verdicts(study)]))
    print(exported)
    if stop.signal_name:
        # No slow extras (a scheduler's kill follows its SIGTERM), and the code of an interrupted command, so that a
        # script or a Kubernetes Job does not take the study for finished: running the command again resumes it.
        if not args.no_plots:
            print("plots not written after the stop signal: `python -m skipsearch plot` writes them")
        print(f"{args.prog}: stopped by {stop.signal_name} {stop.outcome}; {exported}", file=sys.stderr)
        return INTERRUPTED
    if run.projections:
        _print_projections(study, run, args.max_new_tokens)
    if not args.no_plots:
        written = write_plots(study, run.folder / "plots")
        print(f"plots: {', '.join(str(p) for p in written)}")
    return 0


def _prepare_optimization(args: argparse.Namespace) -> _Optimization:
    """Everything `optimize` needs, checked before the storage is opened, so a rejected run leaves no database."""
    from .config import ModelInfo
    from .costs import CostProfile, load_projections
    from .search import check_measurable, make_sampler
    from .space import SearchSpace
    from .warmstart import read_warm_starts

    policy = _draft_policy(args, DraftPolicy())
    check_measurable(args.max_new_tokens, policy.max_draft_tokens, names=("--max-new-tokens", "--max-draft-tokens"))
    warm_files = [entry for spec in args.warm_start or () for entry in read_warm_starts(spec)]
    datasets, prompts, prompt_datasets = _study_prompts(args)
    make_sampler(args.sampler, args.seed, args.objective == "pareto")
    if args.heartbeat_grace <= args.heartbeat_interval:
        raise UsageError("--heartbeat-grace must be longer than --heartbeat-interval")
    if args.cost_profile is not None and args.objective != "modeled":
        raise UsageError("--cost-profile is for --objective modeled")
    profile = CostProfile.load(args.cost_profile) if args.cost_profile is not None else None
    folder = args.studies_dir / args.study_name
    _check_output_folder(folder, "--studies-dir")
    loaded = _load(args)
    model_info = ModelInfo.of(loaded.model, loaded.name_or_path)  # refuses decoders the draft path cannot run
    space = SearchSpace(num_layers=model_info.num_hidden_layers, keep_first_last=not args.allow_first_last,
                        max_skip_fraction=args.max_skip_fraction, skip_prior=args.skip_prior)
    first_trials = _first_trials(warm_files, model_info, space, published=not args.no_warm_starts)
    encoded = _encoded_prompts(loaded, prompts, args, policy.max_draft_tokens)
    if profile is not None:
        profile.check_model(loaded.model)
    projections = load_projections(args.project_with or (), loaded.model)
    return _Optimization(loaded, model_info, space, policy, encoded, datasets, prompt_datasets, first_trials,
                         profile, projections, folder)


def _study_prompts(args: argparse.Namespace) -> tuple[list[str], list[str], list[str] | None]:
    """The datasets, the calibration prompts of each, interleaved (so that a trial the pruner stops early has
    measured each dataset), and each prompt's dataset (None with one)."""
    from .data import BUILTIN, load_prompts

    datasets = args.dataset or [BUILTIN]
    repeated = next((d for i, d in enumerate(datasets) if d in datasets[:i]), None)
    if repeated is not None:
        raise UsageError(f"--dataset {repeated!r} is given twice")
    texts = [load_prompts(d, field=args.field, split=args.split, num_prompts=args.num_prompts, seed=args.seed)
             for d in datasets]
    interleaved = [(text, d) for row in zip(*texts) for text, d in zip(row, datasets)]
    return datasets, [text for text, _ in interleaved], [d for _, d in interleaved] if len(datasets) > 1 else None


def _open_storage(args: argparse.Namespace) -> tuple[optuna.storages.BaseStorage, Heartbeat]:
    """The study's storage (made if missing), refused if it holds a study of that name not made by skipsearch."""
    from .records import made_by_skipsearch
    from .storage import Heartbeat, existing_study, make_storage

    heartbeat = Heartbeat(args.heartbeat_interval, args.heartbeat_grace, args.max_retries)
    if args.storage is None:
        args.studies_dir.mkdir(parents=True, exist_ok=True)  # the default SQLite file lives there
    storage = make_storage(_storage(args, must_exist=False), heartbeat)
    existing = existing_study(storage, args.study_name)
    # A study with no trials yet may be one that a worker started beside this one has created a moment ago and
    # not yet labelled; taking it over loses nothing.
    if existing is not None and existing[1] > 0 and not made_by_skipsearch(existing[0]):
        raise _not_made_by_skipsearch(args.study_name)
    return storage, heartbeat


def _print_projections(study: optuna.Study, run: _Optimization, max_new_tokens: int, top: int = 3) -> None:
    """The best measured skip sets' predicted speedups with other devices' profiles (`--project-with`)."""
    from .costs import decode_stats, projection_lines
    from .ranking import ranked

    model = run.loaded.model
    measured = []
    for trial in ranked(study)[:top]:
        stats = decode_stats(model, run.prompts, trial.skip, run.policy, max_new_tokens,
                             model.generation_config.eos_token_id)
        speedup = trial.figures.speedup.estimate if trial.figures.speedup else float("nan")
        measured.append((f"trial {trial.number}, {trial.skip} (measured here {speedup:.2f}x)", trial.skip, stats))
    if not measured:
        print("--project-with: no completed trial skips anything, nothing to project")
        return
    print("\n".join(projection_lines(run.projections, measured, run.policy.adaptive)))


def _first_trials(files: list[NamedSkipSet], model: ModelInfo, space: SearchSpace,
                  published: bool) -> tuple[tuple[str, SkipSet], ...]:
    """--warm-start sets (each must fit the model and the search space, else UsageError), then the published
    sets made for a model of this shape that the space can propose."""
    from .config import MODEL_SHAPE
    from .published import matching_skip_sets
    from .warmstart import outside_space

    chosen = []
    for entry in files:
        if entry.model is not None and not entry.matches(model):
            made_for = ", ".join(f"{k}={entry.model.get(k)!r}" for k in MODEL_SHAPE)
            raise UsageError(f"warm start {entry.origin} was made for another model ({made_for})")
        skip = entry.skip_set(model.num_hidden_layers)
        reason = outside_space(skip, space)
        if reason:
            raise UsageError(f"warm start {entry.origin} is outside the search space: {reason}")
        chosen.append((entry.origin, skip))
    for entry in matching_skip_sets(model) if published else ():
        skip = entry.skip_set(model.num_hidden_layers)
        reason = outside_space(skip, space)
        if reason:
            print(f"published skip set {entry.origin} left out: {reason}")
        else:
            chosen.append((entry.origin, skip))
    if chosen:
        print(f"warm starts: {', '.join(name for name, _ in chosen)}")
    return tuple(chosen)


def _load_skipsearch_study(args: argparse.Namespace) -> optuna.Study:
    from .records import STUDY_ATTR, read_label
    from .storage import load_study

    study = load_study(args.study_name, _storage(args, must_exist=True))
    try:
        label = read_label(study)
    except ValueError:
        raise UsageError(f"study {args.study_name!r} has a damaged {STUDY_ATTR!r} attribute") from None
    if label is None:
        raise _not_made_by_skipsearch(args.study_name)
    return study


def cmd_export(args: argparse.Namespace) -> int:
    from .config import save_skip_config
    from .export import dataset_verdicts, export_trial, verdict, write_dv

    default_name = "skip_layers.json" if args.format == "dv" else "best.json"
    output = args.output or args.studies_dir / args.study_name / default_name
    _check_output_file(output, "--output")
    study = _load_skipsearch_study(args)
    config = export_trial(study, output, args.trial, write=write_dv if args.format == "dv" else save_skip_config)
    if args.trial is None:
        print("\n".join([verdict(study)[1], *dataset_verdicts(study)]))
    print(f"exported {output}: {_exported(config)}")
    return 0


def _exported(config: SkipConfig) -> str:
    """What an exported config skips, for the line that names its file."""
    if config.others:
        sets = "; ".join(f"{entry.label}: {entry.skip}" for entry in config.entries)
        return f"{len(config.entries)} skip sets, one chosen per prompt at decoding ({sets})"
    return f"skip {config.skip if config.skip.size else 'nothing (plain decoding)'}"


def cmd_plot(args: argparse.Namespace) -> int:
    from .plots import write_plots

    output = args.output or args.studies_dir / args.study_name / "plots"
    _check_output_folder(output, "--output")
    study = _load_skipsearch_study(args)
    if not any(t.state.name == "COMPLETE" for t in study.trials):
        raise UsageError(f"study {args.study_name!r} has no completed trial to plot yet")
    for path in write_plots(study, output):
        print(path)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import bench_verdict, format_table, run_bench, write_outputs
    from .config import load_skip_config
    from .costs import CostProfile, contexts_for, device_name, load_projections, profile_costs
    from .data import load_prompts

    prompts = load_prompts(args.dataset, field=args.field, split=args.split, num_prompts=args.num_prompts,
                           seed=args.seed)
    output_dir = args.output_dir or args.studies_dir / "bench"
    _check_output_folder(output_dir, "--output-dir" if args.output_dir else "--studies-dir")
    if args.config and load_skip_config(args.config).others:  # a broken file is reported before the model loads
        raise UsageError(f"--config {str(args.config)!r} carries several skip sets: bench measures one; "
                         "`generate --config` chooses among them per prompt")
    if args.cost_profile:
        CostProfile.load(args.cost_profile)
    loaded = _load(args)
    config = load_skip_config(args.config, loaded.model) if args.config else None
    if args.project_with and (config is None or not config.skip.size):
        raise UsageError("--project-with needs a --config that skips something")
    projections = load_projections(args.project_with or (), loaded.model)
    num_layers = loaded.model.config.num_hidden_layers
    if args.early_exit_layer is not None and not 1 <= args.early_exit_layer < num_layers:
        raise UsageError(f"--early-exit-layer must be in 1..{num_layers - 1} for this model, got {args.early_exit_layer}")
    encoded = _encoded_prompts(loaded, prompts, args, max_draft_tokens=16)
    profile = None
    if config is not None and config.skip.size:
        if args.cost_profile:
            profile = CostProfile.load(args.cost_profile)
            profile.check_model(loaded.model)
        else:
            profile = profile_costs(loaded.model, contexts=contexts_for(loaded.model, encoded, args.max_new_tokens),
                                    show_progress=not args.no_progress)
    rows = run_bench(loaded.model, encoded, args.max_new_tokens, loaded.model.generation_config.eos_token_id,
                     config=config, early_exit_layer=args.early_exit_layer,
                     prompt_lookup_tokens=args.prompt_lookup_tokens, repeats=args.repeats, profile=profile,
                     show_progress=not args.no_progress, project_with=projections, compile=args.compile)
    print(format_table(rows))
    for row in rows:
        for label, speedup in (row.projected_speedups or {}).items():
            print(f"PREDICTION (cost model, not measured) on {label}: {row.method} {speedup:.2f}x over plain decoding")
    verdict = bench_verdict(rows, config)
    if verdict:
        print(verdict)
    settings = {"model": loaded.name_or_path, "device": str(loaded.device), "dtype": loaded.dtype_name,
                "dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats, "config": str(args.config) if args.config else None,
                "device_name": device_name(loaded.device), "torch_threads": torch.get_num_threads(),
                "project_with": [str(p) for p in args.project_with or ()]}
    json_path, png_path = write_outputs(rows, output_dir, settings, verdict)
    print(f"wrote {json_path} and {png_path}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import dataclasses

    from . import models
    from .costs import format_profile, profile_costs, study_compile_mode

    output = args.output or args.studies_dir / "cost-profile.json"
    _check_output_file(output, "--output" if args.output else "--studies-dir")
    if args.config_only:
        model = models.model_from_config(args.model, device=args.device, dtype=args.dtype)
    else:
        model = _load(args).model
    mode = "regional" if args.compile else study_compile_mode(model.device)
    profile = profile_costs(model, contexts=args.contexts, repeats=args.repeats, show_progress=not args.no_progress,
                            compile_mode=mode)
    weights = "random (built from the config alone)" if args.config_only else "real"
    profile = dataclasses.replace(profile, provenance={**profile.provenance, "model": args.model or models.DEFAULT_MODEL,
                                                       "weights": weights, "steps": mode or "eager"})
    profile.save(output)
    print(format_profile(profile))
    print(f"wrote {output}")
    return 0


def cmd_check_family(args: argparse.Namespace) -> int:
    from .families import check_family, format_check
    from .models import load_config

    check = check_family(load_config(args.model), seed=args.seed, compile=not args.no_compile)
    print(format_check(check))
    return 0 if not check.problems else 1


def _add_prompt_flags(parser: argparse.ArgumentParser, num_prompts: int, max_new_tokens: int,
                      several_datasets: bool = False) -> None:
    from .data import BUILTIN

    data = parser.add_argument_group("prompts")
    kinds = "'builtin' (32 prompts shipped), a local .json/.jsonl file, or a Hub dataset name"
    if several_datasets:
        data.add_argument("--dataset", action="append", default=None,
                          help=f"{kinds}; repeatable: --num-prompts of each are decoded, and sets are ranked per "
                               f"dataset too, so best.json carries each dataset's best set (default: {BUILTIN})")
    else:
        data.add_argument("--dataset", default=BUILTIN, help=kinds)
    data.add_argument("--field", default="prompt", help="the dataset field holding the prompt text")
    data.add_argument("--split", default="train", help="the split of a Hub dataset")
    data.add_argument("--num-prompts", type=_positive_int, default=num_prompts, help="prompts to decode")
    data.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens, help="tokens decoded per prompt")
    data.add_argument("--raw", action="store_true", help="tokenize prompts as is, without the chat template")


def _add_compile_flag(parser: argparse.ArgumentParser,
                      on_cpu: str = "frozen weights and autotuned GEMMs on a CPU, about 100 s per step to compile",
                      when: str = "the first call compiles") -> None:
    parser.add_argument("--compile", action="store_true",
                        help=f"torch.compile the draft and verify steps (CUDA graphs on CUDA; {on_cpu}); {when}")


Commands = argparse._SubParsersAction
Formatter = type[argparse.HelpFormatter]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m skipsearch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add_command in (_add_generate, _add_optimize, _add_bench, _add_profile, _add_export, _add_plot,
                        _add_check_family):
        add_command(commands, _DefaultsFormatter)
    for sub in commands.choices.values():
        # The tool's own errors start like argparse's ("python -m skipsearch plot: error: ..."): one form for both.
        sub.set_defaults(prog=sub.prog)
    return parser


def _add_generate(commands: Commands, formatter: Formatter) -> None:
    gen = commands.add_parser(
        "generate", help="decode one prompt with self-speculative decoding", formatter_class=formatter,
        description="Decode one prompt with self-speculative decoding (greedy output equals plain greedy decoding). "
                    "The skip set comes from --config or --skip-attn/--skip-mlp; with neither, nothing is skipped and "
                    "the prompt is decoded plainly. With several skip sets, the one whose drafts agree best with the "
                    "full model over the prompt's last tokens is chosen, or plain decoding when none pays.",
    )
    gen.add_argument("--prompt", required=True, type=_text, help="the user message")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--config", action="append", metavar="FILE",
                     help="skip config JSON exported by `optimize` / `export`; repeatable: with several skip sets "
                          "(several files, or a file that carries several), the prefill chooses one of them or plain "
                          "decoding for the prompt")
    gen.add_argument("--cost-profile", type=Path, default=None,
                     help="with several skip sets: price each set's drafts with this profile from `profile` when "
                          "choosing (default: the share of the weights each draft reads)")
    gen.add_argument("--skip-attn", type=_int_list, default=None, help="attention layers to skip, e.g. 3,7")
    gen.add_argument("--skip-mlp", type=_int_list, default=None, help="MLP layers to skip, e.g. 12")
    gen.add_argument("--autoregressive", action="store_true", help="decode plainly through the same loop")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most")
    gen.add_argument("--do-sample", action="store_true", help="sample (speculative rejection sampling) instead of greedy")
    gen.add_argument("--temperature", type=_temperature, default=1.0, help="sampling temperature")
    gen.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=_unit_float, default=None, help="nucleus sampling mass")
    gen.add_argument("--seed", type=_seed, default=0, help="sampling seed")
    gen.add_argument("--json", action="store_true", help="print text, token ids and statistics as JSON")
    _add_draft_flags(gen)
    _add_model_flags(gen)
    _add_compile_flag(gen)
    gen.set_defaults(run=cmd_generate)


def _add_optimize(commands: Commands, formatter: Formatter) -> None:
    opt = commands.add_parser(
        "optimize", help="search for the skip set that decodes fastest", formatter_class=formatter,
        description="Run (or resume) an Optuna study over attention/MLP skip sets, each measured paired with plain "
                    "decoding; re-measure the best few, export the one confirmed faster (else plain decoding) as "
                    "JSON and plot the study. Re-running the same command resumes the study up to --n-trials.",
    )
    _add_prompt_flags(opt, num_prompts=4, max_new_tokens=32, several_datasets=True)
    _add_search_flags(opt.add_argument_group("search"))
    _add_worker_flags(opt.add_argument_group("workers and crash recovery (SQLite / PostgreSQL storages)"))
    out = opt.add_argument_group("output")
    out.add_argument("--no-plots", action="store_true", help="do not write plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_study_flags(opt)
    _add_draft_flags(opt)
    _add_model_flags(opt)
    opt.add_argument("--compile", action="store_true",
                     help="compiled draft and verify steps on a CPU too (always on CUDA, as CUDA graphs): each layer "
                          "kind compiles once for the whole study, a new skip set compiles nothing")
    opt.set_defaults(run=cmd_optimize)


def _add_search_flags(search: argparse._ArgumentGroup) -> None:
    from .constants import OBJECTIVES, SAMPLERS

    search.add_argument("--objective", choices=OBJECTIVES, default="speed_x_acceptance",
                        help="speedup x acceptance rate, speedup alone, both as a Pareto front, or the speedup "
                             "the cost model predicts from measured acceptance (deterministic)")
    search.add_argument("--cost-profile", type=Path, default=None,
                        help="with --objective modeled: a profile from `python -m skipsearch profile`, e.g. of a "
                             "GPU (default: profile this device when the study starts)")
    search.add_argument("--project-with", type=Path, action="append", metavar="PROFILE",
                        help="also print the best sets' speedup PREDICTED with this cost profile, e.g. a GPU's "
                             "(repeatable; a prediction, not a measurement)")
    search.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna sampler")
    search.add_argument("--n-trials", type=_positive_int, default=20,
                        help="distinct skip sets the study should evaluate (a re-run resumes up to this; repeated "
                             "proposals are answered from earlier trials and do not count)")
    search.add_argument("--timeout", type=_positive_float, default=None, help="stop after this many seconds")
    search.add_argument("--seed", type=_seed, default=0, help="seed of the sampler and of the prompt selection")
    search.add_argument("--skip-prior", type=_unit_float, default=0.15,
                        help="share of sublayers a uniform draw skips (0.5: the plain 2L-switch space)")
    search.add_argument("--max-skip-fraction", type=_unit_float, default=0.5, help="never skip more than this share")
    search.add_argument("--allow-first-last", action="store_true",
                        help="let the search skip sublayers of the first and last layers (kept by default)")
    search.add_argument("--min-match", type=_unit_float, default=0.5,
                        help="prune a skip set whose teacher-forced draft/full agreement is below this (0: never)")
    search.add_argument("--no-pruning", action="store_true",
                        help="never stop a trial early (the Wilcoxon pruner compares it prompt by prompt with the best)")
    search.add_argument("--repeats", type=_positive_int, default=1,
                        help="paired runs (plain, then skip set, alternating order) per prompt in a trial")
    search.add_argument("--confirm-top", type=_non_negative_int, default=3,
                        help="best distinct skip sets re-measured against plain decoding before export, and with "
                             "several --dataset each dataset's best as many (0: none, so plain decoding is exported)")
    search.add_argument("--confirm-repeats", type=_positive_int, default=2,
                        help="paired runs per prompt when confirming")
    search.add_argument("--no-warm-starts", action="store_true",
                        help="do not enqueue the structured first trials, nor the published skip sets of a model "
                             "of this shape (--warm-start files still are)")
    search.add_argument("--warm-start", action="append", metavar="FILE[:NAME]",
                        help="enqueue the skip sets of FILE as the first trials: a skipsearch config, or a Draft & "
                             "Verify / SWIFT skip_layers.json ({\"<name>\": {\"attention\": [...], \"mlp\": [...]}}); "
                             ":NAME picks one entry; repeatable")


def _add_worker_flags(workers: argparse._ArgumentGroup) -> None:
    workers.add_argument("--heartbeat-interval", type=_positive_int, default=60,
                         help="seconds between a running trial's heartbeats")
    workers.add_argument("--heartbeat-grace", type=_positive_int, default=180,
                         help="seconds without a heartbeat after which a trial's worker is taken for dead, "
                              "its trial failed and retried")
    workers.add_argument("--max-retries", type=_non_negative_int, default=2,
                         help="times a dead worker's trial is retried")


def _add_bench(commands: Commands, formatter: Formatter) -> None:
    bench = commands.add_parser(
        "bench", help="compare skipsearch with HF greedy and its training-free peers", formatter_class=formatter,
        description="Decode the same prompts with HF greedy (the baseline), HF prompt lookup, HF early exit, "
                    "skipsearch plain and skipsearch with --config; print a table, write JSON and a bar chart.",
    )
    bench.add_argument("--config", type=Path, default=None, help="skip config JSON to benchmark")
    bench.add_argument("--early-exit-layer", type=_positive_int, default=None,
                       help="also run HF assistant_early_exit at this layer (LayerSkip-style)")
    bench.add_argument("--prompt-lookup-tokens", type=_non_negative_int, default=10,
                       help="HF prompt lookup decoding's n-gram draft length (0: leave it out)")
    bench.add_argument("--repeats", type=_positive_int, default=3,
                       help="times every prompt is decoded by every method (back to back, rotating order); speedups "
                            "are geometric means of the paired runs with a 95%% interval")
    bench.add_argument("--cost-profile", type=Path, default=None,
                       help="cost profile for the predicted speedup (default: profile this device)")
    bench.add_argument("--project-with", type=Path, action="append", metavar="PROFILE",
                       help="also print the config's speedup PREDICTED with this cost profile, e.g. a GPU's "
                            "(repeatable; a prediction, not a measurement; stored in bench.json)")
    bench.add_argument("--seed", type=_seed, default=0, help="seed of the prompt selection")
    bench.add_argument("--output-dir", type=Path, default=None,
                       help="where bench.json/.png go (default: <studies-dir>/bench)")
    _add_studies_dir(bench)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_prompt_flags(bench, num_prompts=4, max_new_tokens=48)
    _add_model_flags(bench)
    _add_compile_flag(bench)
    bench.set_defaults(run=cmd_bench)


def _add_profile(commands: Commands, formatter: Formatter) -> None:
    prof = commands.add_parser(
        "profile", help="measure the cost model of this device and save it as JSON", formatter_class=formatter,
        description="Time attention, MLP, the rest of a forward and verification of 1..9 tokens at several "
                    "context lengths on this device and dtype, and what decoding pays besides forwards; "
                    "`optimize --objective modeled --cost-profile`, `bench` and `--project-with` read the file.",
    )
    prof.add_argument("--output", type=Path, default=None,
                      help="profile JSON to write (default: <studies-dir>/cost-profile.json)")
    _add_studies_dir(prof)
    prof.add_argument("--contexts", type=_contexts, default=None,
                      help="context lengths (cached tokens) to time at, e.g. 128,1024,4096 (default: 128,1024 on a "
                           "CPU; on CUDA up to 32768 as the model's positions and the device's memory allow)")
    prof.add_argument("--config-only", action="store_true",
                      help="build --model from its config alone (a folder with config.json, a config .json file or "
                           "a Hub name, whose weights are not fetched) with random weights: costs do not depend "
                           "on the weights' values")
    prof.add_argument("--repeats", type=_positive_int, default=20, help="timed runs per measurement (median)")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    prof.add_argument("--compile", action="store_true",
                      help="time the compiled steps studies run (regional) on a CPU too; on CUDA they are always timed, "
                           "as CUDA graphs")
    _add_model_flags(prof)
    prof.set_defaults(run=cmd_profile)


def _add_export(commands: Commands, formatter: Formatter) -> None:
    exp = commands.add_parser("export", help="write a trial's skip config as JSON", formatter_class=formatter,
                              description="Write the study's decision as a skip-config JSON: the skip set its confirmation "
                                          "found faster than plain decoding, else plain decoding; or trial N with "
                                          "--trial N.")
    exp.add_argument("--trial", type=_non_negative_int, default=None, help="trial number (default: the study's confirmed decision)")
    exp.add_argument("--format", choices=("skipsearch", "dv"), default="skipsearch",
                     help="skipsearch: the skip-config JSON; dv: Draft & Verify / SWIFT's skip_layers.json format "
                          "({\"<model>\": {\"attention\": [...], \"mlp\": [...]}})")
    exp.add_argument("--output", type=Path, default=None,
                     help="(default: <studies-dir>/<study-name>/best.json, or skip_layers.json with --format dv)")
    _add_study_flags(exp)
    exp.set_defaults(run=cmd_export)


def _add_plot(commands: Commands, formatter: Formatter) -> None:
    plot = commands.add_parser("plot", help="write the study's plots as PNG files", formatter_class=formatter,
                               description="Write optimization history, parameter importances, skip map, "
                                           "speedup vs skipped fraction (and the Pareto front) as PNG files.")
    plot.add_argument("--output", type=Path, default=None, help="(default: <studies-dir>/<study-name>/plots)")
    _add_study_flags(plot)
    plot.set_defaults(run=cmd_plot)


def _add_check_family(commands: Commands, formatter: Formatter) -> None:
    check = commands.add_parser(
        "check-family", help="check that skipsearch runs a model family right, on a tiny model of its config",
        formatter_class=formatter,
        description="Build a tiny random-weight model of --model's config (4 layers, hidden size 32; no weights are "
                    "fetched) and check the draft path against the definition of a skip: its logits equal the "
                    "model's with the skipped sublayers' outputs zeroed by forward hooks, and with every sublayer "
                    "zeroed the layers pass the residual stream through; then greedy self-speculative decoding, eager "
                    "and compiled, equals transformers' greedy output. Exit 0 when every check passes, 1 when one "
                    "fails, 2 for a family the tool cannot run (with why).",
    )
    check.add_argument("--model", required=True,
                       help="the config: a folder with config.json, a config .json file or a Hub name")
    check.add_argument("--seed", type=_seed, default=0, help="seed of the random weights")
    check.add_argument("--no-compile", action="store_true", help="leave out the compiled decoding (dynamo, ~1 min)")
    check.set_defaults(run=cmd_check_family)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM, which batch schedulers (Slurm, Kubernetes) send before they kill, raises KeyboardInterrupt as Ctrl-C
    does, instead of ending the process at once and silently: a study's trials and confirmation handle both signals
    themselves (worker.py's `stop_on_signals`), anything else ends in "interrupted". Handlers can only be set in the
    main thread: elsewhere SIGTERM keeps its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _console_that_cannot_fail() -> Iterator[None]:
    """stdout and stderr that replace what their encoding cannot show (a non-ASCII prompt or folder name under
    `LC_ALL=C PYTHONIOENCODING=ascii`) instead of raising: the error would come after the work is done, lose the
    summary, and exit 2 as if the input were bad. Files are UTF-8 whatever the locale (files.py)."""
    changed = [stream for stream in (sys.stdout, sys.stderr)
               if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure")]
    for stream in changed:
        stream.reconfigure(errors="replace")
    try:
        yield
    finally:
        for stream in changed:
            stream.reconfigure(errors="strict")


@contextlib.contextmanager
def _resource_errors_quiet_in_threads() -> Iterator[None]:
    """Optuna's heartbeat thread writes the study's storage too: on a full disk its write fails there as well, and
    Python would print that thread's traceback beside the one line that the main thread's error gets."""
    from .errors import exhausted_resource

    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if exhausted_resource(args.exc_value) is None:
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with _console_that_cannot_fail():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from .files import home_folder

    try:
        home_folder()  # before transformers, datasets and matplotlib derive their caches from HOME
    except ValueError as error:
        return _fail(args, error, 2)
    # The CLI prints its own progress; transformers' weight-loading bars would bury the one-line errors.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # per-trial INFO lines would drown the progress bar
    try:
        with _sigterm_as_ctrl_c(), _resource_errors_quiet_in_threads():
            return args.run(args)
    except KeyboardInterrupt:
        print(f"{args.prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as error:
        return _report(args, error)


def _report(args: argparse.Namespace, error: Exception) -> int:
    """One line on stderr for an error that ends a command, and its exit code: a resource that ran out (disk space, a
    file-size limit, memory) RESOURCE_EXIT, bad input 2, another fault of the machine (an OSError) 1. Anything else
    is a bug, and keeps its traceback."""
    from .errors import RESOURCE_EXIT, exhausted_resource, resource_error

    found = exhausted_resource(error)
    if found is not None:
        filename = getattr(found[1], "filename", None)
        doing = f"writing {str(filename)!r}" if filename else f"`{args.command}`"
        return _fail(args, resource_error(error, doing, "free some and run the command again"), RESOURCE_EXIT)
    if isinstance(error, ValueError):
        return _fail(args, error, 2)
    if isinstance(error, OSError) and error.strerror:
        return _fail(args, error.strerror + (f": {error.filename}" if error.filename else ""), 1)
    raise error


def _fail(args: argparse.Namespace, message: object, code: int) -> int:
    """Print `message` as the command's one error line, the storage URL's secrets redacted; return `code`."""
    from .storage import redact_text

    print(f"{args.prog}: error: {redact_text(str(message), getattr(args, 'storage', None))}", file=sys.stderr)
    return code
