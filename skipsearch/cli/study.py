"""`export` and `plot`: a study's decision as a skip config, and its plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import add_study_flags, non_negative_int, settings_of


EXPORT_HELP = "write a trial's skip config as JSON"
EXPORT_DESCRIPTION = ("Write the study's decision as a skip-config JSON: the skip set its confirmation "
                      "found faster than plain decoding, else plain decoding; or trial N with "
                      "--trial N.")
PLOT_HELP = "write the study's plots as PNG files"
PLOT_DESCRIPTION = ("Write optimization history, parameter importances, skip map, "
                    "speedup vs skipped fraction (and the Pareto front) as PNG files.")


def cmd_export(args: argparse.Namespace) -> int:
    from ..api.study import ExportSettings, export_study  # here: it imports optuna, which --help does without

    exported = export_study(settings_of(ExportSettings, args))
    if exported.verdicts:
        print("\n".join(exported.verdicts))
    print(exported.line)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..api.options import StudyOptions
    from ..api.study import plot_study  # here: it imports matplotlib and optuna, which --help does without

    for path in plot_study(settings_of(StudyOptions, args), args.output):
        print(path)
    return 0


def add_export_flags(exp: argparse.ArgumentParser) -> None:
    exp.add_argument("--trial", type=non_negative_int, default=None, help="trial number (default: the study's confirmed decision)")
    exp.add_argument("--format", choices=("skipsearch", "dv"), default="skipsearch",
                     help="skipsearch: the skip-config JSON; dv: Draft & Verify / SWIFT's skip_layers.json format "
                          "({\"<model>\": {\"attention\": [...], \"mlp\": [...]}})")
    exp.add_argument("--output", type=Path, default=None,
                     help="the file to write (default: <studies-dir>/<study-name>/best.json, or skip_layers.json with "
                          "--format dv)")
    add_study_flags(exp)


def add_plot_flags(plot: argparse.ArgumentParser) -> None:
    plot.add_argument("--output", type=Path, default=None,
                      help="the folder to write the PNGs to (default: <studies-dir>/<study-name>/plots)")
    add_study_flags(plot)
