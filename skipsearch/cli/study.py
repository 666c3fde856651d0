"""`export` and `plot`: a study's decision as a skip config, and its plots."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Commands, Formatter, add_study_flags, non_negative_int, settings_of


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


def add_export(commands: Commands, formatter: Formatter) -> argparse.ArgumentParser:
    exp = commands.add_parser("export", help="write a trial's skip config as JSON", formatter_class=formatter,
                              description="Write the study's decision as a skip-config JSON: the skip set its confirmation "
                                          "found faster than plain decoding, else plain decoding; or trial N with "
                                          "--trial N.")
    exp.add_argument("--trial", type=non_negative_int, default=None, help="trial number (default: the study's confirmed decision)")
    exp.add_argument("--format", choices=("skipsearch", "dv"), default="skipsearch",
                     help="skipsearch: the skip-config JSON; dv: Draft & Verify / SWIFT's skip_layers.json format "
                          "({\"<model>\": {\"attention\": [...], \"mlp\": [...]}})")
    exp.add_argument("--output", type=Path, default=None,
                     help="(default: <studies-dir>/<study-name>/best.json, or skip_layers.json with --format dv)")
    add_study_flags(exp)
    return exp


def add_plot(commands: Commands, formatter: Formatter) -> argparse.ArgumentParser:
    plot = commands.add_parser("plot", help="write the study's plots as PNG files", formatter_class=formatter,
                               description="Write optimization history, parameter importances, skip map, "
                                           "speedup vs skipped fraction (and the Pareto front) as PNG files.")
    plot.add_argument("--output", type=Path, default=None, help="(default: <studies-dir>/<study-name>/plots)")
    add_study_flags(plot)
    return plot
