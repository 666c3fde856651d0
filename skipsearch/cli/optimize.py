"""`optimize`: search for the skip set that decodes fastest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..constants import OBJECTIVES, SAMPLERS
from .arguments import (add_draft_flags, add_model_flags, add_number_flags, add_projection_flag, add_prompt_flags,
                        add_study_flags, head_sizes, non_negative_int, open_unit_float, positive_float, positive_int,
                        seed_value, settings_of, unit_float, warn_of_deprecated_flags)
from .process import INTERRUPTED


HELP = "search for the skip set that decodes fastest"
DESCRIPTION = ("Run (or resume) an Optuna study over attention/MLP skip sets, each measured paired with plain "
               "decoding; re-measure the best few, export the one confirmed faster (else plain decoding) as "
               "JSON and plot the study. Re-running the same command resumes the study up to --n-trials.")


def cmd_optimize(args: argparse.Namespace) -> int:
    from ..api.optimize import OptimizeSettings, optimize  # here: it imports torch, which --help does without

    warn_of_deprecated_flags(args)
    result = optimize(settings_of(OptimizeSettings, args))
    if result.stopped_by:
        # The code of an interrupted command, so that a script or a Kubernetes Job does not take the study for
        # finished: running the command again resumes it.
        print(f"{args.prog}: stopped by {result.stopped_by} {result.outcome}; {result.exported}", file=sys.stderr)
        return INTERRUPTED
    return 0


def add_optimize_flags(opt: argparse.ArgumentParser) -> None:
    prompts = add_prompt_flags(opt, num_prompts=4, max_new_tokens=32, several_datasets=True)
    prompts.add_argument("--per-category", action="store_true",
                         help="one study per category of the dataset (named <study-name>-<category>, --num-prompts "
                              "prompts of each), their confirmed sets exported together in <study-name>/best.json, "
                              "labelled by category, among which decoding chooses per prompt")
    add_search_flags(opt.add_argument_group("search"))
    add_worker_flags(opt.add_argument_group("workers and crash recovery (SQLite / PostgreSQL storages)"))
    out = opt.add_argument_group("output")
    out.add_argument("--no-plots", action="store_true", help="do not write plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_study_flags(opt)
    add_draft_flags(opt)
    add_model_flags(opt).add_argument(
        "--compile", action="store_true",
        help="compiled draft and verify steps on a CPU too (always on CUDA, as CUDA graphs): each layer kind compiles "
             "once for the whole study, a new skip set compiles nothing")


def add_search_flags(search: argparse._ArgumentGroup) -> None:
    search.add_argument("--objective", choices=OBJECTIVES, default="speed_x_acceptance",
                        help="speedup x acceptance rate, speedup alone, both as a Pareto front, or the speedup "
                             "the cost model predicts from measured acceptance (deterministic)")
    search.add_argument("--cost-profile", type=Path, default=None,
                        help="with --objective modeled: a profile from `python -m skipsearch profile`, or a shipped "
                             "profile's name, e.g. nvidia-h200/llama-3-8b (default: profile this device when the "
                             "study starts)")
    add_projection_flag(search, "the best sets'")
    search.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna sampler")
    search.add_argument("--n-trials", type=positive_int, default=20,
                        help="distinct skip sets the study should evaluate (a re-run resumes up to this; repeated "
                             "proposals are answered from earlier trials and do not count)")
    search.add_argument("--timeout", type=positive_float, default=None, help="stop after this many seconds")
    search.add_argument("--seed", type=seed_value, default=0, help="seed of the sampler and of the prompt selection")
    search.add_argument("--skip-prior", type=open_unit_float, default=0.15,
                        help="share of sublayers a uniform draw skips (0.5: the plain 2L-switch space)")
    search.add_argument("--max-skip-fraction", type=unit_float, default=0.5, help="never skip more than this share")
    search.add_argument("--head-rows", type=head_sizes, default=None, metavar="auto|none|N,N,...",
                        help="draft head sizes to search beside the full head: the top rows of the model's vocabulary "
                             "as it ranks it on --head-prompts prompts (auto: 4096 to 32768 rows, those at most half "
                             "the vocabulary; none: the full head only) (default: auto)")
    search.add_argument("--head-prompts", type=positive_int, default=16,
                        help="prompts of the dataset, never calibration prompts, that the draft heads' vocabulary is "
                             "ranked on (the trials then measure a head's acceptance on prompts it was not made from)")
    search.add_argument("--allow-first-last", action="store_true",
                        help="let the search skip sublayers of the first and last layers (kept by default)")
    search.add_argument("--min-match", type=unit_float, default=0.5,
                        help="prune a skip set whose teacher-forced draft/full agreement is below this (0: never)")
    search.add_argument("--no-pruning", action="store_true",
                        help="never stop a trial early (the Wilcoxon pruner compares it prompt by prompt with the best)")
    search.add_argument("--repeats", type=positive_int, default=1,
                        help="paired runs (plain, then skip set, alternating order) per prompt in a trial")
    search.add_argument("--confirm-top", type=non_negative_int, default=3,
                        help="best distinct skip sets re-measured against plain decoding before export (the places "
                             "taken in turn by score and by score at the speedup interval's low end), and with "
                             "several --dataset each dataset's best as many (0: none, so plain decoding is exported)")
    search.add_argument("--confirm-repeats", type=positive_int, default=2,
                        help="paired runs per prompt when confirming")
    search.add_argument("--no-warm-starts", action="store_true",
                        help="do not enqueue the structured first trials, nor the published skip sets of a model "
                             "of this shape (--warm-start files still are)")
    search.add_argument("--warm-start", action="append", metavar="FILE[:NAME]",
                        help="enqueue the skip sets of FILE as the first trials: a skipsearch config, or a Draft & "
                             "Verify / SWIFT skip_layers.json ({\"<name>\": {\"attention\": [...], \"mlp\": [...]}}); "
                             ":NAME picks one entry; repeatable")


def add_worker_flags(workers: argparse._ArgumentGroup) -> None:
    add_number_flags(workers, [
        ("--heartbeat-interval", positive_int, 60, "seconds between a running trial's heartbeats"),
        ("--heartbeat-grace", positive_int, 180,
         "seconds without a heartbeat after which a trial's worker is taken for dead, its trial failed and retried"),
        ("--max-retries", non_negative_int, 2, "times a dead worker's trial is retried"),
    ])
