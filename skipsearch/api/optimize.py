"""`optimize`: run (or resume) a study, confirm its best sets, export the decision, project it and plot the study."""

from __future__ import annotations

import re
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import optuna

from ..decode.config import MODEL_SHAPE, ModelInfo, SkipConfig, save_skip_config
from ..decode.cost_profile import CostProfile
from ..decode.policy import DraftPolicy
from ..decode.skipset import SkipSet
from ..io import models
from ..io.data import BUILTIN, CATEGORY_FIELD, NO_CATEGORIES, PromptRow, draw_per_category, load_rows, prompt_digest
from ..io.files import check_output_folder
from ..report.export import (categories_confirmed, category_config, dataset_verdicts, decided_config, export_trial,
                              exported_text, verdict)
from ..report.plots import write_plots
from ..report.projections import decode_stats, load_projections, projection_lines
from ..search.published import matching_skip_sets
from ..search.ranking import quoted_speedup, ranked
from ..search.records import made_by_skipsearch, study_label, study_summary
from ..search.settings import StudySettings, check_measurable
from ..search.space import SearchSpace
from ..search.storage import Heartbeat, existing_study, make_storage, redact_url
from ..search.study import make_sampler, run_study
from ..search.warmstart import NamedSkipSet, outside_space, read_warm_starts
from ..search.worker import StopRequest
from .options import DraftOptions, ModelOptions, StudyOptions, not_made_by_skipsearch, special_token_ids
from .prompts import TOO_LONG, encode_rows


@dataclass(frozen=True)
class OptimizeSettings(ModelOptions, DraftOptions, StudyOptions):
    """`python -m skipsearch optimize`'s flags, by name, with its defaults."""

    dataset: list[str] | None = None  # each --num-prompts prompts (None: the builtin prompts)
    field: str = "prompt"
    split: str = "train"
    num_prompts: int = 4
    max_new_tokens: int = 32
    raw: bool = False
    objective: str = "speed_x_acceptance"
    cost_profile: Path | None = None
    project_with: list[Path] | None = None
    sampler: str = "tpe"
    n_trials: int = 20
    timeout: float | None = None
    seed: int = 0
    skip_prior: float = 0.15
    max_skip_fraction: float = 0.5
    head_rows: tuple[int, ...] | None = None  # trimmed draft heads to try (None: `default_head_rows`; (): none)
    head_prompts: int = 16  # prompts the heads' ranking is made from: the dataset's, never calibration prompts
    allow_first_last: bool = False
    min_match: float = 0.5
    no_pruning: bool = False
    repeats: int = 1
    confirm_top: int = 3
    confirm_repeats: int = 2
    no_warm_starts: bool = False
    warm_start: list[str] | None = None
    heartbeat_interval: int = 60
    heartbeat_grace: int = 180
    max_retries: int = 2
    no_plots: bool = False
    no_progress: bool = False
    compile: bool = False
    category_field: str | None = None  # None: "category" where the rows have it; "none": no categories
    too_long: str = "refuse"  # or "skip": a prompt the model's context cannot hold
    per_category: bool = False  # one study per category (--num-prompts each), their winners exported together


@dataclass
class Optimization:
    """What `optimize` decided: the study, the exported config and its line, and the stop signal that ended the run
    early (None: it ran to its end, projections and plots included)."""

    study: optuna.Study
    config: SkipConfig
    exported: str
    stopped_by: str | None = None
    outcome: str = ""  # with a stop signal: what the stop did to the running trial
    plots: list[Path] = field(default_factory=list)
    by_category: dict[str, Optimization] = field(default_factory=dict)  # with per_category: each category's study


@dataclass
class _Prepared:
    """What `optimize` checked and loaded before it opens the study's storage."""

    loaded: models.LoadedModel
    model_info: ModelInfo
    space: SearchSpace
    policy: DraftPolicy
    prompts: list[list[int]]
    categories: list[str | None]  # each prompt's
    datasets: list[str]  # --dataset, each once
    prompt_datasets: list[str] | None  # each prompt's dataset, with several
    first_trials: tuple[tuple[str, SkipSet], ...]
    profile: CostProfile | None
    projections: list[tuple[str, CostProfile]]
    ranking_prompts: list[list[int]]  # what a trimmed head's ranking is made from (none: the calibration prompts)
    seen_prompts: list[str]  # the digests of the rows of both, which bench holds out


def optimize(settings: OptimizeSettings, say: Callable[[str], None] = print) -> Optimization:
    """Run the study `settings` describe, as `python -m skipsearch optimize` does; `say` gets each line of its
    report as it comes (warm starts, the study's summary, the verdict, the export, projections, plots)."""
    s = settings
    run = _prepare(s, say)
    return _per_category(s, run, say) if s.per_category else _optimize(s, run, say)


def _optimize(s: OptimizeSettings, run: _Prepared, say: Callable[[str], None]) -> Optimization:
    """The study on `run`'s prompts, its confirmation, export, projections and plots."""
    storage, heartbeat = _open_storage(s)
    studied = StudySettings(
        study_name=s.study_name, storage=storage, objective=s.objective,
        sampler=s.sampler, seed=s.seed, n_trials=s.n_trials, timeout=s.timeout, min_match=s.min_match,
        dataset=run.datasets if len(run.datasets) > 1 else run.datasets[0], num_prompts=len(run.prompts),
        max_new_tokens=s.max_new_tokens,
        show_progress_bar=not s.no_progress, warm_starts=not s.no_warm_starts, pruning=not s.no_pruning,
        repeats=s.repeats, confirm_top=s.confirm_top, confirm_repeats=s.confirm_repeats,
        first_trials=run.first_trials, heartbeat=heartbeat, compile=s.compile or None,
    )
    model, stop = run.loaded.model, StopRequest()
    study = run_study(model, run.model_info, run.loaded.dtype_name, run.prompts, studied, run.space, run.policy,
                      model.generation_config.eos_token_id, profile=run.profile, stop=stop,
                      prompt_datasets=run.prompt_datasets, special_token_ids=special_token_ids(run.loaded),
                      ranking_prompts=run.ranking_prompts, seen_prompts=run.seen_prompts)
    config = export_trial(study, s.folder / "best.json")
    result = Optimization(study, config, f"exported {s.folder / 'best.json'}: {exported_text(config)}")
    say(f"study {s.study_name} in {redact_url(s.storage_url(must_exist=False))}: {study_summary(study, s.n_trials)}")
    say("\n".join([verdict(study)[1], *dataset_verdicts(study)]))
    say(result.exported)
    if stop.signal_name:
        # No slow extras (a scheduler's kill follows its SIGTERM): running the command again resumes the study.
        if not s.no_plots:
            say("plots not written after the stop signal: `python -m skipsearch plot` writes them")
        result.stopped_by, result.outcome = stop.signal_name, stop.outcome
        return result
    if run.projections:
        say("\n".join(_projections(study, run, s.max_new_tokens)))
    if not s.no_plots:
        result.plots = write_plots(study, s.folder / "plots")
        say(f"plots: {', '.join(str(p) for p in result.plots)}")
    return result


def _per_category(s: OptimizeSettings, run: _Prepared, say: Callable[[str], None]) -> Optimization:
    """One study per category on its prompts alone (named <study>-<category>), then one config of the categories'
    confirmed sets, each labelled with its categories, among which decoding chooses per prompt."""
    results: dict[str, Optimization] = {}
    for category in dict.fromkeys(run.categories):
        mine = [i for i, c in enumerate(run.categories) if c == category]
        own = replace(s, study_name=category_study_name(s.study_name, category))
        say(f"category {category}: study {own.study_name} on {len(mine)} prompt{'' if len(mine) == 1 else 's'}")
        results[category] = result = _optimize(own, replace(run, prompts=[run.prompts[i] for i in mine],
                                                            categories=[category] * len(mine)), say)
        if result.stopped_by:
            break
    last = results[category]
    earlier = _earlier_decisions(s, [c for c in dict.fromkeys(run.categories) if c not in results])
    configs = {c: results[c].config if c in results else earlier[c] for c in dict.fromkeys(run.categories)
               if c in results or c in earlier}
    config = category_config(configs, s.study_name)
    save_skip_config(config, s.folder / "best.json")
    combined = Optimization(last.study, config, f"exported {s.folder / 'best.json'}: {exported_text(config)}",
                            last.stopped_by, last.outcome, by_category=results)
    combined.exported += f"; {categories_confirmed(configs)}"
    if last.stopped_by:
        combined.exported += (f" (the categories studied before the stop: {', '.join(results)}"
                              + (f"; as an earlier run left them: {', '.join(earlier)})" if earlier else ")"))
    say(combined.exported)
    return combined


def _earlier_decisions(s: OptimizeSettings, categories: list[str]) -> dict[str, SkipConfig]:
    """The decisions of the categories a stop kept this run from, where an earlier run studied them: the combined
    config keeps what those studies confirmed instead of dropping them."""
    found = {}
    for category in categories:
        try:
            study = replace(s, study_name=category_study_name(s.study_name, category)).load_study()
        except ValueError:  # never studied
            continue
        found[category] = decided_config(study)
    return found


def category_study_name(study_name: str, category: str) -> str:
    """A category's study: the study's name suffixed with the category (characters a study name cannot hold as
    '-'), at most 100 characters."""
    return f"{study_name}-{re.sub(r'[^A-Za-z0-9._-]', '-', category)}"[:100]


def _prepare(s: OptimizeSettings, say: Callable[[str], None]) -> _Prepared:
    """Everything `optimize` needs, checked before the storage is opened, so a rejected run leaves no database."""
    policy = s.policy()
    check_measurable(s.max_new_tokens, policy.max_draft_tokens, names=("--max-new-tokens", "--max-draft-tokens"))
    warm_files = [entry for spec in s.warm_start or () for entry in read_warm_starts(spec)]
    if s.too_long not in TOO_LONG:
        raise ValueError(f"--too-long must be one of {', '.join(TOO_LONG)}, got {s.too_long!r}")
    datasets, rows, prompt_datasets = _study_prompts(s)
    _check_confirmable(s, s.num_prompts if s.per_category else len(rows))
    make_sampler(s.sampler, s.seed, s.objective == "pareto")
    if s.heartbeat_grace <= s.heartbeat_interval:
        raise ValueError("--heartbeat-grace must be longer than --heartbeat-interval")
    if s.cost_profile is not None and s.objective != "modeled":
        raise ValueError("--cost-profile is for --objective modeled")
    profile = CostProfile.load(s.cost_profile) if s.cost_profile is not None else None
    check_output_folder(s.folder, "--studies-dir", inside=s.studies_dir)
    loaded = s.load()
    # Refuses decoders the draft path cannot run; names the tokenizer a trimmed head's ids belong to.
    model_info = ModelInfo.of(loaded.model, loaded.name_or_path, loaded.tokenizer)
    space = SearchSpace(num_layers=model_info.num_hidden_layers, keep_first_last=not s.allow_first_last,
                        max_skip_fraction=s.max_skip_fraction, skip_prior=s.skip_prior,
                        head_rows=head_rows(s.head_rows, model_info.vocab_size))
    first_trials = _first_trials(warm_files, model_info, space, not s.no_warm_starts, say)
    if profile is not None:
        profile.check_model(loaded.model)
        say(f"the modeled objective prices rounds with {s.cost_profile} [{profile.label()}]")
    encoded = encode_rows(loaded, rows, s.raw, s.max_new_tokens, policy.max_draft_tokens, s.too_long, say,
                          not s.no_progress)
    if not s.per_category:  # --too-long skip may have left fewer
        _check_confirmable(s, len(encoded.ids))
    if prompt_datasets is not None:  # each prompt kept, with its dataset
        prompt_datasets = [prompt_datasets[i] for i in encoded.kept]
    projections = load_projections(s.project_with or (), loaded.model)
    ranking, ranked_on = _ranking_prompts(s, datasets, rows, loaded, say) if space.head_rows else ([], [])
    seen = sorted({prompt_digest(row.turns) for row in [*rows, *ranked_on]})
    return _Prepared(loaded, model_info, space, policy, encoded.ids, encoded.categories, datasets, prompt_datasets,
                     first_trials, profile, projections, ranking, seen)


def _ranking_prompts(s: OptimizeSettings, datasets: list[str], calibration: list[PromptRow],
                     loaded: models.LoadedModel, say: Callable[[str], None]
                     ) -> tuple[list[list[int]], list[PromptRow]]:
    """The prompts a trimmed head's ranking is made from, and their rows: up to --head-prompts rows of the datasets,
    in their seeded order, that are not calibration prompts, so that the trials measure a head's acceptance on prompts
    its ranking never saw (ranked on the calibration prompts themselves, every head holds their greedy tokens:
    acceptance 1)."""
    chosen = {row.turns for row in calibration}
    # The calibration prompts' draw said already when categories are left out.
    every = [load_rows(d, s.field, s.split, None, s.seed, s.category_field, note=lambda line: None)
             for d in datasets]
    others = [row for rows in itertools.zip_longest(*every) for row in rows if row is not None
              and row.turns not in chosen][: s.head_prompts]
    if not others:
        say("the draft heads' vocabulary is ranked on the calibration prompts (the dataset has no others): the "
            "trials' acceptance of a trimmed head is measured on the prompts that ranked it, and flatters it")
        return [], []
    return encode_rows(loaded, others, s.raw, s.max_new_tokens, 0, "skip", lambda line: None).ids, others


DEFAULT_HEAD_ROWS = (4096, 8192, 16384, 32768)


def head_rows(asked: tuple[int, ...] | None, vocab_size: int) -> tuple[int, ...]:
    """The trimmed heads a study tries: those asked for (each fewer rows than the vocabulary, else ValueError), or by
    default those of DEFAULT_HEAD_ROWS under half the vocabulary (a head of more reads most of the full one's
    weights: a tiny vocabulary gets none)."""
    if asked is None:
        return tuple(r for r in DEFAULT_HEAD_ROWS if 2 * r <= vocab_size)
    too_many = [r for r in asked if r >= vocab_size]
    if too_many:
        raise ValueError(f"--head-rows {too_many[0]} is not fewer than the model's {vocab_size} tokens: a draft head "
                         "trims the vocabulary")
    return tuple(asked)


def _check_confirmable(s: OptimizeSettings, prompts: int) -> None:
    """A ValueError where the confirmation would measure one paired run, or predict one prompt (a modeled study's
    interval spans prompts): no interval, so it could never export."""
    if s.confirm_top and s.objective == "modeled" and prompts < 2:
        raise ValueError("--objective modeled over 1 prompt gives the confirmation one prediction: no interval (it "
                         "spans prompts), so no skip set could ever be exported; raise --num-prompts (or skip the "
                         "confirmation with --confirm-top 0)")
    if s.confirm_top and s.objective != "modeled" and s.confirm_repeats * prompts < 2:
        raise ValueError(f"--confirm-repeats {s.confirm_repeats} over {prompts} prompt gives the confirmation one "
                         "paired run: no interval, so no skip set could ever be confirmed and exported; raise "
                         "--confirm-repeats or --num-prompts (or skip the confirmation with --confirm-top 0)")


def _study_prompts(s: OptimizeSettings) -> tuple[list[str], list[PromptRow], list[str] | None]:
    """The datasets, the calibration prompts of each, interleaved (so that a trial the pruner stops early has
    measured each dataset), and each prompt's dataset (None with one). A dataset with categories is drawn
    stratified (every category represented), or with `per_category` --num-prompts of each category."""
    datasets = s.dataset or [BUILTIN]
    repeated = next((d for i, d in enumerate(datasets) if d in datasets[:i]), None)
    if repeated is not None:
        raise ValueError(f"--dataset {repeated!r} is given twice")
    if s.per_category:
        if len(datasets) > 1:
            raise ValueError("--per-category takes one --dataset (its rows' categories make the studies)")
        if s.category_field == NO_CATEGORIES:
            raise ValueError(f"--per-category needs the rows' categories: --category-field {NO_CATEGORIES} leaves "
                             "them out")
        # Named, so that a row without a category is refused naming it, not left out of a study per category.
        every = load_rows(datasets[0], s.field, s.split, None, s.seed, s.category_field or CATEGORY_FIELD)
        return datasets, [row for group in draw_per_category(every, s.num_prompts, s.seed).values()
                          for row in group], None
    drawn = [load_rows(d, s.field, s.split, s.num_prompts, s.seed, s.category_field) for d in datasets]
    interleaved = [(row, d) for rows in zip(*drawn) for row, d in zip(rows, datasets)]
    return datasets, [row for row, _ in interleaved], [d for _, d in interleaved] if len(datasets) > 1 else None


def _open_storage(s: OptimizeSettings) -> tuple[optuna.storages.BaseStorage, Heartbeat]:
    """The study's storage (made if missing), refused if it holds a study of that name not made by skipsearch."""
    heartbeat = Heartbeat(s.heartbeat_interval, s.heartbeat_grace, s.max_retries)
    if s.storage is None:
        s.studies_dir.mkdir(parents=True, exist_ok=True)  # the default SQLite file lives there
    storage = make_storage(s.storage_url(must_exist=False), heartbeat)
    existing = existing_study(storage, s.study_name)
    # A study with no trials yet may be one that a worker started beside this one has created a moment ago and
    # not yet labelled; taking it over loses nothing.
    if existing is not None and existing[1] > 0 and not made_by_skipsearch(existing[0]):
        raise not_made_by_skipsearch(s.study_name)
    return storage, heartbeat


def _projections(study: optuna.Study, run: _Prepared, max_new_tokens: int, top: int = 3) -> list[str]:
    """The best measured skip sets' predicted speedups with other devices' profiles (`--project-with`)."""
    model, label = run.loaded.model, study_label(study)
    objective = label.objective
    # A modeled study times nothing: its figure is the cost model's for its profile's device, and says so.
    here = ("measured here" if objective != "modeled" else f"predicted for {label.predicted_for}"
            if label.predicted_for else "predicted")
    measured = []
    for trial in ranked(study)[:top]:
        stats = decode_stats(model, run.prompts, trial.skip, run.policy, max_new_tokens,
                             model.generation_config.eos_token_id)
        speedup = quoted_speedup(trial.figures, objective)
        figure = f" ({here} {speedup.estimate:.2f}x)" if speedup is not None else ""
        measured.append((f"trial {trial.number}, {trial.skip}{figure}", trial.skip, stats))
    if not measured:
        return ["--project-with: no completed trial skips anything, nothing to project"]
    return projection_lines(run.projections, measured, run.policy.max_draft_tokens)


def _first_trials(files: list[NamedSkipSet], model: ModelInfo, space: SearchSpace, published: bool,
                  say: Callable[[str], None]) -> tuple[tuple[str, SkipSet], ...]:
    """--warm-start sets (each must fit the model and the search space, else ValueError), then the published
    sets made for a model of this shape that the space can propose."""
    chosen = []
    for entry in files:
        if entry.model is not None and not entry.matches(model):
            made_for = ", ".join(f"{k}={entry.model.get(k)!r}" for k in MODEL_SHAPE)
            raise ValueError(f"warm start {entry.origin} was made for another model ({made_for})")
        skip = entry.skip_set(model.num_hidden_layers)
        reason = outside_space(skip, space)
        if reason:
            raise ValueError(f"warm start {entry.origin} is outside the search space: {reason}")
        chosen.append((entry.origin, skip))
    for entry in matching_skip_sets(model) if published else ():
        skip = entry.skip_set(model.num_hidden_layers)
        reason = outside_space(skip, space)
        if reason:
            say(f"published skip set {entry.origin} left out: {reason}")
        else:
            chosen.append((entry.origin, skip))
    if chosen:
        say(f"warm starts: {', '.join(name for name, _ in chosen)}")
    return tuple(chosen)
