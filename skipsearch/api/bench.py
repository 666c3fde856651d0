"""`bench`: skipsearch beside HF greedy and its training-free peers on the same prompts, written as JSON and a chart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..costs.profiler import contexts_for, device_name, profile_costs, study_compile_mode
from ..decode.config import SkipConfig, load_skip_config
from ..decode.cost_profile import CostProfile
from ..io.data import BUILTIN, PromptRow, categories_of, load_rows, note_on_stderr
from ..io.files import check_output_file, check_output_folder, output_target
from ..io.models import LoadedModel
from ..report.bench import (BenchRow, Measured, bench_rows, bench_verdict, config_drafts, format_table,
                            measure_methods, run_caption, write_outputs)
from ..report.categories import OVERALL, CategoryRows, category_figure, category_rows, format_category_table
from ..report.projections import load_projections
from ..search.settings import MIN_STUDY_NEW_TOKENS
from .options import ModelOptions
from .prompts import TOO_LONG, EncodedPrompts, encode_rows


CATEGORIES_PNG = "bench_categories.png"
OUTPUTS = ("bench.json", "bench.png", CATEGORIES_PNG)  # what bench writes in its folder (the last with categories)


@dataclass(frozen=True)
class BenchSettings(ModelOptions):
    """`python -m skipsearch bench`'s flags, by name, with its defaults."""

    config: Path | None = None
    include_study_prompts: bool = False  # else the prompts the config's study saw are left out of the draw
    early_exit_layer: int | None = None
    prompt_lookup_tokens: int = 10
    repeats: int = 3
    cost_profile: Path | None = None
    project_with: list[Path] | None = None
    seed: int = 0
    output_dir: Path | None = None  # None: <studies_dir>/bench
    studies_dir: Path = Path("studies")
    no_progress: bool = False
    dataset: str = BUILTIN
    field: str = "prompt"
    split: str = "train"
    num_prompts: int = 4
    max_new_tokens: int = 48
    raw: bool = False
    compile: bool = False
    category_field: str | None = None  # None: "category" where the rows have it; "none": no categories
    too_long: str = "refuse"  # or "skip": a prompt the model's context cannot hold


@dataclass(frozen=True)
class Benchmark:
    rows: list[BenchRow]
    verdict: str | None
    json_path: Path
    png_path: Path
    categories: list[CategoryRows] | None = None  # per category, then overall (None: the rows have no category)
    categories_png: Path | None = None

    def lines(self) -> list[str]:
        """The table, each row's predictions on other devices, the table per category and the verdict, as `bench`
        prints them."""
        predictions = [f"PREDICTION (cost model, not measured) on {label}: {row.method} {speedup:.2f}x over plain "
                       "decoding" for row in self.rows for label, speedup in (row.projected_speedups or {}).items()]
        by_category = ["per category:", format_category_table(self.categories)] if self.categories else []
        return [format_table(self.rows), *predictions, *by_category, *([self.verdict] if self.verdict else [])]


def benchmark(settings: BenchSettings, say: Callable[[str], None] = print) -> Benchmark:
    """Decode the prompts with every method as `python -m skipsearch bench` does, and write bench.json / .png (and,
    when the prompts have categories, bench_categories.png); `say` gets each prompt skipped as too long and what
    prices the predicted speedup."""
    s = settings
    if s.too_long not in TOO_LONG:
        raise ValueError(f"--too-long must be one of {', '.join(TOO_LONG)}, got {s.too_long!r}")
    config_file = check_config_flags(s)
    rows_in = load_rows(s.dataset, s.field, s.split, s.num_prompts, s.seed, s.category_field,
                        study_prompts=_study_prompts(s, config_file))
    output_dir = s.output_dir or s.studies_dir / "bench"
    flag, inside = ("--output-dir", None) if s.output_dir else ("--studies-dir", s.studies_dir)
    check_output_folder(output_dir, flag, inside=inside)
    for name in OUTPUTS:  # each file, before any work: bench.png refused after the run would lose it all
        check_output_file(output_dir / name, flag, inside=inside)
    if s.cost_profile:
        CostProfile.load(s.cost_profile)
    loaded = s.load()
    config = load_skip_config(s.config, loaded.model, loaded.tokenizer) if s.config else None
    projections = load_projections(s.project_with or (), loaded.model)
    num_layers = loaded.model.config.num_hidden_layers
    if s.early_exit_layer is not None and not 1 <= s.early_exit_layer < num_layers:
        raise ValueError(f"--early-exit-layer must be in 1..{num_layers - 1} for this model, got {s.early_exit_layer}")
    prompts = encode_rows(loaded, rows_in, s.raw, s.max_new_tokens, draft_room(s, config), s.too_long, say,
                          not s.no_progress)
    encoded = prompts.ids
    profile = _profile(s, loaded, config, encoded, say)
    measured = measure_methods(loaded.model, encoded, s.max_new_tokens, loaded.model.generation_config.eos_token_id,
                               config=config, early_exit_layer=s.early_exit_layer,
                               prompt_lookup_tokens=s.prompt_lookup_tokens, repeats=s.repeats,
                               show_progress=not s.no_progress, compile=s.compile)
    rows = bench_rows(loaded.model, measured, config, profile, projections)
    groups = _by_category(loaded, measured, prompts, rows, config, categories_of(rows_in))
    verdict = bench_verdict(rows, config, s.max_new_tokens)
    written = _written_settings(s, loaded, prompts, rows_in, config_file)
    # Drawn before anything is written: write_outputs renders every chart first and writes bench.json last.
    figures = {CATEGORIES_PNG: category_figure(groups, f"Speedup per category: {run_caption(written)}")} \
        if groups else None
    json_path, png_path = write_outputs(rows, output_dir, written, verdict,
                                        [g.to_json() for g in groups[:-1]] if groups else None, figures)
    if not groups:
        _drop_stale(output_dir / CATEGORIES_PNG)
    return Benchmark(rows, verdict, json_path, png_path, groups, output_dir / CATEGORIES_PNG if groups else None)


def _drop_stale(path: Path) -> None:
    """Remove an earlier run's figure that this run does not draw: left, it would stand beside a bench.json that has
    no categories as if it were this run's. A stream (a FIFO, a device) is no earlier figure, and stays."""
    if path.is_file() and not output_target(path)[1]:
        path.unlink()


def _by_category(loaded: LoadedModel, measured: Measured, prompts: EncodedPrompts, rows: list[BenchRow],
                 config: SkipConfig | None, order: list[str]) -> list[CategoryRows] | None:
    """Each category's rows in Spec-Bench's order, then all prompts' (None: the prompts have no category)."""
    if not order:
        return None
    groups = category_rows(loaded.model, measured, prompts.categories, order, config)
    return [*groups, CategoryRows(OVERALL, len(prompts.ids), rows)]


def check_config_flags(s: BenchSettings) -> SkipConfig | None:
    """The config file read (not yet checked against the model); a broken one, and flags that mean nothing with the
    config (or without one), refused before the model loads: a projection prices one skip set from its rounds, and a
    config that drafts needs room for a drafting round to measure a draft."""
    if s.include_study_prompts and not s.config:
        raise ValueError("--include-study-prompts keeps a --config's study prompts in the draw: give the --config")
    config = load_skip_config(s.config) if s.config else None
    drafts = config is not None and config_drafts(config)
    if s.project_with and not drafts:
        raise ValueError("--project-with needs a --config that skips something")
    if s.project_with and config.others:
        raise ValueError(f"--project-with prices one skip set, and {s.config} holds {len(config.entries)}, chosen per "
                         "prompt at decoding, which the cost model does not price: bench it without --project-with")
    if drafts and s.max_new_tokens < MIN_STUDY_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {s.max_new_tokens} leaves no room for a draft (the prefill gives the first "
                         "token, a round needs one for a draft and one for the full model's): benching a config that "
                         f"drafts needs --max-new-tokens >= {MIN_STUDY_NEW_TOKENS}")
    return config


def _study_prompts(s: BenchSettings, config: SkipConfig | None) -> frozenset[str]:
    """The digests of the prompts the config's study saw, which the draw leaves out; none with
    --include-study-prompts, or where the config names none (exported before configs did: said, since the draw may
    then hold them)."""
    if config is None or s.include_study_prompts:
        return frozenset()
    if config.search.seen_prompts is None and config.search.study_name is not None:
        note_on_stderr(f"{s.config} does not name its study's prompts (exported before configs did), so none can be "
                       "left out: the prompts drawn may include those its study calibrated on")
    return frozenset(config.search.seen_prompts or ())


def _study_prompts_said(s: BenchSettings, config: SkipConfig | None) -> str | None:
    """What bench.json says of the config's study prompts in the draw."""
    if config is None:
        return None
    if s.include_study_prompts:
        return "kept (--include-study-prompts)"
    return "left out" if config.search.seen_prompts is not None else "unknown: the config names none"


def draft_room(settings: BenchSettings, config: SkipConfig | None) -> int:
    """The tokens past each answer that bench's longest draft can take: the config's, prompt lookup's, or 16."""
    return max(16, settings.prompt_lookup_tokens, config.draft.max_draft_tokens if config is not None else 0)


def _profile(s: BenchSettings, loaded: LoadedModel, config: SkipConfig | None, encoded: list[list[int]],
             say: Callable[[str], None]) -> CostProfile | None:
    """The cost profile that prices the config's predicted speedup: --cost-profile's, else this device's (none for
    a config of several sets, which the cost model does not price)."""
    if config is None or not config.skip.drafts or config.others:
        return None
    if s.cost_profile:
        profile = CostProfile.load(s.cost_profile)
        profile.check_model(loaded.model)
        say(f"the predicted speedup is priced by {s.cost_profile} [{profile.label()}]")
        return profile
    say("profiling this device first, to price the config's predicted speedup (--cost-profile reuses a profile, "
        "e.g. one that `profile` wrote)")
    return profile_costs(loaded.model, contexts=contexts_for(loaded.model, encoded, s.max_new_tokens),
                         show_progress=not s.no_progress, compile_mode=profiled_mode(s.compile, loaded.device))


def profiled_mode(compile: bool, device: torch.device) -> str | None:
    """The steps bench's own profile times, as bench decodes: eager forwards, or with `compile` on CUDA the regional
    steps as CUDA graphs. A CPU's compiled steps (frozen, about 100 s of compiling a step) are priced by the eager
    forwards: a frozen profile would compile a step for every part and width it times."""
    return study_compile_mode(device) if compile else None


def _written_settings(s: BenchSettings, loaded: LoadedModel, prompts: EncodedPrompts, rows: list[PromptRow],
                      config: SkipConfig | None) -> dict:
    """The settings bench.json records beside its rows: with the flags that choose the prompts (the seeded draw of
    `num_prompts_drawn`, stratified by category) and the drawn prompts skipped as too long, so that the draw can be
    made again; `num_prompts` counts the prompts decoded."""
    skipped = [{"where": row.where, "category": row.category} for i, row in enumerate(rows) if i not in prompts.kept]
    return {"model": loaded.name_or_path, "device": str(loaded.device), "dtype": loaded.dtype_name,
            "dataset": s.dataset, "num_prompts": len(prompts.ids), "max_new_tokens": s.max_new_tokens,
            "repeats": s.repeats, "config": str(s.config) if s.config else None,
            "device_name": device_name(loaded.device), "torch_threads": torch.get_num_threads(),
            "project_with": [str(p) for p in s.project_with or ()], "compile": s.compile,
            "seed": s.seed, "field": s.field, "split": s.split, "num_prompts_drawn": s.num_prompts, "raw": s.raw,
            "category_field": s.category_field, "too_long": s.too_long, "skipped_too_long": skipped,
            "study_prompts": _study_prompts_said(s, config)}
